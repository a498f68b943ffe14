"""Ensembles of Triton python-backend models run fused (`ListedFusion`): the requests of one
scheduling pass go through the steps together, one ``execute`` per step, without the
scheduler. Each test runs the same ensemble fused and with ``fusion: off`` and compares what
a client and the statistics see; the models record every request they are handed, so that a
request run twice (or lost) shows."""

from __future__ import annotations

import json
import time
from typing import Any

import numpy as np
import pytest
import trio
import triton_python_backend_utils as pb_utils

import orchestrion
from orchestrion import InferenceError, StepRefusedError
from orchestrion.actors._listed_fusion import ListedFusion
from orchestrion.protocols import DynamicBatching
from orchestrion.testing import (
    assert_idle,
    ensemble,
    fused,
    infer_until_fused,
    inside,
    step,
    tensor,
    triton_model,
    with_fusion,
)

MODES = ("on", "off")
ROW = (4,)


def _recording(name: str, seen: list[tuple[str, float]], compute: Any, **config: Any) -> Any:
    """A python-backend model ``X -> Y`` that records (its name, X[0]) for each request it
    is handed and answers ``compute(request, x)``: an array, or a `pb_utils.TritonError`, or
    None (no output: the answer leaves Y out)."""

    class Recording:
        def execute(self, requests: list[Any]) -> list[Any]:
            answers = []
            for request in requests:
                x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
                seen.append((name, float(x.reshape(-1)[0])))
                y = compute(request, x)
                if isinstance(y, pb_utils.TritonError):
                    answers.append(pb_utils.InferenceResponse(error=y))
                elif y is None:
                    answers.append(pb_utils.InferenceResponse([]))
                else:
                    answers.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", y)]))
            return answers

    return triton_model(name, Recording, [tensor("X", dims=ROW)], [tensor("Y", dims=ROW)], **config)


def _pipeline(
    seen: list[tuple[str, float]],
    mode: str,
    *,
    first: Any = None,
    batching: bool = True,
    max_inflight: int = 0,
) -> list[orchestrion.Model]:
    """pre (2X + 1, or ``first``), then left (pre * 10) and right (-pre) in parallel."""
    config: dict[str, Any] = (
        {"max_batch_size": 8, "dynamic_batching": DynamicBatching()} if batching else {}
    )
    batch = 8 if batching else 0
    pre = first or (lambda request, x: x * 2 + 1)
    models = [
        _recording("pre", seen, pre, **config),
        _recording("left", seen, lambda request, x: x * 10, **config),
        _recording("right", seen, lambda request, x: -x, **config),
    ]
    pipe = ensemble(
        "pipe",
        [tensor("IN", dims=ROW)],
        [tensor("L", dims=ROW), tensor("R", dims=ROW)],
        [
            step("pre", {"X": "IN"}, {"Y": "p"}),
            step("left", {"X": "p"}, {"Y": "L"}),
            step("right", {"X": "p"}, {"Y": "R"}),
        ],
        max_batch_size=batch,
        max_inflight_requests=max_inflight,
    )
    return [*models, with_fusion(pipe, mode)]


def _row(value: float, batching: bool = True) -> np.ndarray[Any, Any]:
    row = np.full(ROW, value, np.float32)
    return row[None] if batching else row


async def _warm(server: orchestrion.AsyncServer, mode: str, batching: bool = True) -> None:
    """Until the steps run inline (and, fused, the ensemble has run fused once)."""
    if mode == "on":
        assert await infer_until_fused(server, "pipe", {"IN": _row(0.5, batching)})
    else:
        for _ in range(20):
            await server.infer("pipe", {"IN": _row(0.5, batching)})


async def _concurrently(
    server: orchestrion.AsyncServer, values: list[float], **options: Any
) -> list[Any]:
    """One request per value, all in the same scheduling pass: each one's outputs or error."""
    results: list[Any] = [None] * len(values)

    async def one(index: int, value: float) -> None:
        try:
            results[index] = (await server.infer("pipe", {"IN": _row(value)}, **options)).outputs
        except InferenceError as exc:
            results[index] = exc

    async with trio.open_nursery() as nursery:
        for index, value in enumerate(values):
            nursery.start_soon(one, index, value)
    return results


