"""Synchronous BLS calls from a python-backend model running inline on the event loop: the
call waits on trio through a greenback portal instead of the model hopping to a worker
thread. Each test checks what a skeptic would doubt: that it is inline at all, that the
loop keeps serving while a BLS call waits, that waiting is not counted as the model's own
time, that a model whose own code is slow still leaves the loop, that cancellation still
reaches the called model, and that code which cannot wait through a portal (threads of its
own, response senders) stays threaded."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
import triton_python_backend_utils as pb_utils

import orchestrion
from orchestrion import InferenceTimeoutError
from orchestrion.actors import _instances
from orchestrion.actors._instances import SWITCH_WINDOW
from orchestrion.testing import inside, model, tensor, triton_model

REPOSITORY = Path(__file__).resolve().parents[1] / "triton_models"
A = np.array([1, 2, 3, 4], np.float32)
B = np.array([4, 3, 2, 1], np.float32)
X = [tensor("X", dims=(1,))]
Y = [tensor("Y", dims=(1,))]
ONE = np.ones(1, np.float32)


class _Forward:
    """Calls ``callee`` (BLS) with its input and answers what it answered."""

    callee = "callee"
    own_pause = 0.0

    def execute(self, requests: list[Any]) -> list[Any]:
        answers = []
        for request in requests:
            if self.own_pause:
                time.sleep(self.own_pause)
            x = pb_utils.get_input_tensor_by_name(request, "X")
            response = pb_utils.InferenceRequest(
                model_name=self.callee, inputs=[x], requested_output_names=["Y"]
            ).exec()
            if response.has_error():
                raise pb_utils.TritonModelException(response.error().message())
            y = pb_utils.get_output_tensor_by_name(response, "Y")
            answers.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", y.as_numpy())]))
        return answers


class _SlowOwnCode(_Forward):
    own_pause = 0.002


def _callee(pause: float = 0.0) -> orchestrion.Model:
    """Y = X + 1; ``pause``: each call sleeps that long (in its worker thread)."""

    def execute(X: Any) -> dict[str, Any]:
        if pause:
            time.sleep(pause)
        return {"Y": X + 1}

    return model("callee", execute, X, Y, jit=False)


async def _until_inline(server: orchestrion.AsyncServer, name: str, windows: int = 25) -> bool:
    runner = inside(server).runner(name)
    for _ in range(windows * SWITCH_WINDOW):
        out = await server.infer(name, {"X": ONE})
        assert out.outputs["Y"].tolist() == [2.0]
        if runner.instances[0].inline:
            return True
    return False


async def test_the_bls_example_comes_inline_and_answers_as_before() -> None:
    """tests/triton_models/bls (Triton's examples/bls) calls add_sub: its code waits only
    through synchronous BLS calls, so it may wait through a portal, comes inline once a
    window of executions proves short, and answers as it did from a worker thread."""
    async with orchestrion.open_server(
        model_repository=REPOSITORY, load_models=["bls", "add_sub"]
    ) as server:
        bls = inside(server).runner("bls")
        assert bls.capabilities.waits_through_portal
        name = np.array([b"add_sub"], dtype=object)
        inputs = {"MODEL_NAME": name, "INPUT0": A, "INPUT1": B}
        for _ in range(25 * SWITCH_WINDOW):
            out = (await server.infer("bls", inputs)).outputs
            assert out["OUTPUT0"].tolist() == [5, 5, 5, 5]
            assert out["OUTPUT1"].tolist() == [-3, -1, 1, 3]
            if bls.instances[0].inline:
                break
        assert bls.instances[0].inline
        for _ in range(SWITCH_WINDOW):
            out = (await server.infer("bls", inputs)).outputs
            assert out["OUTPUT0"].tolist() == [5, 5, 5, 5]


async def test_waiting_on_a_slow_callee_is_not_the_models_time_and_the_loop_serves_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The callee sleeps 5 ms a call (in its thread): the caller's own code is short, so it
    stays inline though each execution lasts 5 ms; while it waits, the event loop serves
    others (a plain model answers 20 requests meanwhile).

    The caller's own code (building the BLS request and its answer) took 80-120 µs a call
    on this machine from one day to the next, around the 100 µs under which an instance
    comes inline: the bar is raised to 300 µs here, still far below the 5 ms a counted wait
    would add, so the test checks the waiting and not the machine's speed."""
    monkeypatch.setattr(_instances, "INLINE_BELOW_NS", 300_000)
    forward = triton_model("forward", _Forward, X, Y)
    plain = model("plain", lambda X: {"Y": X * 3}, X, Y, jit=False)
    async with orchestrion.open_server(models=[_callee(0.005), forward, plain]) as server:
        assert await _until_inline(server, "forward")
        answered: list[float] = []

        async def meanwhile() -> None:
            for _ in range(20):
                started = time.perf_counter()
                await server.infer("plain", {"X": ONE})
                answered.append(time.perf_counter() - started)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(meanwhile)
            for _ in range(10):
                out = await server.infer("forward", {"X": ONE})
                assert out.outputs["Y"].tolist() == [2.0]
        assert inside(server).instances("forward")[0].inline
        assert len(answered) == 20
        assert sorted(answered)[10] < 0.004  # not held up behind the 5 ms waits


async def test_a_bls_model_whose_own_code_is_slow_leaves_the_loop() -> None:
    """Its own code sleeps 2 ms an execution before the BLS call: that is its own time, so
    it runs in a worker thread."""
    slow = triton_model("slow_own", _SlowOwnCode, X, Y)
    async with orchestrion.open_server(models=[_callee(), slow]) as server:
        for _ in range(3 * SWITCH_WINDOW):
            out = await server.infer("slow_own", {"X": ONE})
            assert out.outputs["Y"].tolist() == [2.0]
        assert not inside(server).instances("slow_own")[0].inline


async def test_the_clients_timeout_cancels_an_inline_bls_call() -> None:
    """A request that times out while its inline caller waits on a BLS call: the callee's
    work is cancelled, the caller sees a CANCELLED error and the server serves on."""
    called: list[str] = []
    go_slow = [False]

    async def callee(X: Any) -> dict[str, Any]:
        if go_slow[0]:
            called.append("started")
            try:
                await trio.sleep(30)
            except trio.Cancelled:
                called.append("cancelled")
                raise
        return {"Y": X + 1}

    forward = triton_model("forward", _Forward, X, Y)
    async with orchestrion.open_server(
        models=[model("callee", callee, X, Y, jit=False), forward]
    ) as server:
        assert await _until_inline(server, "forward")
        go_slow[0] = True
        with trio.fail_after(10):
            with pytest.raises(InferenceTimeoutError):
                await server.infer("forward", {"X": ONE}, timeout=0.3)
            while len(called) < 2:  # noqa: ASYNC110 (the callee's own task reports)
                await trio.sleep(0.01)
        assert called == ["started", "cancelled"]
        go_slow[0] = False
        out = await server.infer("forward", {"X": ONE})
        assert out.outputs["Y"].tolist() == [2.0]
        assert server.model_statistics("forward")[0].pending_request_count == 0


@pytest.mark.parametrize("name", ["bls_decoupled"])
async def test_a_decoupled_bls_call_reads_its_responses_inline(name: str) -> None:
    """bls_decoupled iterates square's responses (exec(decoupled=True)) from the event
    loop once inline: the sums stay n * n."""
    async with orchestrion.open_server(
        model_repository=REPOSITORY, load_models=[name, "square"]
    ) as server:
        runner = inside(server).runner(name)
        assert runner.capabilities.waits_through_portal
        for _ in range(25 * SWITCH_WINDOW):
            out = (await server.infer(name, {"IN": np.array([3], np.int32)})).outputs
            assert out["SUM"].tolist() == [9]
            if runner.instances[0].inline:
                break
        for n in (4, 0, 7):
            out = (await server.infer(name, {"IN": np.array([n], np.int32)})).outputs
            assert out["SUM"].tolist() == [n * n]


async def test_code_that_cannot_wait_through_a_portal_stays_threaded() -> None:
    """A model that starts threads of its own, or answers through a response sender, may
    wait on the event loop from elsewhere: it never runs inline, however fast."""

    class WithThread:
        def execute(self, requests: list[Any]) -> list[Any]:
            import threading

            x = pb_utils.get_input_tensor_by_name(requests[0], "X")
            threading.Thread(target=lambda: None).start()
            response = pb_utils.InferenceRequest(
                model_name="callee", inputs=[x], requested_output_names=["Y"]
            ).exec()
            y = pb_utils.get_output_tensor_by_name(response, "Y")
            return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", y.as_numpy())])]

    threaded = triton_model("threaded", WithThread, X, Y)
    async with orchestrion.open_server(
        model_repository=REPOSITORY, load_models=["square"], models=[_callee(), threaded]
    ) as server:
        for name in ("threaded", "square"):
            capabilities = inside(server).runner(name).capabilities
            assert not capabilities.waits_through_portal
        for _ in range(3 * SWITCH_WINDOW):
            out = await server.infer("threaded", {"X": ONE})
            assert out.outputs["Y"].tolist() == [2.0]
        assert not inside(server).instances("threaded")[0].inline
