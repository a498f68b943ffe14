"""Python-based backends, as Triton finds them: a config's ``backend: "<name>"`` that is none
of orchestrion's own runs ``<backend directory>/<name>/model.py`` (``--backend-directory``),
each model with its own instance of the backend's code and its own folder
(``pb_utils.get_model_dir()``). Served through ``orchestrion serve`` to tritonclient, with a
load request's config override, and in-process; a missing backend, a backend without
``TritonPythonModel`` and a backend name that is not a folder name are load errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import triton_python_backend_utils as pb_utils
import tritonclient.grpc as grpcclient

import orchestrion
from orchestrion import ConfigError, Model, ModelConfig, ModelLoadError
from orchestrion.backends import check_model
from orchestrion.repository import ConfigReading, revision, scan_repository
from support.served import start_server

BACKEND = """
import json
import os

import numpy as np
import triton_python_backend_utils as pb_utils

from backend_helper import OPERATIONS      # a module beside the backend's model.py


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(config):
        if not os.path.isfile(os.path.join(pb_utils.get_model_dir(), "model.json")):
            raise ValueError(f"get_model_dir() is {pb_utils.get_model_dir()}")
        names = {i["name"] for i in config.as_dict()["input"]}
        for name in ("A", "B"):
            if name not in names:
                config.add_input({"name": name, "data_type": "TYPE_FP32", "dims": [4]})
        if not config.as_dict()["output"]:
            config.add_output({"name": "OUT", "data_type": "TYPE_FP32", "dims": [4]})
            for name in ("WHERE", "REPOSITORY"):
                config.add_output({"name": name, "data_type": "TYPE_STRING", "dims": [1]})
        return config

    def initialize(self, args):
        folder = pb_utils.get_model_dir()
        with open(os.path.join(folder, "model.json")) as file:
            self.operation = OPERATIONS[json.load(file)["operation"]]
        self.args = args

    def execute(self, requests):
        answers = []
        for request in requests:
            a = pb_utils.get_input_tensor_by_name(request, "A").as_numpy()
            b = pb_utils.get_input_tensor_by_name(request, "B").as_numpy()
            out = pb_utils.Tensor("OUT", self.operation(a, b).astype(np.float32))
            where = pb_utils.Tensor("WHERE", np.array([pb_utils.get_model_dir()], np.object_))
            repository = np.array([self.args["model_repository"]], np.object_)
            answers.append(
                pb_utils.InferenceResponse(
                    [out, where, pb_utils.Tensor("REPOSITORY", repository)]
                )
            )
        return answers
"""

HELPER = """
OPERATIONS = {"add": lambda a, b: a + b, "sub": lambda a, b: a - b}
"""

A = np.array([1.0, 2.0, 3.0, 4.0], np.float32)
B = np.array([0.5, 0.5, 0.5, 0.5], np.float32)


def _backend(root: Path, name: str = "add_sub", code: str = BACKEND) -> Path:
    folder = root / "backends" / name
    folder.mkdir(parents=True)
    (folder / "model.py").write_text(code)
    (folder / "backend_helper.py").write_text(HELPER)
    return root / "backends"


def _model(repository: Path, name: str, operation: str, versions: tuple[int, ...] = (1,)) -> None:
    (repository / name).mkdir(parents=True)
    (repository / name / "config.pbtxt").write_text('backend: "add_sub"\n')
    for version in versions:
        (repository / name / str(version)).mkdir()
        (repository / name / str(version) / "model.json").write_text(
            json.dumps({"operation": operation})
        )


async def test_two_models_share_a_backend_each_with_its_own_folder(tmp_path: Path) -> None:
    """``add`` and ``sub`` run the same backend code, each configured by the model.json of
    its own version folder (``get_model_dir()``), its inputs completed by the backend's
    ``auto_complete_config``; Triton's ``model_repository`` argument is the model's folder,
    not the backend's."""
    backends = _backend(tmp_path)
    repository = tmp_path / "models"
    _model(repository, "add", "add")
    _model(repository, "sub", "sub")
    async with orchestrion.open_server(repository, backend_directory=backends) as server:
        added = await server.infer("add", {"A": A, "B": B})
        subtracted = await server.infer("sub", {"A": A, "B": B})
        config = server.model_config("add")
    assert added.outputs["OUT"].tolist() == (A + B).tolist()
    assert subtracted.outputs["OUT"].tolist() == (A - B).tolist()
    assert added.outputs["WHERE"].tolist() == [str(repository / "add" / "1").encode()]
    assert subtracted.outputs["WHERE"].tolist() == [str(repository / "sub" / "1").encode()]
    assert added.outputs["REPOSITORY"].tolist() == [str(repository / "add").encode()]
    assert config.backend == "add_sub"
    assert [t.name for t in config.input] == ["A", "B"]


