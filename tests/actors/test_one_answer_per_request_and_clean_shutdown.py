"""Exactly one answer per request, no leaks, limits kept, clean shutdown and unloading.

Each test here started as a finding of a skeptical review: cancellation and errors at every
waiting position, nested shutdown order, observers that raise, malformed model results.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest
import trio
import trio.testing

import orchestrion
from orchestrion.protocols import Reshape
from orchestrion.testing import (
    StepRecorder,
    assert_idle,
    chain,
    double,
    ensemble,
    gated,
    model,
    outcome,
    step,
    tensor,
)

X = np.ones(16, np.float32)


# -- shutdown and unloading ------------------------------------------------------------------


async def test_leaving_open_server_lets_a_running_ensemble_request_finish() -> None:
    """Leaving the block normally lets another task's ensemble request run its later steps."""
    gate = trio.Event()
    results: list[Any] = []
    models = [gated("slow", gate), double(), chain("chain", "slow", "double")]

    async def open_gate_once_closing() -> None:
        await trio.testing.wait_all_tasks_blocked()
        gate.set()

    async with trio.open_nursery() as outer, orchestrion.open_server(models=models) as server:
        outer.start_soon(outcome, server, results, "chain", {"IN": X})
        await trio.testing.wait_all_tasks_blocked()
        outer.start_soon(open_gate_once_closing)
    assert len(results) == 1
    assert not isinstance(results[0], Exception), results[0]
    assert results[0].outputs["OUT"].tolist() == [2.0] * 16


async def test_leaving_open_server_drains_an_outer_ensemble_before_its_inner_one() -> None:
    """An outer request that has not reached its inner ensemble yet still completes on exit."""
    gate = trio.Event()
    results: list[Any] = []
    models = [
        gated("slow", gate),
        double(),
        # The inner ensemble is listed (so loaded and closed) before the outer one.
        ensemble(
            "inner", [tensor("IN")], [tensor("OUT")], [step("double", {"X": "IN"}, {"Y": "OUT"})]
        ),
        ensemble(
            "outer",
            [tensor("IN")],
            [tensor("OUT")],
            [step("slow", {"X": "IN"}, {"Y": "mid"}), step("inner", {"IN": "mid"}, {"OUT": "OUT"})],
        ),
    ]

    async def open_gate_once_closing() -> None:
        await trio.testing.wait_all_tasks_blocked()
        gate.set()

    async with trio.open_nursery() as outer, orchestrion.open_server(models=models) as server:
        outer.start_soon(outcome, server, results, "outer", {"IN": X})
        await trio.testing.wait_all_tasks_blocked()
        outer.start_soon(open_gate_once_closing)
    assert len(results) == 1
    assert not isinstance(results[0], Exception), results[0]


async def test_unload_dependents_also_unloads_ensembles_of_ensembles() -> None:
    """Unloading a model with its dependents leaves no ensemble pointing at a missing model."""
    models = [
        double(),
        ensemble(
            "inner", [tensor("IN")], [tensor("OUT")], [step("double", {"X": "IN"}, {"Y": "OUT"})]
        ),
        ensemble(
            "outer", [tensor("IN")], [tensor("OUT")], [step("inner", {"IN": "IN"}, {"OUT": "OUT"})]
        ),
    ]
    async with orchestrion.open_server(models=models) as server:
        await server.unload_model("double", unload_dependents=True)
        assert server.model_names() == []


async def test_unload_dependents_lets_a_running_outer_request_finish() -> None:
    """unload_dependents closes an outer ensemble before the inner one its running request needs."""
    gate = trio.Event()
    results: list[Any] = []
    models = [
        gated("slow", gate),
        double(),
        # Both use 'double' directly; 'b_outer' also uses 'a_inner', which sorts first.
        ensemble(
            "a_inner", [tensor("IN")], [tensor("OUT")], [step("double", {"X": "IN"}, {"Y": "OUT"})]
        ),
        ensemble(
            "b_outer",
            [tensor("IN")],
            [tensor("OUT")],
            [
                step("slow", {"X": "IN"}, {"Y": "t1"}),
                step("a_inner", {"IN": "t1"}, {"OUT": "t2"}),
                step("double", {"X": "t2"}, {"Y": "OUT"}),
            ],
        ),
    ]
    async with orchestrion.open_server(models=models) as server:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(outcome, server, results, "b_outer", {"IN": X})
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(
                functools.partial(server.unload_model, "double", unload_dependents=True)
            )
            await trio.testing.wait_all_tasks_blocked()
            gate.set()
        assert not isinstance(results[0], Exception), results[0]
        assert results[0].outputs["OUT"].tolist() == [4.0] * 16


