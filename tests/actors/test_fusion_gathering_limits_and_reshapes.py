"""A second review of fusion against the scheduler's path: the differences it found (checks
keyed by input names, composing models' output reshapes, max_inflight_requests, a collector
cancelled while gathering, an unload racing a gathered request; the watchdog in mode "xla" is tested with the other
modes in tests/reliability/test_faults.py)
are fixed, and each test stays; with the properties the reviewer verified."""

from __future__ import annotations

import time
from typing import Any

import attrs
import numpy as np
import pytest
import trio

import orchestrion
from orchestrion import InferenceError
from orchestrion.protocols import DynamicBatching, Reshape
from orchestrion.testing import (
    ensemble,
    fused,
    infer_until_fused,
    inside,
    model,
    settled,
    step,
    tensor,
    with_fusion,
)

MODES = ("on", "off")


def _counts(server: orchestrion.AsyncServer) -> dict[str, tuple[Any, ...]]:
    return {
        s.name: (
            s.inference_count,
            s.execution_count,
            s.inference_stats.success.count,
            s.inference_stats.fail.count,
            dict(s.failures_by_reason),
        )
        for s in server.model_statistics()
    }


def _batching_chain(fusion: str, *, dims: tuple[int, ...] = (16,)) -> list[orchestrion.Model]:
    """a (2X) then b (X+1), max_batch_size 8, dynamic batching without queue delay: a fused
    ensemble gathers the requests of one scheduling pass."""
    models = []
    for name, fn in (("a", lambda X: {"Y": X * 2}), ("b", lambda X: {"Y": X + 1})):
        m = model(
            name,
            fn,
            [tensor("X", dims=dims)],
            [tensor("Y", dims=dims)],
            max_batch_size=8,
            parameters={"execution": "inline"},
        )
        config = attrs.evolve(m.config, dynamic_batching=DynamicBatching())
        models.append(attrs.evolve(m, config=config))
    pipe = ensemble(
        "pipe",
        [tensor("IN", dims=dims)],
        [tensor("OUT", dims=dims)],
        [step("a", {"X": "IN"}, {"Y": "mid"}), step("b", {"X": "mid"}, {"Y": "OUT"})],
        max_batch_size=8,
    )
    return [*models, with_fusion(pipe, fusion)]


# -- findings: differences between fusion and the scheduler --------------------------------


async def test_checked_shapes_are_keyed_by_name_not_by_the_clients_input_order() -> None:
    """m takes A and B (both dims [-1]) and returns O = 2A, declared [2]. A request
    {A: 2 elements, B: 3} is valid; then {B: 2, A: 3} (the same shapes, named the other way
    round, the dict in the client's order) makes O 3 elements: the scheduler refuses it
    ("output 'O' has shape [3]"), and so does fusion: its per-shape checks are keyed by
    input names, so the second request is checked (and its shapes, never compiled, send it
    to the scheduler)."""
    outcomes = {}
    for fusion in MODES:
        var = (-1,)
        m = model(
            "m",
            lambda A, B: {"O": A * 2},
            [tensor("A", dims=var), tensor("B", dims=var)],
            [tensor("O", dims=(2,))],
            parameters={"execution": "inline"},
        )
        pipe = ensemble(
            "pipe",
            [tensor("A", dims=var), tensor("B", dims=var)],
            [tensor("OUT", dims=(2,))],
            [step("m", {"A": "A", "B": "B"}, {"O": "OUT"})],
        )
        async with orchestrion.open_server(models=[m, with_fusion(pipe, fusion)]) as server:
            for _ in range(3):
                ok = await server.infer(
                    "pipe", {"A": np.ones(2, np.float32), "B": np.ones(3, np.float32)}
                )
                assert ok.outputs["OUT"].shape == (2,)
            try:
                response = await server.infer(
                    "pipe", {"B": np.ones(2, np.float32), "A": np.ones(3, np.float32)}
                )
                outcomes[fusion] = ("answer", response.outputs["OUT"].shape)
            except InferenceError as exc:
                outcomes[fusion] = ("error", str(exc))
    assert outcomes["off"][0] == "error"
    assert "output 'O' has shape [3]" in outcomes["off"][1]
    assert outcomes["on"] == outcomes["off"]


