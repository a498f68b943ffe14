"""Triton's request rescheduling in python-backend models (``set_release_flags(
TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)`` with ``sequence_batching { iterative_sequence:
true }``), as python_backend's README and ``qa/L0_backend_python/request_rescheduling``
describe it: a decoupled model's iterations, a plain model's late answer, Triton's checks,
the streams of one instance taking turns, a reader that goes away, and the configs that
cannot reschedule."""

from __future__ import annotations

import contextlib
import threading
from typing import Any, ClassVar

import attrs
import numpy as np
import pytest
import trio
import triton_python_backend_utils as pb_utils

import orchestrion
from orchestrion.protocols import ModelTransactionPolicy, SequenceBatching
from orchestrion.testing import model, tensor, triton_model

ITERATIVE = SequenceBatching(iterative_sequence=True)
DECOUPLED = ModelTransactionPolicy(decoupled=True)
IN = [tensor("IN", "INT32", (1,))]
OUT = [tensor("OUT", "INT32", (1,))]
RESCHEDULE = pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE


class Countdown:
    """python_backend's README example: IN = n; each execution of the request sends
    n - k (k: its iterations so far) and reschedules it, until 0 (sent with the final
    flag). Each execution is recorded (the request's id, the value sent)."""

    def initialize(self, args: dict[str, str]) -> None:
        self.left: dict[int, int] = {}
        self.ran: list[tuple[str, int]] = RAN

    def execute(self, requests: list[Any]) -> None:
        for request in requests:
            key = id(request)  # the same object on every iteration
            if key not in self.left:
                self.left[key] = int(request.inputs()[0].as_numpy()[0])
            self.left[key] -= 1
            value = self.left[key]
            self.ran.append((request.request_id(), value))
            out = pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([value], np.int32))])
            sender = request.get_response_sender()
            if value <= 0:
                del self.left[key]
                sender.send(out, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            else:
                request.set_release_flags(RESCHEDULE)
                sender.send(out)


RAN: list[tuple[str, int]] = []


async def _stream(server: Any, name: str, n: int, request_id: str = "") -> list[int]:
    stream = server.stream_infer(name, {"IN": np.array([n], np.int32)}, request_id=request_id)
    async with contextlib.aclosing(stream) as responses:
        return [int(r.outputs["OUT"][0]) async for r in responses]


async def test_a_decoupled_request_runs_again_until_its_model_releases_it() -> None:
    """IN = 3: three executions of the same request, responses 2, 1, 0; two streams at
    once on one instance take turns between iterations."""
    RAN.clear()
    definition = triton_model(
        "countdown",
        Countdown,
        IN,
        OUT,
        model_transaction_policy=DECOUPLED,
        sequence_batching=ITERATIVE,
    )
    got: dict[str, list[int]] = {}
    async with orchestrion.open_server(models=[definition]) as server:
        assert await _stream(server, "countdown", 3) == [2, 1, 0]
        RAN.clear()

        async def one(name: str) -> None:
            got[name] = await _stream(server, "countdown", 4, request_id=name)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(one, "a")
            nursery.start_soon(one, "b")
    assert got == {"a": [3, 2, 1, 0], "b": [3, 2, 1, 0]}
    order = [name for name, _ in RAN]
    assert sorted(order) == ["a"] * 4 + ["b"] * 4
    assert order not in (["a"] * 4 + ["b"] * 4, ["b"] * 4 + ["a"] * 4)  # they took turns


class LateAnswer:
    """Not decoupled: the first execution reschedules its request and returns None for
    it; the next one answers (Triton's request_rescheduling_addsub)."""

    executions: ClassVar[list[int]] = []

    def execute(self, requests: list[Any]) -> list[Any]:
        LateAnswer.executions.append(len(requests))
        responses = []
        for request in requests:
            if not getattr(request, "seen", False):
                request.seen = True
                request.set_release_flags(RESCHEDULE)
                responses.append(None)
            else:
                x = request.inputs()[0].as_numpy()
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x * 2)]))
        return responses


async def test_a_plain_request_is_answered_by_a_later_execution() -> None:
    """The rescheduled request's one response comes from its second execution."""
    LateAnswer.executions.clear()
    definition = triton_model("late", LateAnswer, IN, OUT, sequence_batching=ITERATIVE)
    async with orchestrion.open_server(models=[definition]) as server:
        out = await server.infer("late", {"IN": np.array([21], np.int32)})
    assert out.outputs["OUT"].tolist() == [42]
    assert LateAnswer.executions == [1, 1]