@pytest.mark.parametrize("action", ["unload", "reload"])
async def test_cancelled_unload_or_reload_does_not_hang_the_server_exit(
    autojump_clock: trio.testing.MockClock, action: str
) -> None:
    """Giving up on an unload or reload that waits for a running request leaks no actor."""
    gate = trio.Event()
    results: list[Any] = []
    chain = ensemble(
        "e", [tensor("IN")], [tensor("OUT")], [step("slow", {"X": "IN"}, {"Y": "OUT"})]
    )
    with trio.CancelScope() as guard:
        async with orchestrion.open_server(models=[gated("slow", gate), chain]) as server:
            guard.deadline = trio.current_time() + 60  # set after loading, which uses threads
            async with trio.open_nursery() as nursery:
                nursery.start_soon(outcome, server, results, "e", {"IN": X})
                await trio.testing.wait_all_tasks_blocked()
                with trio.move_on_after(1):  # the caller gives up waiting for the drain
                    if action == "unload":
                        await server.unload_model("e")
                    else:
                        await server.load_model(chain)
                gate.set()
            assert results[0].outputs["OUT"].tolist() == [1.0] * 16
    assert not guard.cancelled_caught, "leaving open_server hung"


class _Boom(Exception):
    """The caller's own error, raised inside the server's block."""


@pytest.mark.parametrize("target", ["slow", "chain"])
async def test_leaving_open_server_by_an_error_answers_other_tasks_requests(
    autojump_clock: trio.testing.MockClock, target: str
) -> None:
    """A request of another task still running when the block fails gets ServerClosedError."""
    results: list[Any] = []
    models = [
        gated("slow", trio.Event()),
        double(),
        chain("chain", "slow", "double", max_inflight_requests=1),
    ]
    inputs = {"IN": X} if target == "chain" else {"X": X}

    async def fail_while_serving(outer: trio.Nursery, guard: trio.CancelScope) -> None:
        async with orchestrion.open_server(models=models) as server:
            guard.deadline = trio.current_time() + 60
            # For the chain: one running, one queued in the step's channel, one blocked at
            # the entrance; for the model: one running, two queued.
            for _ in range(3):
                outer.start_soon(outcome, server, results, target, inputs)
            await trio.testing.wait_all_tasks_blocked()
            raise _Boom

    with trio.CancelScope() as guard:
        async with trio.open_nursery() as outer:
            with pytest.raises(_Boom):
                await fail_while_serving(outer, guard)
    assert not guard.cancelled_caught, "another task's request never got an answer"
    assert len(results) == 3
    for result in results:
        assert isinstance(result, orchestrion.ServerClosedError), result


async def test_unload_waits_for_a_running_ensemble_request() -> None:
    """Unloading an ensemble (with dependents) lets its running request finish first."""
    gate = trio.Event()
    results: list[Any] = []
    models = [gated("slow", gate), double(), chain("chain", "slow", "double")]
    async with orchestrion.open_server(models=models) as server:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(outcome, server, results, "chain", {"IN": X})
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(
                functools.partial(server.unload_model, "slow", unload_dependents=True)
            )
            await trio.testing.wait_all_tasks_blocked()
            assert server.model_names() == ["double", "slow"]  # the ensemble is gone already
            gate.set()
        assert results[0].outputs["OUT"].tolist() == [2.0] * 16
        assert server.model_names() == ["double"]