async def test_a_composing_models_output_reshape_is_undone_on_every_fused_request() -> None:
    """a's output Y is declared dims [4,4] with reshape [16] (the model returns 16 elements,
    the ensemble sees [4,4]); b takes [4,4]. The scheduler undoes the reshape for every
    request: OUT is [4,4]. A composing model with a reshaped output is not fused, so every
    request gets [4,4]."""
    shapes = {}
    for fusion in MODES:
        a = model(
            "a",
            lambda X: {"Y": X * 2},
            [tensor("X")],
            [tensor("Y", dims=(4, 4), reshape=Reshape(shape=(16,)))],
        )
        b = model(
            "b", lambda X: {"S": X + 1}, [tensor("X", dims=(4, 4))], [tensor("S", dims=(4, 4))]
        )
        pipe = ensemble(
            "pipe",
            [tensor("IN")],
            [tensor("OUT", dims=(4, 4))],
            [step("a", {"X": "IN"}, {"Y": "mid"}), step("b", {"X": "mid"}, {"S": "OUT"})],
        )
        async with orchestrion.open_server(models=[a, b, with_fusion(pipe, fusion)]) as server:
            got = []
            for _ in range(3):
                response = await server.infer("pipe", {"IN": np.ones(16, np.float32)})
                got.append(response.outputs["OUT"].shape)
            assert not await settled(server)  # a reshaped output is never fused
            shapes[fusion] = got
    assert shapes["off"] == [(4, 4)] * 3
    assert shapes["on"] == shapes["off"]


def _limited(fusion: str) -> list[orchestrion.Model]:
    """a (two inline instances; compiling a batch of 3 takes 0.4 s) then b, in an ensemble
    with max_inflight_requests=1."""

    def a(X: Any) -> dict[str, Any]:
        if X.shape[0] == 3:
            time.sleep(0.4)  # runs while JAX traces a batch of 3: a long compilation
        return {"Y": X * 2}

    first = model(
        "a",
        a,
        [tensor("X")],
        [tensor("Y")],
        max_batch_size=8,
        count=2,
        parameters={"execution": "inline"},
    )
    second = model("b", lambda X: {"Y": X + 1}, [tensor("X")], [tensor("Y")], max_batch_size=8)
    pipe = ensemble(
        "pipe",
        [tensor("IN")],
        [tensor("OUT")],
        [step("a", {"X": "IN"}, {"Y": "mid"}), step("b", {"X": "mid"}, {"Y": "OUT"})],
        max_batch_size=8,
        max_inflight_requests=1,
    )
    return [first, second, with_fusion(pipe, fusion)]


@pytest.mark.parametrize("fusion", MODES)
async def test_max_inflight_requests_holds_for_fused_requests(fusion: str) -> None:
    """max_inflight_requests=1. A batch of 3 is in step a (compiling, 0.4 s, on a's first
    instance); a batch of 1 arrives meanwhile. The scheduler keeps it out of step a until the
    first leaves (one request in flight per step): answered second. With fusion too: a
    fused request waits for the scheduler's requests to leave the steps."""
    async with orchestrion.open_server(models=_limited(fusion)) as server:
        await server.infer("pipe", {"IN": np.ones((1, 16), np.float32)})
        order: list[int] = []

        async def one(rows: int) -> None:
            await server.infer("pipe", {"IN": np.ones((rows, 16), np.float32)})
            order.append(rows)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(one, 3)
            await trio.sleep(0.1)  # inside the 0.4 s compilation of a batch of 3
            nursery.start_soon(one, 1)
        assert fused(server) is (fusion == "on")
    assert order == [3, 1]


async def test_fusion_resumes_once_the_schedulers_requests_leave_the_steps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """max_inflight_requests=1. A batch of 3 takes the scheduler's path (compiling, 0.4 s)
    while 8 clients send 160 requests of one row. Each arrival finds the steps busy; it
    used to take the scheduler's path too, keeping the steps busy for the next one, so that
    under steady load no request was fused again (seen over gRPC at concurrency 64: 93% of
    requests scheduled). Now they wait for the scheduler's requests to leave, then are
    fused: only the batch of 3 is scheduled, and every answer is right."""
    async with orchestrion.open_server(models=_limited("on")) as server:
        await server.infer("pipe", {"IN": np.ones((1, 16), np.float32)})
        assert fused(server)
        runner_class = type(inside(server).ensemble("pipe"))
        scheduled: list[int] = []
        schedule = runner_class._scheduled

        async def counted(self: Any, request: Any) -> Any:
            scheduled.append(request.inputs["IN"].shape[0])
            return await schedule(self, request)

        monkeypatch.setattr(runner_class, "_scheduled", counted)
        answers: list[np.ndarray] = []

        async def client(index: int) -> None:
            for n in range(20):
                x = np.full((1, 16), index * 100 + n, np.float32)
                got = await server.infer("pipe", {"IN": x})
                np.testing.assert_array_equal(got.outputs["OUT"], x * 2 + 1)
                answers.append(got.outputs["OUT"])

        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.infer, "pipe", {"IN": np.ones((3, 16), np.float32)})
            await trio.sleep(0.1)  # inside the 0.4 s compilation of a batch of 3
            for index in range(8):
                nursery.start_soon(client, index)
    assert len(answers) == 160
    assert scheduled == [3]


