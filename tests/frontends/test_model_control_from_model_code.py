"""``pb_utils.load_model`` / ``unload_model`` from a model's code, as Triton's (its QA's
``bls_request_rescheduling`` and ``bls_model_loading``): against ``orchestrion serve`` in
explicit model control mode they load and unload as load requests do (a config given as
JSON text, files by ``file:`` name); elsewhere they fail in the model's code with the
reason, and the model answers."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import tritonclient.http as httpclient

import orchestrion
from orchestrion.testing import Served, start_server

CONFIG = """
name: "{name}"
backend: "python"
input [ {{ name: "X" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [ {{ name: "Y" data_type: TYPE_INT32 dims: [ 1 ] }} ]
"""

TARGET = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        y = pb_utils.Tensor("Y", np.array([{value}], np.int32))
        return [pb_utils.InferenceResponse([y]) for _ in requests]
"""

CONTROLLER = """
import json

import numpy as np
import triton_python_backend_utils as pb_utils

OTHER = {other!r}


class TritonPythonModel:
    def execute(self, requests):
        seen = []

        def ready(name, version=""):
            seen.append(pb_utils.is_model_ready(name, version))

        try:
            ready("target")
            pb_utils.load_model("target")
            ready("target")
            pb_utils.unload_model("target")
            ready("target")
            tensor = {{"data_type": "TYPE_INT32", "dims": [1]}}
            config = json.dumps({{
                "backend": "python",
                "input": [{{"name": "X", **tensor}}],
                "output": [{{"name": "Y", **tensor}}],
            }})
            pb_utils.load_model("other", config, {{"file:1/model.py": OTHER.encode()}})
            ready("other", "1")
            answer = pb_utils.InferenceRequest(
                model_name="other", inputs=[pb_utils.Tensor("X", np.array([0], np.int32))],
                requested_output_names=["Y"]).exec()
            seen.append(str(pb_utils.get_output_tensor_by_name(answer, "Y").as_numpy()[0]))
            try:
                pb_utils.load_model("missing")
            except pb_utils.TritonModelException as exc:
                seen.append(str(exc))
        except pb_utils.TritonModelException as exc:
            seen.append(str(exc))
        text = pb_utils.Tensor("Y", np.array([json.dumps(seen).encode()], np.object_))
        return [pb_utils.InferenceResponse([text]) for _ in requests]
"""


def _repository(root: Path) -> Path:
    for name, code in (
        ("target", TARGET.format(value=7)),
        ("controller", CONTROLLER.format(other=TARGET.format(value=11))),
    ):
        (root / name / "1").mkdir(parents=True)
        (root / name / "1" / "model.py").write_text(code)
        config = CONFIG.format(name=name)
        if name == "controller":  # answers with what it saw, as JSON text
            config = config.replace('"Y" data_type: TYPE_INT32', '"Y" data_type: TYPE_STRING')
        (root / name / "config.pbtxt").write_text(config)
    return root


def _ask(served: Served) -> list[object]:
    with httpclient.InferenceServerClient(served.http) as client:
        x = httpclient.InferInput("X", [1], "INT32")
        x.set_data_from_numpy(np.array([0], np.int32))
        result = client.infer("controller", [x])
    return json.loads(result.as_numpy("Y")[0])  # type: ignore[no-any-return]


def test_load_and_unload_from_a_models_code_in_explicit_mode(tmp_path: Path) -> None:
    served = start_server(
        "--model-control-mode=explicit", "--load-model=controller", repository=_repository(tmp_path)
    )
    try:
        seen = _ask(served)
    finally:
        served.stop()
    assert seen[:5] == [False, True, False, True, "11"]
    assert seen[5].startswith("load_model: ")
    assert "missing" in seen[5]


def test_outside_explicit_mode_they_fail_in_the_models_code(tmp_path: Path) -> None:
    served = start_server(repository=_repository(tmp_path))
    try:
        seen = _ask(served)
    finally:
        served.stop()
    assert seen[0] is True
    assert seen[1] == (
        "load_model: explicit model load / unload is not allowed in model control mode "
        "'none' (start the server with --model-control-mode=explicit)"
    )


async def test_in_process_they_say_where_loading_is_done(tmp_path: Path) -> None:
    async with orchestrion.open_server(_repository(tmp_path)) as server:
        response = await server.infer("controller", {"X": np.array([0], np.int32)})
    seen = json.loads(response.outputs["Y"][0])
    assert seen[0] is True
    assert seen[1].startswith("load_model: load_model from a model's code needs a served")


SETUP = """
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.seen = []

        def ready(name):
            self.seen.append(pb_utils.is_model_ready(name))

        ready("target")
        pb_utils.load_model("target")
        ready("target")
        pb_utils.unload_model("target")
        pb_utils.unload_model("target")     # not loaded: nothing to do, as in Triton
        ready("target")
        pb_utils.load_model("target")       # left loaded for the client to call
        try:
            pb_utils.InferenceRequest(
                model_name="target", inputs=[pb_utils.Tensor("X", np.array([0], np.int32))],
                requested_output_names=["Y"]).exec()
        except pb_utils.TritonModelException as exc:
            self.seen.append(str(exc))

    def execute(self, requests):
        text = pb_utils.Tensor("Y", np.array([json.dumps(self.seen).encode()], np.object_))
        return [pb_utils.InferenceResponse([text]) for _ in requests]
"""


def test_initialize_loads_and_unloads_models_while_it_loads(tmp_path: Path) -> None:
    """Triton's bls_model_loading: a model whose initialize uses the model loading API,
    itself loaded by a load request: its nested loads and unloads run inside that load
    (no deadlock on the load lock), unloading a model that is not loaded succeeds, the
    model it loaded serves, and BLS inference from initialize is still refused."""
    root = _repository(tmp_path)
    (root / "setup" / "1").mkdir(parents=True)
    (root / "setup" / "1" / "model.py").write_text(SETUP)
    config = CONFIG.format(name="setup").replace(
        '"Y" data_type: TYPE_INT32', '"Y" data_type: TYPE_STRING'
    )
    (root / "setup" / "config.pbtxt").write_text(config)
    served = start_server("--model-control-mode=explicit", repository=root)
    try:
        with httpclient.InferenceServerClient(served.http) as client:
            client.load_model("setup")
            x = httpclient.InferInput("X", [1], "INT32")
            x.set_data_from_numpy(np.array([0], np.int32))
            seen = json.loads(client.infer("setup", [x]).as_numpy("Y")[0])
            assert client.infer("target", [x]).as_numpy("Y").tolist() == [7]
            client.unload_model("never_loaded")  # Triton: no effect, and a success
    finally:
        assert served.stop() == 0, served.text()
    assert seen[:3] == [False, True, False]
    assert seen[3].startswith("BLS is only supported during the 'execute' function.")
