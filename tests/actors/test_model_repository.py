"""Model repositories on disk: version folders, version policies, the model.py contract,
load errors that name the file, and loading/unloading at run time."""

from __future__ import annotations

import shutil
import textwrap
from pathlib import Path

import numpy as np
import pytest

import orchestrion
from orchestrion.frontends._cli import main as cli

IDENTITY = """
def execute(X):
    return {"Y": X * VERSION}
VERSION = @VERSION@
"""

CONFIG = """
name: "{name}"
max_batch_size: 4
input [{{ name: "X" data_type: TYPE_FP32 dims: [ 3 ] }}]
output [{{ name: "Y" data_type: TYPE_FP32 dims: [ 3 ] }}]
{extra}
"""

ENSEMBLE = """
name: "ens"
platform: "ensemble"
max_batch_size: 4
input [{ name: "IN" data_type: TYPE_FP32 dims: [ 3 ] }]
output [{ name: "OUT" data_type: TYPE_FP32 dims: [ 3 ] }]
ensemble_scheduling {
  step [
    { model_name: "scale" model_version: -1 input_map { key: "X" value: "IN" } output_map { key: "Y" value: "mid" } },
    { model_name: "shift" input_map { key: "X" value: "mid" } output_map { key: "Y" value: "OUT" } }
  ]
}
"""


def write_model(
    root: Path,
    name: str,
    versions: tuple[int, ...] = (1,),
    *,
    extra: str = "",
    code: str | None = None,
) -> Path:
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.pbtxt").write_text(CONFIG.format(name=name, extra=extra))
    for version in versions:
        (folder / str(version)).mkdir(exist_ok=True)
        source = code if code is not None else IDENTITY.replace("@VERSION@", str(version))
        (folder / str(version) / "model.py").write_text(textwrap.dedent(source))
    return folder


def write_ensemble(root: Path) -> None:
    write_model(root, "scale")
    write_model(root, "shift", code="def execute(X):\n    return {'Y': X + 10}\n")
    (root / "ens" / "1").mkdir(parents=True)
    (root / "ens" / "config.pbtxt").write_text(ENSEMBLE)


X = np.ones((2, 3), np.float32)


async def test_repository_ensemble_runs(tmp_path: Path) -> None:
    """A repository with an ensemble and its composing models loads and answers."""
    write_ensemble(tmp_path)
    async with orchestrion.open_server(tmp_path) as server:
        assert server.model_names() == ["ens", "scale", "shift"]
        out = (await server.infer("ens", {"IN": X})).outputs["OUT"]
    np.testing.assert_array_equal(out, X + 10)


async def test_a_config_without_platform_or_backend_gets_the_one_its_files_say(
    tmp_path: Path,
) -> None:
    """As Triton's auto-complete of the backend fields: a config naming no platform or
    backend is an ensemble when it has ``ensemble_scheduling`` and an ONNX model when its
    version folder holds a ``model.onnx``; a ``model.py`` is served as before."""
    from support.onnx_graphs import add

    write_ensemble(tmp_path)
    config = (tmp_path / "ens" / "config.pbtxt").read_text()
    (tmp_path / "ens" / "config.pbtxt").write_text(config.replace('platform: "ensemble"', ""))
    onnx = tmp_path / "adder"
    (onnx / "1").mkdir(parents=True)
    (onnx / "1" / "model.onnx").write_bytes(add())
    (onnx / "config.pbtxt").write_text("max_batch_size: 8\n")  # the rest from the graph
    async with orchestrion.open_server(tmp_path) as server:
        assert server.model_config("ens").platform == "ensemble"
        assert server.model_config("adder").platform == "onnxruntime_onnx"
        assert [t.name for t in server.model_config("adder").input] == ["A", "B"]
        out = (await server.infer("ens", {"IN": X})).outputs["OUT"]
        a = np.ones((1, 4), np.float32)
        total = (await server.infer("adder", {"A": a, "B": a})).outputs["SUM"]
    np.testing.assert_array_equal(out, X + 10)
    np.testing.assert_array_equal(total, a * 2)


@pytest.mark.parametrize(
    ("policy", "loaded", "latest_factor"),
    [
        ("", [3], 3),
        ("version_policy: { latest: { num_versions: 2 } }", [2, 3], 3),
        ("version_policy: { all: {} }", [1, 2, 3], 3),
        ("version_policy: { specific: { versions: [1, 3] } }", [1, 3], 3),
        ("version_policy: { specific: { versions: [2] } }", [2], 2),
    ],
)
async def test_version_policy_selects_versions(
    tmp_path: Path, policy: str, loaded: list[int], latest_factor: int
) -> None:
    """version_policy picks the served versions; -1 is the highest of them."""
    folder = write_model(tmp_path, "m", (1, 2, 3), extra=policy)
    (folder / "01").mkdir()  # leading zero: not a version
    (folder / "latest").mkdir()  # not a number: ignored
    async with orchestrion.open_server(tmp_path) as server:
        assert server.model_versions("m") == loaded
        for version in loaded:
            out = await server.infer("m", {"X": X}, model_version=version)
            assert out.outputs["Y"][0, 0] == version
        latest = await server.infer("m", {"X": X})
        assert latest.outputs["Y"][0, 0] == latest_factor
        assert latest.model_version == latest_factor


