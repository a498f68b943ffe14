"""Response parameters and error codes of python-backend models, in-process: pb_utils'
checks in Triton's words, the parameters on every path a response takes (the scheduler,
the inline fast path, dynamic batches, streams), and a model's error response as
`orchestrion.ModelReportedError` with its code."""

from __future__ import annotations

import contextlib
import json
from typing import Any

import numpy as np
import pytest
import trio
import triton_python_backend_utils as pb_utils

import orchestrion
from orchestrion.protocols import DynamicBatching, ModelTransactionPolicy
from orchestrion.testing import tensor, triton_model

X = [tensor("X", dims=(1,))]
Y = [tensor("Y", dims=(1,))]


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ([], "Expect dict, got <class 'list'>"),
        ("{}", "Expect dict, got <class 'str'>"),
        ({1: "x"}, "Expect parameters keys to have type str, found type <class 'int'>"),
        (
            {"f": 0.5},
            "Expect parameters values to have type bool/int/str, found type <class 'float'>",
        ),
        (
            {"n": None},
            "Expect parameters values to have type bool/int/str, found type <class 'NoneType'>",
        ),
        (
            {"d": {}},
            "Expect parameters values to have type bool/int/str, found type <class 'dict'>",
        ),
    ],
)
@pytest.mark.parametrize("kind", ["response", "request"])
def test_parameters_are_checked_as_triton_checks_them(
    kind: str, parameters: Any, message: str
) -> None:
    """A response's or a BLS request's parameters: a dict of str keys and bool, int or str
    values (float refused, as Triton refuses it); anything else raises Triton's text."""
    make: Any = (
        pb_utils.InferenceResponse
        if kind == "response"
        else lambda parameters: pb_utils.InferenceRequest(model_name="m", parameters=parameters)
    )
    with pytest.raises(pb_utils.TritonModelException) as caught:
        make(parameters=parameters)
    assert str(caught.value) == message


def test_parameters_read_back_as_json_text() -> None:
    """``parameters()`` is the JSON text of what was given; none given is ``{}``."""
    given = {"b": True, "i": -3, "s": "x"}
    assert json.loads(pb_utils.InferenceResponse(parameters=given).parameters()) == given
    assert pb_utils.InferenceResponse().parameters() == "{}"
    assert pb_utils.InferenceResponse(parameters=None).parameters() == "{}"


def test_triton_error_takes_its_message_by_keyword_and_defaults_to_internal() -> None:
    """``TritonError(message=..., code=...)`` as Triton's models write it; no message is
    refused, as Triton refuses it."""
    error = pb_utils.TritonError(message="m", code=pb_utils.TritonError.NOT_FOUND)
    assert (error.message(), error.code()) == ("m", pb_utils.TritonError.NOT_FOUND)
    assert pb_utils.TritonError("n").code() == pb_utils.TritonError.INTERNAL
    with pytest.raises(TypeError):
        pb_utils.TritonError(None)  # type: ignore[arg-type]


class Tagged:
    """Y = X; the response's parameters say the request's row and who answered."""

    def execute(self, requests: list[Any]) -> list[Any]:
        out = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            tags = {"x": int(x.ravel()[0]), "batch": len(requests), "by": "tagged"}
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x)], parameters=tags))
        return out


@pytest.mark.parametrize("execution", ["inline", "thread"])
async def test_a_responses_parameters_travel_on_every_path(execution: str) -> None:
    """The parameters a model sets reach the caller's `InferResponse`: one by one (inline,
    the fast path; or through the queue in a thread), and in dynamic batches, each request
    its own."""
    single = triton_model("single", Tagged, X, Y, parameters={"execution": execution})
    batched = triton_model(
        "batched",
        Tagged,
        X,
        Y,
        max_batch_size=8,
        dynamic_batching=DynamicBatching(max_queue_delay_microseconds=20_000),
        parameters={"execution": execution},
    )
    async with orchestrion.open_server(models=[single, batched]) as server:
        for i in range(3):
            response = await server.infer("single", {"X": np.array([i], np.float32)})
            assert response.parameters == {"x": i, "batch": 1, "by": "tagged"}
        got: dict[int, Any] = {}

        async def one(i: int) -> None:
            response = await server.infer("batched", {"X": np.array([[i]], np.float32)})
            got[i] = response.parameters

        async with trio.open_nursery() as nursery:
            for i in range(6):
                nursery.start_soon(one, i)
    assert {i: (p["x"], p["by"]) for i, p in got.items()} == {i: (i, "tagged") for i in range(6)}
    assert max(p["batch"] for p in got.values()) > 1  # several requests in one execute


async def test_a_decoupled_models_responses_carry_their_parameters() -> None:
    """Each response of a stream carries the parameters it was sent with."""

    class Counting:
        def execute(self, requests: list[Any]) -> None:
            sender = requests[0].get_response_sender()
            for n in range(3):
                tensors = [pb_utils.Tensor("Y", np.array([n], np.float32))]
                sender.send(pb_utils.InferenceResponse(tensors, parameters={"n": n}))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    definition = triton_model(
        "counting", Counting, X, Y, model_transaction_policy=ModelTransactionPolicy(decoupled=True)
    )
    async with orchestrion.open_server(models=[definition]) as server:
        stream = server.stream_infer("counting", {"X": np.ones(1, np.float32)})
        async with contextlib.aclosing(stream) as responses:
            seen = [r.parameters async for r in responses]
    assert seen == [{"n": 0}, {"n": 1}, {"n": 2}]


async def test_an_error_response_is_the_models_own_error_with_its_code() -> None:
    """``InferenceResponse(error=TritonError(msg, code))``: the caller gets
    `orchestrion.ModelReportedError`, the message as written, the code by Triton's name (an
    unknown number is UNKNOWN); the other requests of the same execute are answered."""

    class Refusing:
        def execute(self, requests: list[Any]) -> list[Any]:
            out = []
            for request in requests:
                x = int(pb_utils.get_input_tensor_by_name(request, "X").as_numpy().ravel()[0])
                if x < 0:
                    error = pb_utils.TritonError(message=f"refused {x}", code=-x)
                    out.append(pb_utils.InferenceResponse(error=error))
                else:
                    tensors = [pb_utils.Tensor("Y", np.array([x], np.float32))]
                    out.append(pb_utils.InferenceResponse(tensors))
            return out

    definition = triton_model("refusing", Refusing, X, Y)
    async with orchestrion.open_server(models=[definition]) as server:
        for code, name in [(3, "INVALID_ARG"), (2, "NOT_FOUND"), (7, "CANCELLED"), (99, "UNKNOWN")]:
            with pytest.raises(orchestrion.ModelReportedError) as caught:
                await server.infer("refusing", {"X": np.array([-code], np.float32)})
            assert (str(caught.value), caught.value.code) == (f"refused {-code}", name)
            assert caught.value.model_name == "refusing"
        assert (await server.infer("refusing", {"X": np.ones(1, np.float32)})).outputs["Y"] == 1
        stats = server.model_statistics("refusing")[0]
    assert stats.failures_by_reason == {"BACKEND": 4}