def test_served_with_backend_directory_and_a_load_override(tmp_path: Path) -> None:
    """Triton's python_based_backends case: ``serve --backend-directory`` in explicit mode;
    ``add`` loaded with a config override serving two versions, ``sub`` from its folder;
    tritonclient over gRPC gets each version's answer."""
    backends = _backend(tmp_path)
    repository = tmp_path / "models"
    _model(repository, "add", "add", versions=(1, 2))
    _model(repository, "sub", "sub")
    served = start_server(
        f"--backend-directory={backends}", "--model-control-mode=explicit", repository=repository
    )
    try:
        client = grpcclient.InferenceServerClient(served.grpc)
        override = {"backend": "add_sub", "version_policy": {"latest": {"num_versions": 2}}}
        client.load_model("add", config=json.dumps(override))
        client.load_model("sub")
        for model, version, expected in (
            ("add", "2", A + B),
            ("add", "1", A + B),
            ("sub", "", A - B),
        ):
            assert client.is_model_ready(model, model_version=version)
            inputs = [grpcclient.InferInput(n, [4], "FP32") for n in ("A", "B")]
            inputs[0].set_data_from_numpy(A)
            inputs[1].set_data_from_numpy(B)
            result = client.infer(model, inputs, model_version=version)
            assert result.as_numpy("OUT").tolist() == expected.tolist()
            folder = repository / model / (version or "1")
            assert result.as_numpy("WHERE").tolist() == [str(folder).encode()]
        client.close()
    finally:
        assert served.stop() == 0, served.text()


async def test_a_backend_that_is_not_there_is_a_load_error_naming_the_directory(
    tmp_path: Path,
) -> None:
    """A backend name found neither among orchestrion's own nor in the backend directory:
    the error names the config, the backend and the file looked for."""
    backends = _backend(tmp_path)
    repository = tmp_path / "models"
    (repository / "m" / "1").mkdir(parents=True)
    (repository / "m" / "config.pbtxt").write_text('backend: "pytorch"\n')
    with pytest.raises(ConfigError) as caught:
        async with orchestrion.open_server(repository, backend_directory=backends):
            pass
    message = str(caught.value)
    assert str(repository / "m" / "config.pbtxt") in message
    assert "field backend: 'pytorch'" in message
    assert str(backends / "pytorch" / "model.py") in message
    assert "--backend-directory" in message


async def test_a_backend_without_triton_python_model_is_a_load_error(tmp_path: Path) -> None:
    backends = _backend(tmp_path, code="def execute(A, B):\n    return {'OUT': A + B}\n")
    repository = tmp_path / "models"
    _model(repository, "add", "add")
    with pytest.raises(ConfigError, match="defines no TritonPythonModel class .*'add_sub'"):
        async with orchestrion.open_server(repository, backend_directory=backends):
            pass


async def test_initialize_failing_in_the_backend_names_the_backend_file(tmp_path: Path) -> None:
    """A model whose folder asks the backend for what it cannot do: its load fails with the
    backend's own error, the backend file named."""
    backends = _backend(tmp_path)
    repository = tmp_path / "models"
    _model(repository, "add", "multiply")
    with pytest.raises(ModelLoadError) as caught:
        async with orchestrion.open_server(repository, backend_directory=backends):
            pass
    assert str(backends / "add_sub" / "model.py") in str(caught.value)
    assert "KeyError: 'multiply'" in str(caught.value)


def test_the_revision_covers_the_backends_code(tmp_path: Path) -> None:
    """The response cache's revision of a model changes with its backend's files, so that
    no answer of the old backend code is served from the cache."""
    backends = _backend(tmp_path)
    repository = tmp_path / "models"
    _model(repository, "add", "add")
    reading = ConfigReading(backend_directory=backends)
    entries, errors = scan_repository(repository, reading=reading)
    assert errors == []
    before = revision(entries[0], 1)
    (backends / "add_sub" / "backend_helper.py").write_text(HELPER + "\n# changed\n")
    assert revision(entries[0], 1) != before


def test_a_model_made_in_python_needs_a_triton_model_for_another_backend() -> None:
    """In Python, a backend name of no backend of orchestrion's runs only a
    ``TritonPythonModel`` class given as ``triton_model``."""
    config = ModelConfig(name="m", backend="tensorflow")
    problems = check_model(Model(config=config, execute=lambda: {}, jit=False))
    assert len(problems) == 1
    assert "backend 'tensorflow' is not supported" in problems[0]
    assert "--backend-directory" in problems[0]

    class Backend:
        def execute(self, requests: list[object]) -> list[object]:
            return []

    assert check_model(Model(config=config, triton_model=Backend)) == []


def test_get_model_dir_outside_a_model_says_where_it_works() -> None:
    with pytest.raises(pb_utils.TritonModelException, match="only available in a model's code"):
        pb_utils.get_model_dir()
