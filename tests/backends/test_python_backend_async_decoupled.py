"""A decoupled python-backend model's ``async def execute`` runs several requests of one
instance at once on the model's asyncio loop, as Triton's python backend does (its README,
"Async Execute"; ``qa/L0_backend_python/async_execute``); an ``execute`` that raises after
its final flag is logged, with the exception's type."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import numpy as np
import pytest
import trio
import triton_python_backend_utils as pb_utils

import orchestrion
from orchestrion.protocols import ModelTransactionPolicy
from orchestrion.testing import tensor, triton_model

DECOUPLED = ModelTransactionPolicy(decoupled=True)
X = [tensor("X", dims=(1,))]
Y = [tensor("Y", dims=(1,))]


def _gathering(expected: int) -> tuple[type, dict[str, int]]:
    """A model whose executions each wait (at most 5 s) until ``expected`` of them run at
    once, then answer how many ran at once; serial executions would each time out."""
    seen = {"running": 0, "most": 0}

    class Gathering:
        def initialize(self, args: dict[str, str]) -> None:
            self.all_in: asyncio.Event | None = None

        async def execute(self, requests: list[Any]) -> None:
            if self.all_in is None:
                self.all_in = asyncio.Event()
            seen["running"] += 1
            seen["most"] = max(seen["most"], seen["running"])
            if seen["running"] >= expected:
                self.all_in.set()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.all_in.wait(), 5)
            seen["running"] -= 1
            for request in requests:
                out = pb_utils.Tensor("Y", np.array([seen["most"]], np.float32))
                request.get_response_sender().send(
                    pb_utils.InferenceResponse([out]),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
                )

    return Gathering, seen


async def test_async_executions_of_one_instance_run_at_once() -> None:
    """Four streams to a one-instance decoupled model with ``async def execute``: the four
    executions run at once (each sees the others start), and each stream gets its answer."""
    model, seen = _gathering(4)
    definition = triton_model("gathering", model, X, Y, model_transaction_policy=DECOUPLED)
    answers: list[float] = []
    async with orchestrion.open_server(models=[definition]) as server:

        async def one() -> None:
            stream = server.stream_infer("gathering", {"X": np.ones(1, np.float32)})
            async with contextlib.aclosing(stream) as responses:
                answers.extend([float(r.outputs["Y"][0]) async for r in responses])

        with trio.fail_after(4):  # four serial executions would take 20 s
            async with trio.open_nursery() as nursery:
                for _ in range(4):
                    nursery.start_soon(one)
    assert seen["most"] == 4
    assert answers == [4.0] * 4


async def test_an_execute_that_raises_after_its_final_flag_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The final flag is out, then ``execute`` raises: the stream has ended cleanly; the
    failure is in the log in Triton's words, with the exception's type."""

    class Late:
        async def execute(self, requests: list[Any]) -> None:
            for request in requests:
                request.get_response_sender().send(
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
                )
            raise ValueError("wait_secs cannot be negative")

    definition = triton_model("late", Late, X, Y, model_transaction_policy=DECOUPLED)
    async with orchestrion.open_server(models=[definition]) as server:
        stream = server.stream_infer("late", {"X": np.ones(1, np.float32)})
        async with contextlib.aclosing(stream) as responses:
            assert [r async for r in responses] == []
        for _ in range(100):  # the execution ends just after its final flag
            if "wait_secs" in caplog.text:
                break
            await trio.sleep(0.01)
    assert (
        "Failed to process the request(s) for model 'late_0_0', "
        "message: ValueError: wait_secs cannot be negative"
    ) in caplog.text


async def test_async_bls_callers_wait_for_a_decoupled_callee_without_holding_their_loop() -> None:
    """Four requests, 50 ms apart, to a decoupled caller whose ``async def execute`` awaits
    ``async_exec(decoupled=True)`` of the gathering model and then iterates its responses:
    ``async_exec`` gives the iterator once the first response has come (as Triton's), so no
    caller holds its asyncio loop while the callee works, and the four callee executions
    meet."""
    callee, seen = _gathering(4)

    class Caller:
        async def execute(self, requests: list[Any]) -> None:
            for request in requests:
                call = pb_utils.InferenceRequest(
                    model_name="gathering",
                    inputs=[pb_utils.Tensor("X", np.ones(1, np.float32))],
                    requested_output_names=["Y"],
                )
                sender = request.get_response_sender()
                for response in await call.async_exec(decoupled=True):
                    y = pb_utils.get_output_tensor_by_name(response, "Y")
                    sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("Y", y.as_numpy())]))
                sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    models = [
        triton_model("gathering", callee, X, Y, model_transaction_policy=DECOUPLED),
        triton_model("caller", Caller, X, Y, model_transaction_policy=DECOUPLED),
    ]
    answers: list[float] = []
    async with orchestrion.open_server(models=models) as server:

        async def one() -> None:
            stream = server.stream_infer("caller", {"X": np.ones(1, np.float32)})
            async with contextlib.aclosing(stream) as responses:
                answers.extend([float(r.outputs["Y"][0]) async for r in responses])

        with trio.fail_after(4):
            async with trio.open_nursery() as nursery:
                for _ in range(4):
                    nursery.start_soon(one)
                    await trio.sleep(0.05)
    assert seen["most"] == 4
    assert answers == [4.0] * 4