async def test_a_fusable_request_waits_only_for_the_scheduled_requests_before_it() -> None:
    """Two clients send new shapes for one output of two (the scheduler's path, at once),
    each compiling for 0.2 s and overlapping, so that the scheduler is never empty; then a
    request of a known shape for both outputs arrives. It waits for the scheduled requests
    that were there when it came, not for the ones that start later: it is answered before
    the streams end (waiting for the scheduler to empty would have it answered last)."""

    def a(X: Any) -> dict[str, Any]:
        if X.shape[0] >= 20:
            time.sleep(0.2)  # runs while JAX traces a new shape: a long compilation
        return {"Y": X * 2}

    var = (-1,)
    pipe = ensemble(
        "pipe",
        [tensor("IN", dims=var)],
        [tensor("OUT", dims=var), tensor("OUT2", dims=var)],
        [
            step("a", {"X": "IN"}, {"Y": "mid"}),
            step("b", {"X": "mid"}, {"S": "OUT"}),
            step("c", {"X": "mid"}, {"S": "OUT2"}),
        ],
    )
    models = [
        model("a", a, [tensor("X", dims=var)], [tensor("Y", dims=var)]),
        model("b", lambda X: {"S": -X}, [tensor("X", dims=var)], [tensor("S", dims=var)]),
        model("c", lambda X: {"S": X + 1}, [tensor("X", dims=var)], [tensor("S", dims=var)]),
        with_fusion(pipe, "on"),
    ]
    async with orchestrion.open_server(models=models) as server:
        assert await infer_until_fused(server, "pipe", {"IN": np.ones(16, np.float32)})
        finished: list[str] = []

        async def new_shapes(first: int) -> None:
            for size in range(first, first + 12, 2):
                x = np.ones(size, np.float32)
                await server.infer("pipe", {"IN": x}, outputs=["OUT"])
            finished.append(f"stream from {first}")

        async def known_shape() -> None:
            got = await server.infer("pipe", {"IN": np.ones(16, np.float32)})
            np.testing.assert_array_equal(got.outputs["OUT"], -2 * np.ones(16))
            np.testing.assert_array_equal(got.outputs["OUT2"], 3 * np.ones(16))
            finished.append("known shape")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(new_shapes, 20)
            await trio.sleep(0.1)
            nursery.start_soon(new_shapes, 21)
            await trio.sleep(0.15)
            nursery.start_soon(known_shape)
    assert finished[0] == "known shape"


class _CancelAtFirstYield(trio.abc.Instrument):
    """Cancels ``scope`` as soon as ``task`` first yields to the scheduler (here: inside the
    ensemble's infer), noting whether a fusion was collecting at that moment."""

    def __init__(self, server: orchestrion.AsyncServer) -> None:
        self.server = server
        self.task: trio.lowlevel.Task | None = None
        self.scope: trio.CancelScope | None = None
        self.collecting: bool | None = None

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        if task is self.task and self.scope is not None:
            fusion = inside(self.server).fusion("pipe")
            self.collecting = fusion is not None and fusion._pass.collecting
            self.scope.cancel()
            self.scope = None


@pytest.mark.parametrize("fusion", MODES)
async def test_a_request_cancelled_while_gathered_is_not_run_by_its_steps(fusion: str) -> None:
    """Batching steps; a request is cancelled at its first wait. The scheduler has queued it
    for a's batcher: the run is abandoned and no step counts it. Fused, its first wait is
    the gathering pass it leads: it drops out of the batch it collected, as a cancelled
    follower does, and no step counts it."""
    async with orchestrion.open_server(models=_batching_chain(fusion)) as server:
        x = np.ones((2, 16), np.float32)
        for _ in range(4):
            await server.infer("pipe", {"IN": x})
        assert fused(server) is (fusion == "on")
        before = _counts(server)
        instrument = _CancelAtFirstYield(server)

        async def request() -> None:
            with trio.CancelScope() as scope:
                instrument.scope = scope
                instrument.task = trio.lowlevel.current_task()
                await server.infer("pipe", {"IN": x})
            assert scope.cancelled_caught

        trio.lowlevel.add_instrument(instrument)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(request)
        finally:
            trio.lowlevel.remove_instrument(instrument)
        assert instrument.collecting is (fusion == "on")
        await trio.sleep(0.05)
        after = _counts(server)
    assert after["pipe"][4] == {"CANCELED": 1}
    assert after["a"] == before["a"]
    assert after["b"] == before["b"]