def _counts(server: orchestrion.AsyncServer) -> dict[str, tuple[int, int, int]]:
    return {
        s.name: (s.inference_count, s.inference_stats.success.count, s.inference_stats.fail.count)
        for s in server.model_statistics()
        if s.name in ("pre", "left", "right")
    }


@pytest.mark.parametrize("mode", MODES)
async def test_concurrent_requests_get_their_own_rows_and_each_step_sees_each_once(
    mode: str,
) -> None:
    """16 requests in one pass, each a different value: each gets its own answer; every step
    is handed every request exactly once; fused, the steps run them in batches of at most
    max_batch_size (fewer executions than requests), and no step's actor sees them."""
    seen: list[tuple[str, float]] = []
    async with orchestrion.open_server(models=_pipeline(seen, mode)) as server:
        await _warm(server, mode)
        before = {s.name: s.execution_count for s in server.model_statistics()}
        seen.clear()
        values = [float(v) for v in range(16)]
        results = await _concurrently(server, values)
        for value, out in zip(values, results, strict=True):
            assert out["L"].tolist() == [[(value * 2 + 1) * 10] * 4]
            assert out["R"].tolist() == [[-(value * 2 + 1)] * 4]
        for name, source in (("pre", values), ("left", [v * 2 + 1 for v in values])):
            assert sorted(v for n, v in seen if n == name) == sorted(source)
        after = {s.name: s.execution_count for s in server.model_statistics()}
        executions = after["pre"] - before["pre"]
        if mode == "on":
            assert isinstance(inside(server).fusion("pipe"), ListedFusion)
            assert 2 <= executions < 16  # batches of at most 8 requests
        assert_idle(server, "pipe")


async def test_statistics_match_the_schedulers() -> None:
    """The same requests, fused and not: the same inference, success and failure counts for
    every composing model (a failure included)."""

    def pre(request: Any, x: Any) -> Any:
        return pb_utils.TritonError("negative input") if x.reshape(-1)[0] < 0 else x * 2 + 1

    counts = {}
    for mode in MODES:
        seen: list[tuple[str, float]] = []
        async with orchestrion.open_server(models=_pipeline(seen, mode, first=pre)) as server:
            await _warm(server, mode)
            start = _counts(server)
            await _concurrently(server, [1.0, -1.0, 2.0, 3.0])
            end = _counts(server)
            counts[mode] = {
                n: tuple(b - a for a, b in zip(start[n], end[n], strict=True)) for n in end
            }
    assert counts["on"] == counts["off"]
    assert counts["on"]["pre"] == (3, 3, 1)


@pytest.mark.parametrize("mode", MODES)
async def test_a_failing_request_gets_the_schedulers_error_and_the_others_their_answers(
    mode: str,
) -> None:
    """A step answers one request of a pass with an error: that request gets the ensemble's
    error naming the step, the others their outputs, and no step is handed any request
    twice (the failed one goes no further)."""

    def pre(request: Any, x: Any) -> Any:
        return pb_utils.TritonError("negative input") if x.reshape(-1)[0] < 0 else x * 2 + 1

    seen: list[tuple[str, float]] = []
    async with orchestrion.open_server(models=_pipeline(seen, mode, first=pre)) as server:
        await _warm(server, mode)
        seen.clear()
        results = await _concurrently(server, [1.0, -1.0, 2.0])
        assert isinstance(results[1], orchestrion.ModelReportedError)  # its code kept
        assert str(results[1]) == "in ensemble 'pipe', step[0]: model 'pre': negative input"
        assert results[0]["R"].tolist() == [[-3.0] * 4]
        assert results[2]["L"].tolist() == [[50.0] * 4]
        assert sorted(v for n, v in seen if n == "pre") == [-1.0, 1.0, 2.0]
        assert sorted(v for n, v in seen if n == "left") == [3.0, 5.0]
        assert_idle(server, "pipe")


@pytest.mark.parametrize("mode", MODES)
async def test_a_required_input_left_out_is_refused_naming_the_step_that_left_it_out(
    mode: str,
) -> None:
    """pre answers without its output for 0: left and right refuse the request for lack of
    their input, in the scheduler's words, with the note that names pre."""

    def pre(request: Any, x: Any) -> Any:
        return None if x.reshape(-1)[0] == 0 else x * 2 + 1

    seen: list[tuple[str, float]] = []
    async with orchestrion.open_server(models=_pipeline(seen, mode, first=pre)) as server:
        await _warm(server, mode)
        results = await _concurrently(server, [0.0, 1.0])
        assert isinstance(results[0], StepRefusedError)
        message = str(results[0])
        assert message.startswith("in ensemble 'pipe', step[")
        assert "tensor 'p': step[0]'s model 'pre' left its output 'Y' out" in message
        assert results[1]["L"].tolist() == [[30.0] * 4]


