"""A composing model that leaves an output out, over the wire: `orchestrion serve` of
tests/left_out_models against tritonclient (HTTP and gRPC) gives the answers Triton 2.51 gave
for the same repository: the response without the output (also when the client named it,
and an empty ``outputs`` list when it was the only one asked for), or, when a later step
requires the left-out tensor, Triton's status for that step's refused request (400,
INVALID_ARGUMENT) with a message that also says which step left it out."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from orchestrion.testing import Served, post
from support.served import start_server

REPOSITORY = Path(__file__).resolve().parents[1] / "left_out_models"
A = np.arange(16, dtype=np.int32).reshape(1, 16)
B = np.ones((1, 16), np.int32)
PROTOCOLS = ("http", "grpc")


@pytest.fixture(scope="module")
def server() -> Iterator[Served]:
    served = start_server(repository=REPOSITORY)
    yield served
    assert served.stop() == 0, served.text()


def _infer(server: Served, protocol: str, model: str, outputs: list[str] | None) -> Any:
    """One tritonclient request of ``model`` with INPUT0 = A, INPUT1 = B: the InferResult."""
    module: Any = httpclient if protocol == "http" else grpcclient
    client = module.InferenceServerClient(getattr(server, protocol))
    try:
        inputs = [module.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
        inputs[0].set_data_from_numpy(A)
        inputs[1].set_data_from_numpy(B)
        requested = None if outputs is None else [module.InferRequestedOutput(o) for o in outputs]
        return client.infer(model, inputs, outputs=requested)
    finally:
        client.close()


def _names(result: Any, protocol: str) -> list[str]:
    response = result.get_response()
    if protocol == "http":
        return [o["name"] for o in response["outputs"]]
    return [o.name for o in response.outputs]


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize(
    ("outputs", "expected"),
    [
        (None, ["OUTPUT0"]),
        (["OUTPUT0", "OUTPUT1"], ["OUTPUT0"]),
        (["OUTPUT0"], ["OUTPUT0"]),
        (["OUTPUT1"], []),
    ],
    ids=str,
)
@pytest.mark.parametrize(
    "model", ["ensemble_partial_add_sub", "partial_add_sub", "ensemble_jax_partial"]
)
def test_an_output_left_out_is_missing_from_the_response(
    server: Served, protocol: str, model: str, outputs: list[str] | None, expected: list[str]
) -> None:
    """Triton's ensemble_partial_add_sub test, and the same model asked directly: OUTPUT1
    is not in the response, named or not."""
    result = _infer(server, protocol, model, outputs)
    assert _names(result, protocol) == expected
    assert result.as_numpy("OUTPUT1") is None
    if expected:
        total = A if model == "ensemble_partial_add_sub" else A + B  # step 1 made INPUT1 - INPUT1
        assert result.as_numpy("OUTPUT0").tolist() == total.tolist()


def test_verbose_logging_names_the_output_no_composing_model_gave() -> None:
    """With --log-verbose 1 the server logs Triton's line for the left-out OUTPUT1 (Triton's
    qa/L0_simple_ensemble reads its log for it), once per response that lacks it."""
    line = "Composing models did not output tensor OUTPUT1"
    served = start_server("--log-verbose", "1", repository=REPOSITORY)
    try:
        _infer(served, "grpc", "ensemble_partial_add_sub", ["OUTPUT0", "OUTPUT1"])
        _infer(served, "http", "ensemble_partial_add_sub", ["OUTPUT0"])  # not asked: no line
    finally:
        assert served.stop() == 0, served.text()
    text = served.text()
    assert text.count(line) == 1, text
    assert "did not output tensor OUTPUT0" not in text


def test_the_json_answer_without_the_only_output_asked_for(server: Served) -> None:
    """The JSON body, as Triton writes it: ``"outputs": []``."""
    body = {
        "inputs": [
            {"name": n, "datatype": "INT32", "shape": [1, 16], "data": v.ravel().tolist()}
            for n, v in (("INPUT0", A), ("INPUT1", B))
        ],
        "outputs": [{"name": "OUTPUT1"}],
    }
    status, answer = post(
        server.http, "/v2/models/ensemble_partial_add_sub/infer", json.dumps(body).encode()
    )
    assert status == 200, answer
    document = json.loads(answer)
    assert document["model_name"] == "ensemble_partial_add_sub"
    assert document["outputs"] == []


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("outputs", [None, ["OUT0", "OUT1"], ["OUT1"]], ids=str)
def test_a_left_out_tensor_a_later_step_requires_is_a_refused_request(
    server: Served, protocol: str, outputs: list[str] | None
) -> None:
    """identity requires mid, which partial_add_sub left out: 400 / INVALID_ARGUMENT (as
    Triton), saying the input is missing and which step left the tensor out."""
    with pytest.raises(InferenceServerException) as refused:
        _infer(server, protocol, "ensemble_left_out_required", outputs)
    status = str(refused.value.status())
    assert status == ("400" if protocol == "http" else "StatusCode.INVALID_ARGUMENT")
    message = refused.value.message()
    assert message.startswith("in ensemble 'ensemble_left_out_required', step[1]: ")
    assert "missing required input" in message
    assert "'INPUT0'" in message
    assert "(tensor 'mid': step[0]'s model 'partial_add_sub' left its output 'OUTPUT1' out)" in (
        message
    )


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_asking_only_for_what_needs_no_refused_step(server: Served, protocol: str) -> None:
    """Only OUT0: the step that would be refused is pruned, and the answer is OUT0."""
    result = _infer(server, protocol, "ensemble_left_out_required", ["OUT0"])
    assert _names(result, protocol) == ["OUT0"]
    assert result.as_numpy("OUT0").tolist() == (A + B).tolist()


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_left_out_tensor_an_optional_input_takes(server: Served, protocol: str) -> None:
    """optional_add runs without b: PRESENT = 0, OUT = INPUT0 + INPUT1."""
    result = _infer(server, protocol, "ensemble_left_out_optional", None)
    assert sorted(_names(result, protocol)) == ["OUT", "PRESENT"]
    assert result.as_numpy("OUT").tolist() == (A + B).tolist()
    assert result.as_numpy("PRESENT").tolist() == np.zeros_like(A).tolist()