@pytest.mark.parametrize(
    ("setup", "match"),
    [
        (lambda r: (r / "m").mkdir(), r"m/config.pbtxt: missing"),
        (
            lambda r: (
                write_model(r, "m", code="def execute(X):\n    return {}\n")
                .joinpath("config.pbtxt")
                .write_text('name: "other"')
            ),
            r"name: 'other' does not match the folder name 'm'",
        ),
        (lambda r: shutil.rmtree(write_model(r, "m") / "1"), r"m: no version folder"),
        (
            lambda r: (write_model(r, "m") / "1" / "model.py").unlink(),
            r"m/1/model.py: missing \(the code of version 1\)",
        ),
        (
            lambda r: write_model(r, "m", extra="max_batch_size: 2"),
            r"m/config.pbtxt:.*max_batch_size",
        ),
        (
            lambda r: write_model(
                r,
                "m",
                extra="optimization { priority: PRIORITY_MAX } model_operations { op_library_filename: 'x' }",
            ),
            r"m/config.pbtxt:\d+: field model_operations: not supported by orchestrion",
        ),
        (
            lambda r: write_model(r, "m", extra="version_policy: { specific: { versions: [7] } }"),
            r"version_policy: selects none of the versions present \(1\)",
        ),
        (
            lambda r: write_model(r, "m", code="import nonexistent_module_xyz\n"),
            r"m/1/model.py: import failed: ModuleNotFoundError",
        ),
        (
            lambda r: write_model(r, "m", code="x = 1\n"),
            r"m/1/model.py \(model 'm'\): defines no execute function",
        ),
        (
            lambda r: write_model(r, "m", code="def execute(A):\n    return {}\n"),
            r"execute has no parameter for inputs X",
        ),
        (
            lambda r: write_model(
                r, "m", code="def initialize(c):\n    return 1\ndef execute(X):\n    return {}\n"
            ),
            r"initialize is defined, so execute receives its params first: execute\(params, X\)",
        ),
        (
            lambda r: write_model(
                r,
                "m",
                extra="instance_group [{ kind: KIND_GPU }] "
                "parameters { key: 'execution' value { string_value: 'threads' } }",
            ),
            r"(?s)m/config.pbtxt \(model 'm'\): instance_group kind KIND_GPU, but JAX sees no GPU"
            r".*parameter 'execution' must be one of auto, inline, thread, got 'threads'",
        ),
        (
            lambda r: write_model(
                r,
                "m",
                code="def initialize(config):\n    raise RuntimeError('no weights')\ndef execute(p, X):\n    return {'Y': X}\n",
            ),
            r"m/1/model.py \(model 'm'\): initialize failed: RuntimeError: no weights",
        ),
        (
            lambda r: write_model(r, "m", code="def execute(X):\n    return {'Y': X.reshape(7)}\n"),
            r"m/1/model.py \(model 'm'\): compiling execute at load for the declared shapes \(X: \[4, 3\]",
        ),
    ],
)
async def test_load_errors_name_the_file(tmp_path: Path, setup, match: str) -> None:
    """Each repository mistake is a clear load error that names the file or folder."""
    setup(tmp_path)
    with pytest.raises((orchestrion.ConfigError, orchestrion.ModelLoadError), match=match):
        async with orchestrion.open_server(tmp_path):
            pass


async def test_every_config_error_is_reported_at_once(tmp_path: Path) -> None:
    """Several broken models produce one error listing all of them."""
    (tmp_path / "a").mkdir()
    write_model(tmp_path, "b", extra="instance_group [{ count: 1 kind: KIND_CPU }] foo: 1")
    write_model(tmp_path, "c")
    (tmp_path / "c" / "config.pbtxt").write_text(
        'name: "c" input [{ name: "X" data_type: TYPE_BOGUS }]'
    )
    with pytest.raises(orchestrion.ConfigError) as info:
        async with orchestrion.open_server(tmp_path):
            pass
    assert len(info.value.errors) == 3
    assert "a/config.pbtxt: missing" in info.value.errors[0]
    assert "b/config.pbtxt:" in info.value.errors[1]
    assert "foo" in info.value.errors[1]
    assert "c/config.pbtxt:" in info.value.errors[2]
    assert "TYPE_BOGUS" in info.value.errors[2]


async def test_initialize_params_and_plain_python(tmp_path: Path) -> None:
    """initialize's params reach execute; JIT = False runs plain Python; async execute works."""
    write_model(
        tmp_path,
        "weighted",
        code="""
        import jax.numpy as jnp
        def initialize(config):
            assert config.name == "weighted"
            return {"w": jnp.full((3,), 2.0, jnp.float32)}
        def execute(params, X):
            return {"Y": X * params["w"]}
        """,
    )
    write_model(
        tmp_path,
        "python",
        code="""
        import numpy as np
        JIT = False
        def execute(X):
            assert isinstance(X, np.ndarray)  # not a tracer
            return {"Y": np.asarray([[float(v) + 0.5 for v in row] for row in X], np.float32)}
        """,
    )
    write_model(
        tmp_path,
        "coroutine",
        code="""
        import trio
        JIT = False
        async def execute(X):
            await trio.sleep(0)
            return {"Y": X - 1}
        """,
    )
    async with orchestrion.open_server(tmp_path) as server:
        assert (await server.infer("weighted", {"X": X})).outputs["Y"].tolist() == [[2.0] * 3] * 2
        assert (await server.infer("python", {"X": X})).outputs["Y"].tolist() == [[1.5] * 3] * 2
        assert (await server.infer("coroutine", {"X": X})).outputs["Y"].tolist() == [[0.0] * 3] * 2


