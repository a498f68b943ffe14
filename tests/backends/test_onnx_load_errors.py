"""ONNX models that cannot load, in a repository that serves others: a corrupt ``.onnx``, a
missing one, and graphs that disagree with their configs, each a clear load error naming
what is wrong while the other models serve; auto-complete with a config that sets only
``max_batch_size``; ``orchestrion validate`` on the same folders."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import orchestrion
from orchestrion.protocols import ConfigError, ModelLoadError, OrchestrionError
from support import onnx_graphs

GOOD = 'platform: "onnxruntime_onnx"\nmax_batch_size: 8\n'

DISAGREEING = {
    "wrong_name": """
platform: "onnxruntime_onnx"
max_batch_size: 8
input [ { name: "X", data_type: TYPE_FP32, dims: [ 4 ] }, { name: "B", data_type: TYPE_FP32, dims: [ 4 ] } ]
output [ { name: "SUM", data_type: TYPE_FP32, dims: [ 4 ] } ]
""",
    "wrong_type": """
platform: "onnxruntime_onnx"
max_batch_size: 8
input [ { name: "A", data_type: TYPE_INT32, dims: [ 4 ] }, { name: "B", data_type: TYPE_FP32, dims: [ 4 ] } ]
output [ { name: "SUM", data_type: TYPE_FP32, dims: [ 4 ] } ]
""",
    "wrong_rank": """
backend: "onnxruntime"
max_batch_size: 8
input [ { name: "A", data_type: TYPE_FP32, dims: [ 2, 2 ] }, { name: "B", data_type: TYPE_FP32, dims: [ 4 ] } ]
output [ { name: "SUM", data_type: TYPE_FP32, dims: [ 4 ] } ]
""",
}

EXPECTED = {
    "corrupt": r"corrupt/1/model\.onnx: ONNX Runtime cannot load it: .*(?i:protobuf)",
    "missing": r"missing/1/model\.onnx: missing \(the ONNX graph of version 1\)",
    "wrong_name": r"input 'X': not in the graph, whose names are A, B \(.*wrong_name/1/model\.onnx\)",
    "wrong_type": r"wrong_type/config\.pbtxt \(model 'wrong_type'\): input 'A': TYPE_INT32 in the config, TYPE_FP32 in the graph",
    "wrong_rank": r"input 'A': shape \[-1, 4\] in the graph, \[batch, 2, 2\] in the config",
}


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    """``good`` (a config with only max_batch_size) next to five models that cannot load."""
    onnx_graphs.model_folder(tmp_path, "good", onnx_graphs.add(), GOOD)
    onnx_graphs.model_folder(tmp_path, "corrupt", b"\x08\x07 this is not an ONNX graph", GOOD)
    onnx_graphs.model_folder(tmp_path, "missing", None, GOOD)
    for name, config in DISAGREEING.items():
        onnx_graphs.model_folder(tmp_path, name, onnx_graphs.add(), config)
    return tmp_path


async def test_a_config_with_only_max_batch_size_is_completed(repository: Path) -> None:
    """The inputs and outputs come from the graph, the size stays, the batcher is added."""
    async with orchestrion.open_server(model_repository=repository, load_models=["good"]) as server:
        config = server.model_config("good")
        a = np.ones((3, 4), np.float32)
        response = await server.infer("good", {"A": a, "B": a})
    assert config.max_batch_size == 8
    assert config.dynamic_batching is not None
    assert [(t.name, t.dims) for t in config.input] == [("A", (4,)), ("B", (4,))]
    np.testing.assert_array_equal(response.outputs["DIFF"], np.zeros((3, 4), np.float32))


@pytest.mark.parametrize("bad", sorted(EXPECTED))
async def test_each_broken_model_is_a_load_error_and_the_others_serve(
    repository: Path, bad: str
) -> None:
    """Loading the broken model fails with its reason (the files named); ``good`` keeps
    serving and the broken one is not loaded."""
    async with orchestrion.open_server(model_repository=repository, load_models=["good"]) as server:
        with pytest.raises((ConfigError, ModelLoadError), match=EXPECTED[bad]):
            await server.load_model(bad)
        assert server.model_names() == ["good"]
        a = np.ones((1, 4), np.float32)
        response = await server.infer("good", {"A": a, "B": a})
    np.testing.assert_array_equal(response.outputs["SUM"], a * 2)


async def test_a_repository_with_a_broken_model_does_not_start(repository: Path) -> None:
    """Loading the whole repository at start fails with the reason (Triton, by default,
    exits when a model fails to load too); load the good ones by name instead."""
    with pytest.raises(OrchestrionError) as raised:
        async with orchestrion.open_server(model_repository=repository):
            pass
    text = str(raised.value)
    assert "missing/1/model.onnx: missing" in text


def test_validate_reports_the_disagreements(repository: Path) -> None:
    """``orchestrion validate`` opens the graphs too: every broken model is listed."""
    done = subprocess.run(
        [sys.executable, "-m", "orchestrion", "validate", "--model-repository", str(repository)],
        capture_output=True,
        text=True,
        timeout=120,
        env={"COLUMNS": "400", "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 1, done.stdout + done.stderr
    for name in ("corrupt", "missing", "wrong_name", "wrong_type", "wrong_rank"):
        assert f"{name}/" in done.stdout, done.stdout
    assert "good/" not in done.stdout


def test_model_control_finds_folders_without_a_config(tmp_path: Path) -> None:
    """Explicit mode's ``--load-model=*``, poll mode and the repository index see a folder
    that is only ``1/model.onnx`` (or only a python model's ``1/model.py``) as a model;
    a folder with neither is not one."""
    from orchestrion.frontends._control import model_folders

    onnx_graphs.model_folder(tmp_path, "onnx_only", onnx_graphs.add())
    (tmp_path / "python_only" / "1").mkdir(parents=True)
    (tmp_path / "python_only" / "1" / "model.py").write_text("class TritonPythonModel: ...\n")
    (tmp_path / "notes" / "1").mkdir(parents=True)
    assert [p.name for p in model_folders(tmp_path)] == ["onnx_only", "python_only"]


async def test_without_auto_complete_a_partial_config_is_a_load_error(repository: Path) -> None:
    """``auto_complete_config=False`` (Triton's ``--disable-auto-complete-config``): the
    graph completes nothing, so a config with only ``max_batch_size`` fails, naming the
    inputs it leaves out; a folder without a config is not a model at all."""
    onnx_graphs.model_folder(repository, "no_config", onnx_graphs.add())
    async with orchestrion.open_server(
        model_repository=repository, load_models=[], auto_complete_config=False
    ) as server:
        with pytest.raises(ConfigError, match="inputs the config does not declare: A, B"):
            await server.load_model("good")
        with pytest.raises(OrchestrionError, match="auto-complete is disabled"):
            await server.load_model("no_config")