@pytest.mark.parametrize("mode", MODES)
async def test_each_step_sees_the_clients_request_id_and_parameters(mode: str) -> None:
    """The requests a step is handed carry the client's id and parameters, as on the
    scheduler's path."""
    received: list[tuple[str, dict[str, Any]]] = []

    def pre(request: Any, x: Any) -> Any:
        received.append((request.request_id(), json.loads(request.parameters())))
        return x * 2 + 1

    seen: list[tuple[str, float]] = []
    async with orchestrion.open_server(models=_pipeline(seen, mode, first=pre)) as server:
        await _warm(server, mode)
        received.clear()
        await _concurrently(server, [1.0, 2.0], request_id="r-7", parameters={"k": 3})
        assert received == [("r-7", {"k": 3})] * 2


@pytest.mark.parametrize("mode", MODES)
async def test_steps_without_dynamic_batching_get_one_request_per_execute(mode: str) -> None:
    """Without dynamic batching each ``execute`` is handed one request, fused or not."""
    seen: list[tuple[str, float]] = []
    async with orchestrion.open_server(models=_pipeline(seen, mode, batching=False)) as server:
        await _warm(server, mode, batching=False)
        before = {s.name: s.execution_count for s in server.model_statistics()}
        async with trio.open_nursery() as nursery:
            for value in range(6):
                nursery.start_soon(server.infer, "pipe", {"IN": _row(float(value), False)})
        after = {s.name: s.execution_count for s in server.model_statistics()}
        assert after["pre"] - before["pre"] == 6
        if mode == "on":
            assert fused(server)


async def test_a_slow_step_leaves_the_event_loop_and_the_ensemble_its_fusion() -> None:
    """A step that turns slow (2 ms a call) goes back to its worker thread; the ensemble's
    requests then take the scheduler's path, with the same answers."""
    slow = False

    def pre(request: Any, x: Any) -> Any:
        if slow:
            time.sleep(0.002)
        return x * 2 + 1

    seen: list[tuple[str, float]] = []
    async with orchestrion.open_server(models=_pipeline(seen, "on", first=pre)) as server:
        await _warm(server, "on")
        runner = inside(server).runner("pre")
        slow = True
        for _ in range(40):
            out = await server.infer("pipe", {"IN": _row(1.0)})
            assert out.outputs["L"].tolist() == [[30.0] * 4]
        assert not runner.instances[0].inline
        fusion = inside(server).fusion("pipe")
        assert isinstance(fusion, ListedFusion)
        assert not fusion.idle()  # pre has no inline instance: requests are scheduled


async def test_a_bls_step_is_not_fused() -> None:
    """A step whose code calls the server (BLS) never runs inline: the ensemble is not
    fused and answers through the scheduler."""
    seen: list[tuple[str, float]] = []

    class Bls:
        def execute(self, requests: list[Any]) -> list[Any]:
            answers = []
            for request in requests:
                x = pb_utils.get_input_tensor_by_name(request, "X")
                call = pb_utils.InferenceRequest(
                    model_name="left", requested_output_names=["Y"], inputs=[x]
                )
                answers.append(pb_utils.InferenceResponse(call.exec().output_tensors()))
            return answers

    bls = triton_model("bls", Bls, [tensor("X", dims=ROW)], [tensor("Y", dims=ROW)])
    left = _recording("left", seen, lambda request, x: x * 10)
    pipe = ensemble(
        "pipe",
        [tensor("IN", dims=ROW)],
        [tensor("OUT", dims=ROW)],
        [step("bls", {"X": "IN"}, {"Y": "OUT"})],
    )
    async with orchestrion.open_server(models=[left, bls, pipe]) as server:
        for _ in range(20):
            out = await server.infer("pipe", {"IN": _row(2.0, False)})
            assert out.outputs["OUT"].tolist() == [20.0] * 4
        assert inside(server).fusion("pipe") is None