async def test_bytes_model_must_opt_out_of_jit(tmp_path: Path) -> None:
    """A jitted model with BYTES tensors is a load error that says to set JIT = False."""
    folder = tmp_path / "text"
    (folder / "1").mkdir(parents=True)
    (folder / "config.pbtxt").write_text(
        'name: "text" input [{ name: "S" data_type: TYPE_STRING dims: [1] }] '
        'output [{ name: "N" data_type: TYPE_INT32 dims: [1] }]'
    )
    (folder / "1" / "model.py").write_text("def execute(S):\n    return {'N': len(S)}\n")
    with pytest.raises(
        orchestrion.ConfigError, match="cannot pass through jax.jit; set JIT = False"
    ):
        async with orchestrion.open_server(tmp_path):
            pass


async def test_load_and_unload_at_run_time(tmp_path: Path) -> None:
    """Models load by name (an ensemble brings its composing models) and unload safely."""
    write_ensemble(tmp_path)
    write_model(tmp_path, "extra")
    async with orchestrion.open_server(models=[]) as server:
        assert server.model_names() == []
    # A server that knows the repository but starts with python models only.
    python_model = orchestrion.Model(
        config=orchestrion.ModelConfig(
            name="py",
            input=(
                orchestrion.TensorConfig(name="X", data_type=orchestrion.DataType.FP32, dims=(3,)),
            ),
            output=(
                orchestrion.TensorConfig(name="Y", data_type=orchestrion.DataType.FP32, dims=(3,)),
            ),
        ),
        execute=lambda X: {"Y": X},
    )
    async with orchestrion.open_server(tmp_path, [python_model]) as server:
        await server.unload_model("ens")
        await server.unload_model("scale")
        assert not server.is_model_ready("ens")
        with pytest.raises(orchestrion.ModelNotFoundError):
            await server.infer("ens", {"IN": X})
        await server.load_model("ens")  # brings 'scale' back too
        assert server.is_model_ready("scale")
        assert (await server.infer("ens", {"IN": X})).outputs["OUT"].tolist() == [[11.0] * 3] * 2
        with pytest.raises(orchestrion.ConfigError, match="used by ensembles ens"):
            await server.unload_model("shift")
        await server.unload_model("shift", unload_dependents=True)
        assert server.model_names() == ["extra", "py", "scale"]
        with pytest.raises(orchestrion.ConfigError, match="has no model folder 'nope'"):
            await server.load_model("nope")
        with pytest.raises(orchestrion.ConfigError, match="has no model folder"):
            await server.load_model("../outside")
        await server.unload_model("py")
        assert server.model_names() == ["extra", "scale"]


async def test_reload_replaces_the_model_after_the_new_one_is_ready(tmp_path: Path) -> None:
    """Loading a loaded model again serves the new code; a failed reload keeps the old one."""
    folder = write_model(tmp_path, "m")
    async with orchestrion.open_server(tmp_path) as server:
        assert (await server.infer("m", {"X": X})).outputs["Y"][0, 0] == 1
        (folder / "1" / "model.py").write_text("def execute(X):\n    return {'Y': X * 5}\n")
        await server.load_model("m")
        assert (await server.infer("m", {"X": X})).outputs["Y"][0, 0] == 5
        (folder / "1" / "model.py").write_text("raise ImportError('broken on purpose')\n")
        with pytest.raises(orchestrion.ModelLoadError, match="broken on purpose"):
            await server.load_model("m")
        assert (await server.infer("m", {"X": X})).outputs["Y"][0, 0] == 5


def test_validate_command_reports_every_problem(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`orchestrion validate` lists all problems and exits 1; a good repository exits 0."""
    write_ensemble(tmp_path)
    assert cli(["validate", "--model-repository", str(tmp_path)]) == 0
    assert "OK: 3 models" in capsys.readouterr().out
    (tmp_path / "ens" / "config.pbtxt").write_text(ENSEMBLE.replace('"shift"', '"shiftt"'))
    write_model(tmp_path, "bad", code="def execute(Q):\n    return {}\n")
    assert cli(["validate", "--model-repository", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "3 problem(s)" in out
    assert "steps use models that are not in the repository: 'shiftt'" in out
    assert "execute has no parameter for inputs X" in out
    assert "execute requires parameters that are not config inputs: Q" in out
    assert cli(["validate", "--model-repository", str(tmp_path / "bad")]) == 1
    assert "is a model folder" in capsys.readouterr().out