async def test_reloading_a_composing_model_under_load_loses_no_request() -> None:
    """Replacing a composing model while requests are queued and running answers them all."""
    gate = trio.Event()
    results: list[Any] = []
    models = [gated("slow", gate, count=2), double(), chain("chain", "slow", "double")]
    async with orchestrion.open_server(models=models) as server:
        async with trio.open_nursery() as nursery:
            for _ in range(6):
                nursery.start_soon(outcome, server, results, "chain", {"IN": X})
            await trio.testing.wait_all_tasks_blocked()
            await server.load_model(
                model("double", lambda X: {"Y": X * 3}, [tensor("X")], [tensor("Y")])
            )
            gate.set()
        assert len(results) == 6
        assert all(r.outputs["OUT"][0] in (2.0, 3.0) for r in results), results
        assert_idle(server, "chain")


async def test_unloading_a_model_with_queued_requests_runs_them_then_refuses() -> None:
    """Requests queued on a model being unloaded still run; new ones are refused."""
    gate = trio.Event()
    results: list[Any] = []
    async with orchestrion.open_server(models=[gated("slow", gate, count=1)]) as server:
        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(outcome, server, results, "slow", {"X": X})
            await trio.testing.wait_all_tasks_blocked()
            await server.unload_model("slow")
            with pytest.raises(orchestrion.ModelNotFoundError):
                await server.infer("slow", {"X": X})
            gate.set()
        assert [r.outputs["Y"].tolist() for r in results] == [[1.0] * 16] * 3


# -- cancellation, timeouts and accounting ----------------------------------------------------