async def test_a_rescheduled_request_with_a_response_is_refused_in_tritons_words() -> None:
    """A response in the list for a rescheduled request: Triton's error (and its
    spelling); the model serves on."""

    class Wrong:
        def execute(self, requests: list[Any]) -> list[Any]:
            x = requests[0].inputs()[0].as_numpy()
            if x[0] < 0:
                requests[0].set_release_flags(RESCHEDULE)
            return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x)])]

    definition = triton_model("wrong", Wrong, IN, OUT, sequence_batching=ITERATIVE)
    async with orchestrion.open_server(models=[definition]) as server:
        with pytest.raises(orchestrion.InferenceError) as caught:
            await server.infer("wrong", {"IN": np.array([-1], np.int32)})
        assert (
            "Expected a None object in the execute function return list for reschduled "
            "request, found type '<class "
        ) in str(caught.value)
        assert (await server.infer("wrong", {"IN": np.array([5], np.int32)})).outputs[
            "OUT"
        ].tolist() == [5]


@pytest.mark.parametrize("decoupled", [False, True])
async def test_rescheduling_without_an_iterative_sequence_is_a_clear_error(
    decoupled: bool,
) -> None:
    """A model whose config has no ``iterative_sequence`` reschedules: the request fails
    with an error saying what the config needs, and runs no further."""
    RAN.clear()
    extra: dict[str, Any] = {"model_transaction_policy": DECOUPLED} if decoupled else {}
    cls = Countdown if decoupled else LateAnswer
    definition = triton_model("plain", cls, IN, OUT, **extra)
    async with orchestrion.open_server(models=[definition]) as server:
        request = np.array([1], np.int32)
        call: Any = (
            _stream(server, "plain", 3) if decoupled else server.infer("plain", {"IN": request})
        )
        with pytest.raises(orchestrion.InferenceError, match="iterative_sequence: true"):
            await call
    if decoupled:
        assert len(RAN) == 1


async def test_a_stream_whose_reader_goes_away_is_rescheduled_no_more() -> None:
    """A model that reschedules its request forever: once its reader has gone, the
    request runs no further iteration."""
    count = {"n": 0}
    lock = threading.Lock()

    class Forever:
        def execute(self, requests: list[Any]) -> None:
            with lock:
                count["n"] += 1
            out = pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([1], np.int32))])
            requests[0].get_response_sender().send(out)
            requests[0].set_release_flags(RESCHEDULE)

    definition = triton_model(
        "forever",
        Forever,
        IN,
        OUT,
        model_transaction_policy=DECOUPLED,
        sequence_batching=ITERATIVE,
    )
    async with orchestrion.open_server(models=[definition]) as server:
        stream = server.stream_infer("forever", {"IN": np.array([1], np.int32)})
        async with contextlib.aclosing(stream) as responses:
            async for _ in responses:
                if count["n"] >= 5:
                    break
        settled = count["n"]
        await trio.sleep(0.2)
        assert count["n"] <= settled + 1  # at most the iteration that was running


async def test_configs_that_cannot_reschedule_are_refused_at_load() -> None:
    """``iterative_sequence`` on a model that is not a python-backend one, or beside
    control inputs: refused at load, naming the model and the field."""

    def execute(IN: Any) -> dict[str, Any]:
        return {"OUT": IN}

    jitless = model("plain_code", execute, IN, OUT, jit=False)
    jitless = attrs.evolve(
        jitless, config=attrs.evolve(jitless.config, sequence_batching=ITERATIVE)
    )
    with pytest.raises(orchestrion.ConfigError, match="iterative_sequence is for python-backend"):
        async with orchestrion.open_server(models=[jitless]):
            pass
    controlled = triton_model(
        "controlled",
        LateAnswer,
        IN,
        OUT,
        sequence_batching=SequenceBatching(
            iterative_sequence=True,
            control_input=(
                {
                    "name": "START",
                    "control": [{"kind": "CONTROL_SEQUENCE_START", "int32_false_true": [0, 1]}],
                },
            ),
        ),
    )
    with pytest.raises(
        orchestrion.ConfigError, match="an iterative sequence takes no control_input"
    ):
        async with orchestrion.open_server(models=[controlled]):
            pass


async def test_a_malformed_answer_fails_the_rescheduled_request_too() -> None:
    """``execute`` reschedules its request and returns something that is not a list of
    responses: the request fails with the malformed-answer error, and runs no more."""
    calls: list[int] = []

    class Malformed:
        def execute(self, requests: list[Any]) -> Any:
            calls.append(len(requests))
            requests[0].set_release_flags(RESCHEDULE)
            return "not a list"

    definition = triton_model("malformed", Malformed, IN, OUT, sequence_batching=ITERATIVE)
    async with orchestrion.open_server(models=[definition]) as server:
        with pytest.raises(orchestrion.InferenceError, match="execute returned str for 1 requests"):
            await server.infer("malformed", {"IN": np.array([1], np.int32)})
    assert calls == [1]
