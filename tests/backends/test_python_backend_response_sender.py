"""The response sender of a python-backend model that is not decoupled, as Triton's
(its QA's ``response_sender`` cases): the first response sent is the request's answer,
whatever ``execute`` does after; a second one, or the final flag before any, raises in
the model's code in Triton's words; a None in the returned list waits for the response
that a thread of the model sends later. And a decoupled ``execute`` that returns a list
fails in Triton's words, naming the instance."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

import numpy as np
import pytest
import trio
import triton_python_backend_utils as pb_utils

import orchestrion
from orchestrion.protocols import DynamicBatching, ModelTransactionPolicy
from orchestrion.testing import tensor, triton_model

X = [tensor("X", "INT32", (1,))]
Y = [tensor("Y", "INT32", (1,))]
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
SAID: list[str] = []
"""What the model's own code caught (each test clears it)."""


def _answer(value: int) -> Any:
    return pb_utils.InferenceResponse([pb_utils.Tensor("Y", np.array([value], np.int32))])


class _Sender:
    """X selects what the model does with a request: 1 sends twice (the second raises),
    2 sends then returns a response too, 3 sends the final flag first, 4 answers from a
    thread after ``execute`` returned None for it in its list, 5 returns a response, 6
    sends then raises."""

    def execute(self, requests: list[Any]) -> list[Any]:
        returned: list[Any] = []
        for request in requests:
            mode = int(pb_utils.get_input_tensor_by_name(request, "X").as_numpy().flat[0])
            sender = request.get_response_sender()
            returned.append(None)
            if mode == 1:
                sender.send(_answer(10))
                try:
                    sender.send(_answer(11), flags=FINAL)
                except pb_utils.TritonModelException as exc:
                    SAID.append(str(exc))
                sender.send(flags=FINAL)
            elif mode == 2:
                sender.send(_answer(20), flags=FINAL)
                returned[-1] = _answer(21)
            elif mode == 3:
                try:
                    sender.send(flags=FINAL)
                except pb_utils.TritonModelException as exc:
                    SAID.append(str(exc))
                returned[-1] = _answer(30)
            elif mode == 4:
                later = threading.Thread(target=self._later, args=(sender,))
                later.start()
            elif mode == 5:
                returned[-1] = _answer(50)
            elif mode == 6:
                sender.send(_answer(60), flags=FINAL)
                raise RuntimeError("raised after its response was sent")
        return returned

    @staticmethod
    def _later(sender: Any) -> None:
        time.sleep(0.05)
        sender.send(_answer(40), flags=FINAL)


def _sender_model(**config: Any) -> Any:
    return triton_model("sender", _Sender, X, Y, **config)


@pytest.mark.parametrize(
    "config",
    [
        {},
        {
            "max_batch_size": 8,
            "dynamic_batching": DynamicBatching(max_queue_delay_microseconds=50_000),
        },
    ],
    ids=["alone", "batched"],
)
async def test_the_first_response_sent_is_the_answer(config: dict[str, Any]) -> None:
    SAID.clear()
    model = _sender_model(**config)
    x = (lambda m: np.array([[m]], np.int32)) if config else (lambda m: np.array([m], np.int32))
    async with orchestrion.open_server(models=[model]) as server:
        got: dict[int, Any] = {}

        async def ask(mode: int) -> None:
            got[mode] = (await server.infer("sender", {"X": x(mode)})).outputs["Y"]

        async with trio.open_nursery() as nursery:
            for mode in (1, 2, 3, 4, 5):  # batched: in one execute call
                nursery.start_soon(ask, mode)
        sent_then_raised = await server.infer("sender", {"X": x(6)})
    assert {mode: int(np.ravel(y)[0]) for mode, y in got.items()} == {
        1: 10,
        2: 20,
        3: 30,
        4: 40,
        5: 50,
    }
    assert int(np.ravel(sent_then_raised.outputs["Y"])[0]) == 60
    assert sorted(set(SAID)) == [
        "Unable to send response. Non-decoupled model cannot send complete final before "
        "sending a response.",
        "Unable to send response. Non-decoupled model cannot send more than one response.",
    ]


async def test_a_decoupled_execute_that_returns_responses_fails_in_tritons_words() -> None:
    class Returns:
        def execute(self, requests: list[Any]) -> list[Any]:
            return [_answer(1) for _ in requests]

    model = triton_model(
        "returns", Returns, X, Y, model_transaction_policy=ModelTransactionPolicy(decoupled=True)
    )
    async with orchestrion.open_server(models=[model]) as server:
        responses = server.stream_infer("returns", {"X": np.array([1], np.int32)})
        async with contextlib.aclosing(responses) as each:
            with pytest.raises(orchestrion.InferenceError) as failed:
                await anext(each)
    assert (
        "Python model 'returns_0_0' is using the decoupled mode and the execute function "
        "must return None." in str(failed.value)
    )


class _Gathered:
    """Decoupled: each request answered from a thread with the size of the call it came in
    (and its place in it); the first request of a call gets an error response instead."""

    def execute(self, requests: list[Any]) -> None:
        for index, request in enumerate(requests):
            sender = request.get_response_sender()
            threading.Thread(target=self._answer, args=(sender, index, len(requests))).start()

    @staticmethod
    def _answer(sender: Any, index: int, size: int) -> None:
        if index == 0:
            response = pb_utils.InferenceResponse(error=pb_utils.TritonError("first of a call"))
        else:
            seen = np.array([[size, index]], np.int32)
            response = pb_utils.InferenceResponse([pb_utils.Tensor("Y", seen)])
        sender.send(response, flags=FINAL)


async def test_a_decoupled_model_with_dynamic_batching_gets_its_requests_in_one_call() -> None:
    """As Triton's dynamic batcher gives a decoupled python model its requests (its QA's
    decoupled_execute_error): requests arriving within ``max_queue_delay_microseconds``
    come in one ``execute(requests)``, each answered through its own sender; a batch is
    cut at ``max_batch_size`` rows (here 3), the rest coming in the next call."""
    model = triton_model(
        "gathered",
        _Gathered,
        [tensor("X", "INT32", (1,))],
        [tensor("Y", "INT32", (2,))],
        max_batch_size=3,
        dynamic_batching=DynamicBatching(max_queue_delay_microseconds=1_000_000),
        model_transaction_policy=ModelTransactionPolicy(decoupled=True),
    )
    outcomes: list[Any] = []
    async with orchestrion.open_server(models=[model]) as server:

        async def ask(value: int) -> None:
            responses = server.stream_infer("gathered", {"X": np.array([[value]], np.int32)})
            try:
                async with contextlib.aclosing(responses) as each:
                    outcomes.extend([r.outputs["Y"].ravel().tolist() async for r in each])
            except orchestrion.InferenceError as exc:
                outcomes.append(str(exc))

        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                for value in range(5):
                    nursery.start_soon(ask, value)
                    await trio.sleep(0.01)
    errors = [o for o in outcomes if isinstance(o, str)]
    assert errors == ["first of a call"] * 2  # two calls: 3 rows, then 2
    assert sorted(o for o in outcomes if not isinstance(o, str)) == [[2, 1], [3, 1], [3, 2]]