async def test_observer_sees_step_finished_for_a_cancelled_step(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Every step_started is matched by a step_finished, also when the request times out."""
    recorder = StepRecorder()
    models = [gated("slow", trio.Event()), double(), chain("chain", "slow", "double")]
    async with orchestrion.open_server(models=models, observers=[recorder]) as server:
        with pytest.raises(orchestrion.InferenceTimeoutError):
            await server.infer("chain", {"IN": X}, timeout=1.0)
        await trio.testing.wait_all_tasks_blocked()
        assert_idle(server, "chain")
        assert recorder.in_flight[("chain", 0)] == 0


def _pressure(gate: trio.Event) -> list[orchestrion.Model]:
    """fast (inline) -> slow (gated), one request in flight per step.

    fast is inline by configuration: on a loaded machine its warm-up timing could put it in a
    worker thread, where the autojump clock of the timeout tests jumps past their deadlines.
    """
    inline = {"execution": "inline"}
    return [
        model("fast", lambda X: {"Y": X}, [tensor("X")], [tensor("Y")], parameters=inline),
        gated("slow", gate),
        chain("pressure", "fast", "slow", max_inflight_requests=1),
    ]


async def test_cancelling_every_waiting_position_releases_everything() -> None:
    """Cancel requests running, queued, blocked handing over and blocked at the entrance."""
    gate = trio.Event()
    recorder = StepRecorder()
    async with orchestrion.open_server(models=_pressure(gate), observers=[recorder]) as server:
        async with trio.open_nursery() as nursery:
            for _ in range(6):
                nursery.start_soon(server.infer, "pressure", {"IN": X})
            await trio.testing.wait_all_tasks_blocked()
            fast, slow = server.step_statistics("pressure")
            assert (slow.in_flight, slow.queued, fast.queued) == (1, 1, 1)
            nursery.cancel_scope.cancel()
        await trio.testing.wait_all_tasks_blocked()
        assert_idle(server, "pressure")
        stats = server.model_statistics("pressure")[0].inference_stats
        assert (stats.success.count, stats.fail.count) == (0, 6)
        recorder.peak.clear()
        recorder.in_flight.clear()
        gate.set()
        async with trio.open_nursery() as nursery:
            for _ in range(4):
                nursery.start_soon(server.infer, "pressure", {"IN": X})
        assert_idle(server, "pressure")
        assert recorder.peak == {("pressure", 0): 1, ("pressure", 1): 1}


async def test_timeout_while_blocked_at_the_entrance_frees_the_entrance(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A request timing out before its first step starts leaves every step idle."""
    gate = trio.Event()
    async with orchestrion.open_server(models=_pressure(gate)) as server:
        async with trio.open_nursery() as nursery:
            for _ in range(4):
                nursery.start_soon(server.infer, "pressure", {"IN": X})
            await trio.testing.wait_all_tasks_blocked()
            with pytest.raises(orchestrion.InferenceTimeoutError):
                await server.infer("pressure", {"IN": X}, timeout=0.5)
            gate.set()
        assert_idle(server, "pressure")
        out = await server.infer("pressure", {"IN": X}, timeout=0.5)
        assert out.outputs["OUT"].tolist() == [1.0] * 16


async def test_cancelling_a_nested_ensemble_releases_both_levels() -> None:
    """Cancelling a request inside a nested ensemble frees the outer and the inner steps."""
    gate = trio.Event()
    models = [
        gated("slow", gate),
        double(),
        chain("inner", "slow", "double", max_inflight_requests=2),
        ensemble(
            "outer",
            [tensor("IN")],
            [tensor("OUT")],
            [
                step("double", {"X": "IN"}, {"Y": "mid"}),
                step("inner", {"IN": "mid"}, {"OUT": "OUT"}),
            ],
            max_inflight_requests=2,
        ),
    ]
    async with orchestrion.open_server(models=models) as server:
        async with trio.open_nursery() as nursery:
            for _ in range(5):
                nursery.start_soon(server.infer, "outer", {"IN": X})
            await trio.testing.wait_all_tasks_blocked()
            assert server.step_statistics("inner")[0].in_flight == 2
            nursery.cancel_scope.cancel()
        await trio.testing.wait_all_tasks_blocked()
        assert_idle(server, "inner", "outer")
        gate.set()
        out = await server.infer("outer", {"IN": X})
        assert out.outputs["OUT"].tolist() == [4.0] * 16


# -- errors -------------------------------------------------------------------------------------


def _split_pipeline(gate: trio.Event) -> list[orchestrion.Model]:
    """split -> (check, slow): check fails on negative input, slow waits for ``gate``."""

    def check(X):
        if X[0] < 0:
            raise ValueError("negative")
        return {"Y": X}

    return [
        model(
            "split",
            lambda X: {"A": X, "B": X},
            [tensor("X")],
            [tensor("A"), tensor("B")],
        ),
        model("check", check, [tensor("X")], [tensor("Y")], jit=False),
        gated("slow", gate),
        ensemble(
            "split_join",
            [tensor("IN")],
            [tensor("CHECKED"), tensor("OUT")],
            [
                step("split", {"X": "IN"}, {"A": "a", "B": "b"}),
                step("check", {"X": "a"}, {"Y": "CHECKED"}),
                step("slow", {"X": "b"}, {"Y": "OUT"}),
            ],
            max_inflight_requests=1,
        ),
    ]


async def test_a_failed_request_is_answered_while_its_other_branch_is_backpressured() -> None:
    """A branch failing while the other branch is blocked by backpressure answers at once."""
    gate = trio.Event()
    results: list[Any] = []
    async with (
        orchestrion.open_server(models=_split_pipeline(gate)) as server,
        trio.open_nursery() as nursery,
    ):
        for _ in range(2):  # one running at 'slow', one queued there
            nursery.start_soon(server.infer, "split_join", {"IN": X})
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(outcome, server, results, "split_join", {"IN": -X})
        await trio.testing.wait_all_tasks_blocked()
        try:  # the failed request's other branch waits to hand over to the full 'slow'
            assert len(results) == 1
            assert isinstance(results[0], orchestrion.InferenceError)
        finally:
            gate.set()


async def test_errors_under_backpressure_leave_every_step_idle() -> None:
    """A branch failing while the other waits on a full channel: right answers, no leak."""
    gate = trio.Event()
    results: list[Any] = []
    async with orchestrion.open_server(models=_split_pipeline(gate)) as server:
        async with trio.open_nursery() as nursery:
            for sign in (1, 1, -1, 1, -1):
                nursery.start_soon(outcome, server, results, "split_join", {"IN": sign * X})
                await trio.testing.wait_all_tasks_blocked()
            gate.set()
        errors = [r for r in results if isinstance(r, Exception)]
        assert len(errors) == 2
        assert all(isinstance(e, orchestrion.InferenceError) for e in errors)
        assert all("model 'check'" in str(e) for e in errors)
        assert sum(1 for r in results if not isinstance(r, Exception)) == 3
        assert_idle(server, "split_join")


async def test_fan_in_with_a_failing_branch_gives_one_error_and_frees_everything() -> None:
    """A join whose one input branch fails: one error, the join never runs, nothing leaks."""

    left_gate, right_gate = trio.Event(), trio.Event()

    async def fail(X):
        await left_gate.wait()
        raise RuntimeError("left branch broke")

    recorder = StepRecorder()
    models = [
        model("left", fail, [tensor("X")], [tensor("Y")], jit=False, count=8),
        gated("right", right_gate),
        model("join", lambda L, R: {"Y": L + R}, [tensor("L"), tensor("R")], [tensor("Y")]),
        ensemble(
            "fan_in",
            [tensor("IN")],
            [tensor("OUT")],
            [
                step("left", {"X": "IN"}, {"Y": "l"}),
                step("right", {"X": "IN"}, {"Y": "r"}),
                step("join", {"L": "l", "R": "r"}, {"Y": "OUT"}),
            ],
            max_inflight_requests=2,
        ),
    ]
    async with orchestrion.open_server(models=models, observers=[recorder]) as server:
        results: list[Any] = []
        async with trio.open_nursery() as nursery:
            for _ in range(4):
                nursery.start_soon(outcome, server, results, "fan_in", {"IN": X})
            await trio.testing.wait_all_tasks_blocked()
            left_gate.set()
            await trio.testing.wait_all_tasks_blocked()
            assert results == []  # the right branches still running drain first
            right_gate.set()
        assert len(results) == 4
        assert all(isinstance(r, orchestrion.InferenceError) for r in results)
        assert all("left branch broke" in str(r) for r in results)
        assert server.model_statistics("join")[0].execution_count == 0
        assert_idle(server, "fan_in")
        assert all(n == 0 for n in recorder.in_flight.values())


async def test_max_inflight_holds_with_inline_and_queued_steps_mixed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Inline fast-path steps and actor-run steps together never exceed the step limit."""
    recorder = StepRecorder()

    async def slowish(X):
        await trio.sleep(0.01)
        return {"Y": X}

    models = [
        model("fast", lambda X: {"Y": X + 1}, [tensor("X")], [tensor("Y")]),
        model("slowish", slowish, [tensor("X")], [tensor("Y")], jit=False, count=16),
        model("fast2", lambda X: {"Y": X * 2}, [tensor("X")], [tensor("Y")]),
        ensemble(
            "mixed",
            [tensor("IN")],
            [tensor("OUT")],
            [
                step("fast", {"X": "IN"}, {"Y": "a"}),
                step("slowish", {"X": "a"}, {"Y": "b"}),
                step("fast2", {"X": "b"}, {"Y": "OUT"}),
            ],
            max_inflight_requests=3,
        ),
    ]
    async with orchestrion.open_server(models=models, observers=[recorder]) as server:
        results: list[Any] = []
        async with trio.open_nursery() as nursery:
            for i in range(50):
                x = np.full(16, i, np.float32)
                nursery.start_soon(outcome, server, results, "mixed", {"IN": x})
        assert sorted(float(r.outputs["OUT"][0]) for r in results) == [
            (i + 1) * 2.0 for i in range(50)
        ]
        assert max(recorder.peak.values()) <= 3
        assert_idle(server, "mixed")


# -- errors that must not take the server down --------------------------------------------------


async def test_a_reshape_that_cannot_hold_every_input_is_refused_at_load() -> None:
    """dims [-1] seen as [2, -1] would fail on odd lengths: Triton's rule refuses it at load."""
    rows = model(
        "rows",
        lambda X: {"Y": X.reshape(-1)},
        [tensor("X", dims=(-1,), reshape=Reshape(shape=(2, -1)))],
        [tensor("Y", dims=(-1,))],
        jit=False,
    )
    with pytest.raises(orchestrion.ConfigError, match="does not hold the elements of dims"):
        async with orchestrion.open_server(models=[rows]):
            pass


class _Unconvertible:
    """An output value whose conversion to an array fails (model code raising)."""

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        raise RuntimeError("device buffer was deleted")


async def test_async_model_whose_output_fails_to_convert_fails_only_that_request() -> None:
    """An async model's output that raises on conversion is an InferenceError; serving goes on."""

    async def execute(X):
        if X[0] < 0:
            return {"Y": _Unconvertible()}
        return {"Y": X}

    definition = model("odd", execute, [tensor("X")], [tensor("Y")], jit=False)
    async with orchestrion.open_server(models=[definition]) as server:
        with pytest.raises(orchestrion.InferenceError, match="model 'odd'"):
            await server.infer("odd", {"X": -X})
        assert (await server.infer("odd", {"X": X})).outputs["Y"].tolist() == [1.0] * 16


async def test_params_that_jax_cannot_place_are_a_model_load_error() -> None:
    """initialize returning a non-array pytree leaf is a ModelLoadError, not an exception group."""
    definition = model(
        "bad_params",
        lambda params, X: {"Y": X},
        [tensor("X")],
        [tensor("Y")],
        initialize=lambda config: {"label": "not an array"},
    )
    with pytest.raises(orchestrion.ModelLoadError, match="bad_params"):
        async with orchestrion.open_server(models=[definition]):
            pass


class _FlakyExporter(orchestrion.Observer):
    """An observer whose first step_started raises, like a telemetry exporter hiccup."""

    def __init__(self) -> None:
        self.calls = 0

    def step_started(self, ensemble: str, step: int, model_name: str, request: Any) -> None:
        self.calls += 1
        if self.calls == 1:
            raise RuntimeError("exporter down")


async def test_a_raising_observer_does_not_take_the_server_down() -> None:
    """An observer that raises once costs at most that request; the server keeps serving."""
    gate = trio.Event()
    gate.set()
    models = [gated("slow", gate), chain("e", "slow", "slow", max_inflight_requests=1)]
    async with orchestrion.open_server(models=models, observers=[_FlakyExporter()]) as server:
        first: list[Any] = []
        await outcome(server, first, "e", {"IN": X})
        # The unlucky request may fail, but must not "succeed" without its output.
        assert isinstance(first[0], Exception) or "OUT" in first[0].outputs, first[0]
        out = await server.infer("e", {"IN": X})
        assert out.outputs["OUT"].tolist() == [1.0] * 16
        await trio.testing.wait_all_tasks_blocked()
        assert_idle(server, "e")


async def test_an_omitted_optional_ensemble_input_reaches_an_optional_model_input() -> None:
    """A step whose optional input maps an omitted optional ensemble input still runs."""

    def add_bias(X, B=None):
        return {"Y": X if B is None else X + B}

    models = [
        model(
            "add_bias",
            add_bias,
            [tensor("X"), tensor("B", optional=True)],
            [tensor("Y")],
            jit=False,
        ),
        ensemble(
            "biased",
            [tensor("IN"), tensor("BIAS", optional=True)],
            [tensor("OUT")],
            [step("add_bias", {"X": "IN", "B": "BIAS"}, {"Y": "OUT"})],
        ),
    ]
    async with orchestrion.open_server(models=models) as server:
        with_bias = await server.infer("biased", {"IN": X, "BIAS": X})
        assert with_bias.outputs["OUT"].tolist() == [2.0] * 16
        without = await server.infer("biased", {"IN": X})
        assert "OUT" in without.outputs
        assert without.outputs["OUT"].tolist() == [1.0] * 16


# -- the blocking facade ------------------------------------------------------------------------


def test_blocking_server_has_every_method_of_async_server() -> None:
    """orchestrion.Server offers the same public methods as AsyncServer."""
    public = {n for n in dir(orchestrion.AsyncServer) if not n.startswith("_")}
    assert public <= set(dir(orchestrion.Server))