@pytest.mark.parametrize("fusion", MODES)
async def test_unloading_the_ensemble_answers_a_request_being_gathered(fusion: str) -> None:
    """A request and an unload of its (batching) ensemble start together, 20 times. The
    request is inside the ensemble before the unload stops it, and the scheduler answers
    every such request ("running requests finish first"); so does fusion, also when the
    unload lands during the request's gathering pass (about one time in two)."""
    models = _batching_chain(fusion)
    pipe = models[-1]
    x = np.ones((2, 16), np.float32)
    async with orchestrion.open_server(models=models) as server:
        outcomes = []
        for _ in range(20):
            await server.load_model(pipe)
            await server.infer("pipe", {"IN": x})
            got: list[Any] = []

            async def request(got: list[Any] = got) -> None:
                try:
                    got.append(await server.infer("pipe", {"IN": x}))
                except Exception as exc:
                    got.append(exc)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(request)
                nursery.start_soon(server.unload_model, "pipe")
            outcomes.append(type(got[0]).__name__)
    assert set(outcomes) == {"InferResponse"}, outcomes


# -- properties that hold -------------------------------------------------------------------


async def test_gathered_requests_of_different_row_shapes_get_their_own_rows() -> None:
    """Dims [-1] and batching: 12 concurrent requests of 1-3 rows, rows of 4 or 6 elements,
    3 times. Fused, they are gathered by row shape (each group padded and run once): every
    request gets exactly its own rows, as on the scheduler's path."""
    answers = {}
    for fusion in MODES:
        async with orchestrion.open_server(models=_batching_chain(fusion, dims=(-1,))) as server:
            for _ in range(3):  # every padded size compiled, the instances inline
                for width in (4, 6):
                    for rows in (1, 2, 3):
                        await server.infer("pipe", {"IN": np.ones((rows, width), np.float32)})
            got: dict[tuple[int, int], list[Any]] = {}

            async def one(i: int, k: int, got: dict[tuple[int, int], list[Any]] = got) -> None:
                width, rows = (4, 6)[i % 2], 1 + i % 3
                x = np.arange(rows * width, dtype=np.float32).reshape(rows, width) + 10 * i + k
                response = await server.infer("pipe", {"IN": x})
                np.testing.assert_array_equal(response.outputs["OUT"], x * 2 + 1)
                got[(i, k)] = response.outputs["OUT"].tolist()

            for k in range(3):
                async with trio.open_nursery() as nursery:
                    for i in range(12):
                        nursery.start_soon(one, i, k)
            assert fused(server) is (fusion == "on")
            answers[fusion] = got
    assert answers["on"] == answers["off"]


async def test_unloading_an_xla_ensemble_mid_compile_neither_waits_nor_fails() -> None:
    """Fusion "xla": a new shape (20) starts a 0.5 s background compilation; the ensemble is
    unloaded and loaded again at once. The unload does not wait for the compilation (it is
    not a request), the reloaded ensemble answers right, and the server closes cleanly once
    the compilations end."""
    var = (-1,)

    def a(X: Any) -> dict[str, Any]:
        if X.shape[0] == 20:
            time.sleep(0.5)  # runs while JAX traces 20 elements: a long compilation
        return {"Y": X * 2}

    pipe = with_fusion(
        ensemble(
            "pipe",
            [tensor("IN", dims=var)],
            [tensor("OUT", dims=var)],
            [step("a", {"X": "IN"}, {"Y": "mid"}), step("b", {"X": "mid"}, {"S": "OUT"})],
        ),
        "xla",
    )
    inline = {"execution": "inline"}
    models = [
        model("a", a, [tensor("X", dims=var)], [tensor("Y", dims=var)], parameters=inline),
        model(
            "b",
            lambda X: {"S": -X},
            [tensor("X", dims=var)],
            [tensor("S", dims=var)],
            parameters=inline,
        ),
        pipe,
    ]
    async with orchestrion.open_server(models=models) as server:
        for _ in range(3):
            await server.infer("pipe", {"IN": np.ones(16, np.float32)})
        assert await settled(server)
        old = inside(server).fusion("pipe")
        response = await server.infer("pipe", {"IN": np.ones(20, np.float32)})
        np.testing.assert_array_equal(response.outputs["OUT"], np.full(20, -2, np.float32))
        assert old._compiling  # the fused call for 20 elements compiles in the background
        started = time.monotonic()
        await server.unload_model("pipe")
        assert time.monotonic() - started < 0.2
        await server.load_model(pipe)
        response = await server.infer("pipe", {"IN": np.ones(20, np.float32)})
        np.testing.assert_array_equal(response.outputs["OUT"], np.full(20, -2, np.float32))
    assert not old._compiling
