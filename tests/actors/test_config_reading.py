"""How a repository's configs are read: Triton's auto-complete (a python-backend model's
``auto_complete_config``, a folder without ``config.pbtxt``) and ``--model-config-name``,
through `open_server`'s ``auto_complete_config`` and ``model_config_name``."""

from __future__ import annotations

from pathlib import Path

import pytest

import orchestrion

_TENSORS = """
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
"""
_CODE = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(config):
        config.set_max_batch_size(4)
        config.add_input({"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [4]})
        config.add_output({"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [4]})
        return config

    def execute(self, requests):
        return [
            pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy())]
            )
            for r in requests
        ]
"""


def _repository(root: Path) -> Path:
    """completes (config.pbtxt without max_batch_size: auto_complete_config sets 4) and
    noconfig (the same code, no config.pbtxt)."""
    for name in ("completes", "noconfig"):
        (root / name / "1").mkdir(parents=True)
        (root / name / "1" / "model.py").write_text(_CODE)
    (root / "completes" / "config.pbtxt").write_text(f'backend: "python"\n{_TENSORS}')
    return root


async def test_auto_complete_by_default(tmp_path: Path) -> None:
    """As Triton by default: auto_complete_config completes both, with or without a file."""
    async with orchestrion.open_server(_repository(tmp_path)) as server:
        assert server.model_config("completes").max_batch_size == 4
        assert server.model_config("noconfig").max_batch_size == 4


async def test_without_auto_complete_every_config_is_complete(tmp_path: Path) -> None:
    """auto_complete_config=False: auto_complete_config is not called (max_batch_size stays
    0), and a folder without config.pbtxt is a load error naming the file."""
    root = _repository(tmp_path)
    async with orchestrion.open_server(
        root, load_models=["completes"], auto_complete_config=False
    ) as server:
        assert server.model_config("completes").max_batch_size == 0
    with pytest.raises(orchestrion.ConfigError) as refused:
        async with orchestrion.open_server(root, auto_complete_config=False):
            pass
    assert str(refused.value) == (
        f"{root}/noconfig/config.pbtxt: missing (auto-complete is disabled: every model "
        "folder needs a complete config.pbtxt)"
    )


async def test_model_config_name_picks_the_config_of_each_folder(tmp_path: Path) -> None:
    """model_config_name="cpu": completes reads configs/cpu.pbtxt (its parameter says so);
    noconfig has none and still auto-completes; without the name, config.pbtxt."""
    root = _repository(tmp_path)
    (root / "completes" / "configs").mkdir()
    (root / "completes" / "configs" / "cpu.pbtxt").write_text(
        f'backend: "python"\nparameters {{ key: "which" value: {{ string_value: "cpu" }} }}\n'
        f"{_TENSORS}"
    )
    async with orchestrion.open_server(root, model_config_name="cpu") as server:
        assert server.model_config("completes").parameters == {"which": "cpu"}
        assert server.model_config("noconfig").max_batch_size == 4
    async with orchestrion.open_server(root) as server:
        assert server.model_config("completes").parameters == {}


@pytest.mark.parametrize("name", ["../cpu", "a/b", "..", "with space"])
async def test_a_config_name_is_a_plain_file_name(tmp_path: Path, name: str) -> None:
    """A model_config_name that is not a plain file name is refused before anything loads."""
    with pytest.raises(orchestrion.ConfigError, match="not a plain file name"):
        async with orchestrion.open_server(_repository(tmp_path), model_config_name=name):
            pass
