"""Races: compiled-shape checks, inline/thread switching, unloading, closing, the public API.

Several of these started as proofs of bugs found in review (a late inline result counted as a
success, a step started after its sibling failed, ensembles left draining by a cancelled
unload, a load racing the shutdown, a server answering after it failed, the request argument
exposing writable inputs); the others cover edge cases, some over random mixes of faults.
"""

from __future__ import annotations

import contextlib
import random
import threading
from typing import Any

import numpy as np
import pytest
import trio
import trio.testing

import orchestrion
from orchestrion.actors import _ensemble as ensemble_module
from orchestrion.testing import (
    StepRecorder,
    assert_idle,
    chain,
    double,
    ensemble,
    gated,
    inside,
    model,
    outcome,
    step,
    tensor,
)

X = np.ones(16, np.float32)


def _held_in_a_thread(name: str, release: threading.Event, add: float = 0.0) -> orchestrion.Model:
    """A thread-mode model whose executions wait for ``release`` (a worker-thread event)."""

    def execute(X):
        release.wait()
        return {"Y": X + add}

    return model(
        name, execute, [tensor("X")], [tensor("Y")], jit=False, parameters={"execution": "thread"}
    )


class _Boom(Exception):
    """The caller's own error, raised inside the server's block."""


# -- bugs -----------------------------------------------------------------------------------


async def test_a_late_inline_result_counts_as_a_failure(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The guide: timed-out requests count as failures, also a late synchronous result."""

    def execute(X):
        autojump_clock.jump(2.0)  # a synchronous execution that outlives the request's timeout
        return {"Y": X}

    late = model("late", execute, [tensor("X")], [tensor("Y")], jit=False)
    async with orchestrion.open_server(models=[late]) as server:
        with pytest.raises(orchestrion.InferenceTimeoutError):
            await server.infer("late", {"X": X}, timeout=1.0)
        stats = server.model_statistics("late")[0].inference_stats
        assert (stats.success.count, stats.fail.count) == (0, 1)


async def test_no_step_starts_after_a_sibling_step_failed() -> None:
    """First error wins: a step the actor handed to a task just before the error must not run."""

    def check(X):
        if X[0] < 0:
            raise ValueError("negative")
        return {"Y": X}

    async def side(X):
        return {"Y": X}

    models = [
        double(jit=False, name="split"),
        model("check", check, [tensor("X")], [tensor("Y")], jit=False),
        model("side", side, [tensor("X")], [tensor("Y")], jit=False),
        ensemble(
            "e",
            [tensor("IN")],
            [tensor("C"), tensor("S1"), tensor("S2")],
            [
                step("split", {"X": "IN"}, {"Y": "a"}),
                # With one slot per step every step goes through its actor, and the failing
                # step is woken between two async siblings: whichever order trio runs the
                # three actors in, a sibling hands the run to a task before 'check' fails it.
                step("side", {"X": "a"}, {"Y": "S1"}),
                step("check", {"X": "a"}, {"Y": "C"}),
                step("side", {"X": "a"}, {"Y": "S2"}),
            ],
            max_inflight_requests=1,
        ),
    ]
    async with orchestrion.open_server(models=models) as server:
        for _ in range(20):
            with pytest.raises(orchestrion.InferenceError, match="negative"):
                await server.infer("e", {"IN": -X})
            await trio.testing.wait_all_tasks_blocked()
        assert_idle(server, "e")
        assert server.model_statistics("side")[0].execution_count == 0


async def test_leaving_normally_after_a_cancelled_unload_lets_the_draining_run_finish(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The guide: leaving the block normally lets requests from other tasks finish."""
    gate = trio.Event()
    results: list[Any] = []
    models = [gated("slow", gate), double(jit=False), chain("chain", "slow", "double")]

    async def open_gate_once_closing() -> None:
        await trio.testing.wait_all_tasks_blocked()
        gate.set()

    async with trio.open_nursery() as outer, orchestrion.open_server(models=models) as server:
        outer.start_soon(outcome, server, results, "chain", {"IN": X})
        await trio.testing.wait_all_tasks_blocked()
        with trio.move_on_after(1):  # the caller gives up waiting for the drain
            await server.unload_model("chain")
        outer.start_soon(open_gate_once_closing)
    assert not isinstance(results[0], Exception), results[0]


async def test_an_inner_ensemble_is_not_unloaded_under_a_draining_outer_run(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A nested step whose inner ensemble is unloaded mid-run must still be answered."""
    gate = trio.Event()
    results: list[Any] = []
    models = [
        gated("slow", gate),
        double(jit=False),
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
    async with orchestrion.open_server(models=models) as server, trio.open_nursery() as nursery:
        nursery.start_soon(outcome, server, results, "outer", {"IN": X})
        await trio.testing.wait_all_tasks_blocked()
        with trio.move_on_after(1):
            await server.unload_model("outer")
        # Refusing (the draining 'outer' still uses it) would be right too.
        with contextlib.suppress(orchestrion.ConfigError):
            await server.unload_model("inner")
        gate.set()
    assert not isinstance(results[0], Exception), results[0]


async def test_a_load_cancelled_while_starting_an_ensemble_leaks_no_actor(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Cancelling load_model at any point leaves nothing running that blocks the exit."""
    leaving, exited = trio.Event(), trio.Event()
    original = ensemble_module.EnsembleRunner.serve

    async def run_server() -> None:
        models = [double(jit=False), chain("chain", "double", "double")]
        async with orchestrion.open_server(models=models) as server:
            with trio.CancelScope() as load_scope:

                async def serve(self: Any, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
                    load_scope.cancel()  # the caller gives up while the ensemble starts
                    await original(self, task_status=task_status)

                monkeypatch.setattr(ensemble_module.EnsembleRunner, "serve", serve)
                await server.load_model([double(jit=False), chain("chain", "double", "double")])
            monkeypatch.undo()
            assert load_scope.cancelled_caught
            leaving.set()
        exited.set()

    async with trio.open_nursery() as outer:
        outer.start_soon(run_server)
        await leaving.wait()
        await trio.testing.wait_all_tasks_blocked()
        hung = not exited.is_set()
        outer.cancel_scope.cancel()
    assert not hung, "leaving open_server hung"


async def test_a_load_during_a_normal_exit_does_not_hang_the_exit() -> None:
    """Another task's load_model racing the block's normal exit must not keep the server alive."""
    gate, leaving, load_done, exited = trio.Event(), trio.Event(), trio.Event(), trio.Event()
    results: list[Any] = []
    loads: list[Any] = []
    servers: list[orchestrion.AsyncServer] = []

    async def run_server() -> None:
        models = [gated("slow", gate), chain("chain", "slow", "slow")]
        async with orchestrion.open_server(models=models) as server:
            servers.append(server)
            outer.start_soon(outcome, server, results, "chain", {"IN": X})
            await trio.testing.wait_all_tasks_blocked()
            leaving.set()
        exited.set()

    async def load_late() -> None:
        try:
            await servers[0].load_model(double(jit=False))
            loads.append("loaded")
        except Exception as exc:
            loads.append(exc)
        finally:
            load_done.set()

    async with trio.open_nursery() as outer:
        outer.start_soon(run_server)
        await leaving.wait()
        await trio.testing.wait_all_tasks_blocked()  # close() holds the lock, drains 'chain'
        outer.start_soon(load_late)
        await trio.testing.wait_all_tasks_blocked()  # load_model waits for that lock
        gate.set()
        await load_done.wait()
        await trio.testing.wait_all_tasks_blocked()
        hung = not exited.is_set()
        outer.cancel_scope.cancel()
    assert not isinstance(results[0], Exception), results[0]
    assert not hung, f"leaving open_server hung (late load: {loads})"


async def test_a_server_left_by_an_error_answers_no_more_requests() -> None:
    """After the block failed, requests get ServerClosedError, as after a normal exit."""
    kept: list[orchestrion.AsyncServer] = []

    async def fail_while_serving() -> None:
        models = [double(jit=False), chain("chain", "double", "double")]
        async with orchestrion.open_server(models=models) as server:
            kept.append(server)
            raise _Boom

    with pytest.raises(_Boom):
        await fail_while_serving()
    with pytest.raises(orchestrion.ServerClosedError):
        await kept[0].infer("double", {"X": X})
    with pytest.raises(orchestrion.ServerClosedError):
        await kept[0].infer("chain", {"IN": X})


async def test_is_model_ready_is_false_once_the_server_has_closed() -> None:
    """A health check on a closed server says 'not ready' instead of raising."""
    async with orchestrion.open_server(models=[double(jit=False)]) as server:
        assert server.is_model_ready("double")
    assert server.is_model_ready("double") is False


async def test_the_request_parameter_does_not_expose_writable_inputs() -> None:
    """Read-only inputs must also hold for ``request.inputs`` (the caller's array stays intact)."""

    def execute(X, request):
        request.inputs["X"][0] = 99.0
        return {"Y": X}

    sneaky = model("sneaky", execute, [tensor("X")], [tensor("Y")], jit=False)
    mine = np.ones(16, np.float32)
    async with orchestrion.open_server(models=[sneaky]) as server:
        # The write failing this request is the documented outcome.
        with contextlib.suppress(orchestrion.InferenceError):
            await server.infer("sneaky", {"X": mine})
    assert mine[0] == 1.0


# -- regression tests -----------------------------------------------------------------------


async def test_unloading_a_threaded_model_answers_its_queued_work_once() -> None:
    """Thread mode: one execution running, two queued; unload runs them all, refuses new ones."""
    release = threading.Event()
    results: list[Any] = []
    async with orchestrion.open_server(models=[_held_in_a_thread("held", release)]) as server:
        runner = inside(server).runner("held")
        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(outcome, server, results, "held", {"X": X})
            await trio.testing.wait_all_tasks_blocked()
            assert (runner.queued, runner.instances[0].busy) == (2, True)
            await server.unload_model("held")
            with pytest.raises(orchestrion.ModelNotFoundError):
                await server.infer("held", {"X": X})
            release.set()
        assert [r.outputs["Y"].tolist() for r in results] == [[1.0] * 16] * 3
        assert runner.statistics().execution_count == 3
        assert (runner.queued, runner.instances[0].busy) == (0, False)


async def test_reloading_a_threaded_model_with_queued_work_answers_each_request_once() -> None:
    """Queued work stays with the old version; requests after the reload reach the new one."""
    release = threading.Event()
    results: list[Any] = []
    async with orchestrion.open_server(models=[_held_in_a_thread("held", release)]) as server:
        old = inside(server).runner("held")
        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(outcome, server, results, "held", {"X": X})
            await trio.testing.wait_all_tasks_blocked()
            await server.load_model(_held_in_a_thread("held", release, add=1.0))
            nursery.start_soon(outcome, server, results, "held", {"X": X})
            await trio.testing.wait_all_tasks_blocked()
            release.set()
        values = sorted(float(r.outputs["Y"][0]) for r in results)
        assert values == [1.0, 1.0, 1.0, 2.0]
        # The reloaded version keeps counting on (counters never go backwards): 3 old + 1 new.
        assert old.stats is inside(server).runner("held").stats
        assert server.model_statistics("held")[0].execution_count == 4
        assert_idle(server)


async def test_a_cancelled_threaded_execution_keeps_its_instance_busy_until_it_ends() -> None:
    """A thread cannot be interrupted: the instance stays busy, the next request waits its turn."""
    release = threading.Event()
    results: list[Any] = []
    async with orchestrion.open_server(models=[_held_in_a_thread("held", release)]) as server:
        runner = inside(server).runner("held")
        async with trio.open_nursery() as nursery:
            given_up = trio.CancelScope()

            async def give_up() -> None:
                with given_up:
                    await server.infer("held", {"X": X})

            nursery.start_soon(give_up)
            await trio.testing.wait_all_tasks_blocked()
            given_up.cancel()  # the running request's caller goes away
            await trio.testing.wait_all_tasks_blocked()
            assert runner.instances[0].busy
            nursery.start_soon(outcome, server, results, "held", {"X": X})
            await trio.testing.wait_all_tasks_blocked()
            assert runner.queued == 1  # behind the abandoned execution, not beside it
            release.set()
        assert given_up.cancelled_caught
        assert [r.outputs["Y"].tolist() for r in results] == [[1.0] * 16]
        stats = server.model_statistics("held")[0]
        assert (stats.inference_stats.success.count, stats.inference_stats.fail.count) == (1, 1)
        assert stats.execution_count == 2
        assert_idle(server)


async def test_an_instance_switching_between_inline_and_thread_never_overlaps() -> None:
    """'auto' instances move between thread and inline under load; one execution at a time."""
    lock = threading.Lock()
    active = [0]
    overlaps: list[int] = []

    def execute(X):
        with lock:
            active[0] += 1
            if active[0] > 1:
                overlaps.append(active[0])
        try:
            return {"Y": X * 2}
        finally:
            with lock:
                active[0] -= 1

    auto = model("auto", execute, [tensor("X")], [tensor("Y")], jit=False, parameters={})
    models = [auto, chain("chain", "auto", "auto", max_inflight_requests=2)]
    results: list[Any] = []
    async with orchestrion.open_server(models=models) as server:
        instance = inside(server).instances("auto")[0]
        assert not instance.inline  # unmeasured: starts in a thread
        for _ in range(4):
            async with trio.open_nursery() as nursery:
                for i in range(12):
                    if i % 3:
                        nursery.start_soon(outcome, server, results, "chain", {"IN": X})
                    else:
                        nursery.start_soon(outcome, server, results, "auto", {"X": X})
        await trio.testing.wait_all_tasks_blocked()
        assert overlaps == []
        assert all(not isinstance(r, Exception) for r in results), results
        assert len(results) == 48
        assert sorted(float(r.outputs.get("OUT", r.outputs.get("Y"))[0]) for r in results) == (
            [2.0] * 16 + [4.0] * 32
        )
        assert_idle(server, "chain")


async def test_new_shapes_never_compile_on_the_event_loop_under_concurrency() -> None:
    """Concurrent direct and ensemble requests of new shapes: every trace happens in a thread."""
    traced_on_main: list[bool] = []

    def execute(X):
        traced_on_main.append(threading.current_thread() is threading.main_thread())
        return {"Y": X + 1}

    any_length = model(
        "any_length",
        execute,
        [tensor("X", dims=(-1,))],
        [tensor("Y", dims=(-1,))],
        count=2,
        parameters={"execution": "inline"},  # inline once compiled: the fast path is in play
    )
    chain = ensemble(
        "chain",
        [tensor("IN", dims=(-1,))],
        [tensor("OUT", dims=(-1,))],
        [
            step("any_length", {"X": "IN"}, {"Y": "mid"}),
            step("any_length", {"X": "mid"}, {"Y": "OUT"}),
        ],
    )
    results: list[Any] = []
    async with orchestrion.open_server(models=[any_length, chain]) as server:
        async with trio.open_nursery() as nursery:
            for length in (3, 5, 3, 7, 5, 3, 7, 7):
                x = np.zeros(length, np.float32)
                nursery.start_soon(outcome, server, results, "chain", {"IN": x})
                nursery.start_soon(outcome, server, results, "any_length", {"X": x})
        assert all(not isinstance(r, Exception) for r in results), results
        assert {float(v) for r in results for v in next(iter(r.outputs.values()))} == {1.0, 2.0}
        assert traced_on_main
        assert not any(traced_on_main)
        for instance in inside(server).instances("any_length"):
            assert instance.compiled <= {((3,),), ((5,),), ((7,),)}
        assert_idle(server, "chain")


async def test_the_fast_path_starts_no_step_after_an_inline_step_failed() -> None:
    """Inline steps run one after another in one task: the one after a failure is skipped."""

    def check(X):
        raise ValueError("broken")

    models = [
        model(
            "split",
            lambda X: {"A": X, "B": X, "C": X},
            [tensor("X")],
            [tensor(n) for n in "ABC"],
            jit=False,
        ),
        model("check", check, [tensor("X")], [tensor("Y")], jit=False),
        double(jit=False, name="tail"),
        ensemble(
            "e",
            [tensor("IN")],
            [tensor("T1"), tensor("C"), tensor("T2")],
            [
                step("split", {"X": "IN"}, {"A": "a", "B": "b", "C": "c"}),
                step("tail", {"X": "a"}, {"Y": "T1"}),
                step("check", {"X": "b"}, {"Y": "C"}),  # runs second, whatever the order
                step("tail", {"X": "c"}, {"Y": "T2"}),
            ],
        ),
    ]
    recorder = StepRecorder()
    async with orchestrion.open_server(models=models, observers=[recorder]) as server:
        with pytest.raises(orchestrion.InferenceError, match="broken"):
            await server.infer("e", {"IN": X})
        assert server.model_statistics("tail")[0].execution_count == 1
        assert len(recorder.requests) == 3
        assert_idle(server, "e")


def _fault_models() -> list[orchestrion.Model]:
    """inline, failing, async (slept) and threaded models under two nested ensembles."""

    def check(X):
        if X[0] < 0:
            raise ValueError("negative")
        return {"Y": X}

    async def sleepy(X):
        await trio.sleep(float(X[1]))
        return {"Y": X}

    return [
        model("fast", lambda X: {"Y": X + 1}, [tensor("X")], [tensor("Y")], jit=False),
        model("check", check, [tensor("X")], [tensor("Y")], jit=False),
        model("sleepy", sleepy, [tensor("X")], [tensor("Y")], jit=False, count=2),
        model(
            "threaded",
            lambda X: {"Y": X + 0},
            [tensor("X")],
            [tensor("Y")],
            jit=False,
            parameters={"execution": "thread"},
        ),
        ensemble(
            "inner",
            [tensor("IN")],
            [tensor("OUT")],
            [step("sleepy", {"X": "IN"}, {"Y": "a"}), step("check", {"X": "a"}, {"Y": "OUT"})],
            max_inflight_requests=2,
        ),
        ensemble(
            "outer",
            [tensor("IN")],
            [tensor("O1"), tensor("O2")],
            [
                step("fast", {"X": "IN"}, {"Y": "m"}),
                step("inner", {"IN": "m"}, {"OUT": "O1"}),
                step("threaded", {"X": "m"}, {"Y": "t"}),
                step("check", {"X": "t"}, {"Y": "O2"}),
            ],
            max_inflight_requests=2,
        ),
    ]


def _random_request(rnd: random.Random) -> tuple[str, dict[str, np.ndarray]]:
    x = np.ones(16, np.float32)
    x[0] = -2.0 if rnd.random() < 0.2 else 1.0  # 'check' fails
    x[1] = rnd.choice([0.0, 0.5, 2.0])  # seconds 'sleepy' takes
    target = rnd.choice(["outer", "outer", "inner", "sleepy", "check", "threaded"])
    return target, ({"IN": x} if target in ("outer", "inner") else {"X": x})


@pytest.mark.parametrize("seed", range(6))
async def test_timeouts_cancellations_and_errors_leave_every_counter_at_rest(
    autojump_clock: trio.testing.MockClock, seed: int
) -> None:
    """A random mix over nested ensembles: every request answered, every counter back to 0."""
    rnd = random.Random(seed)
    results: list[Any] = []

    async def one(scope: trio.CancelScope, target: str, inputs: Any, limit: Any) -> None:
        with scope:
            await outcome(server, results, target, inputs, timeout=limit)

    async with orchestrion.open_server(models=_fault_models()) as server:
        async with trio.open_nursery() as nursery:
            scopes: list[trio.CancelScope] = []
            for _ in range(24):
                target, inputs = _random_request(rnd)
                timeout = rnd.choice([None, 0.3, 1.0, 3.0])
                scope = trio.CancelScope()
                scopes.append(scope)
                nursery.start_soon(one, scope, target, inputs, timeout)
                if rnd.random() < 0.3:
                    await trio.sleep(rnd.choice([0.0, 0.1, 0.6]))
                if rnd.random() < 0.15:
                    rnd.choice(scopes).cancel()
        # One instance, first in first out: once this is answered, abandoned threaded work is done.
        await server.infer("threaded", {"X": X})
        await trio.testing.wait_all_tasks_blocked()
        assert_idle(server, "outer", "inner")
        assert all(
            isinstance(r, orchestrion.InferResponse | orchestrion.OrchestrionError) for r in results
        )


@pytest.mark.parametrize("seed", range(8))
async def test_leaving_by_an_error_answers_every_request_of_a_random_mix(
    autojump_clock: trio.testing.MockClock, seed: int
) -> None:
    """Requests queued, running, blocked and nested when the block fails: each gets one answer."""
    rnd = random.Random(seed)
    gate = trio.Event()  # never set: those requests are still running at the exit
    models = _fault_models()
    # No worker threads here: the autojump clock would race ahead of them.
    models[3] = model("threaded", lambda X: {"Y": X + 0}, [tensor("X")], [tensor("Y")], jit=False)
    models.append(gated("gated", gate, count=1))
    models.append(chain("gated_chain", "sleepy", "gated", max_inflight_requests=1))
    results: list[Any] = []
    sent = 12

    async def fail_while_serving(outer: trio.Nursery, guard: trio.CancelScope) -> None:
        async with orchestrion.open_server(models=models) as server:
            guard.deadline = trio.current_time() + 600  # set after loading (threads)
            for _ in range(sent):
                target, inputs = _random_request(rnd)
                if rnd.random() < 0.3:
                    target, inputs = "gated_chain", {"IN": inputs.popitem()[1]}
                outer.start_soon(outcome, server, results, target, inputs)
                if rnd.random() < 0.3:
                    await trio.sleep(rnd.choice([0.0, 0.1, 0.6]))
            await trio.testing.wait_all_tasks_blocked()
            raise _Boom

    with trio.CancelScope() as guard:
        async with trio.open_nursery() as outer:
            with pytest.raises(_Boom):
                await fail_while_serving(outer, guard)
    assert not guard.cancelled_caught, "a request was never answered"
    assert len(results) == sent


@pytest.mark.parametrize("seed", range(4))
async def test_reloading_composing_models_under_load_loses_no_request(seed: int) -> None:
    """Reload the inline and the threaded step of a running pipeline: every request succeeds."""
    rnd = random.Random(seed)
    gate = trio.Event()

    def threaded(add: float) -> orchestrion.Model:
        return model(
            "threaded",
            lambda X: {"Y": X + add},
            [tensor("X")],
            [tensor("Y")],
            jit=False,
            parameters={"execution": "thread"},
        )

    def fast(factor: float) -> orchestrion.Model:
        return model("fast", lambda X: {"Y": X * factor}, [tensor("X")], [tensor("Y")], jit=False)

    models = [
        gated("slow", gate, count=2),
        fast(2),
        threaded(0),
        ensemble(
            "e",
            [tensor("IN")],
            [tensor("OUT")],
            [
                step("slow", {"X": "IN"}, {"Y": "a"}),
                step("fast", {"X": "a"}, {"Y": "b"}),
                step("threaded", {"X": "b"}, {"Y": "OUT"}),
            ],
            max_inflight_requests=2,
        ),
    ]
    results: list[Any] = []
    async with orchestrion.open_server(models=models) as server:
        async with trio.open_nursery() as nursery:
            for _ in range(10):
                target = rnd.choice(["e", "e", "threaded", "fast"])
                inputs = {"IN": X} if target == "e" else {"X": X}
                nursery.start_soon(outcome, server, results, target, inputs)
            await trio.testing.wait_all_tasks_blocked()
            for _ in range(3):
                await server.load_model(fast(3) if rnd.random() < 0.5 else threaded(1))
                if rnd.random() < 0.5:
                    gate.set()
            gate.set()
        assert len(results) == 10
        assert all(not isinstance(r, Exception) for r in results), results
        assert_idle(server, "e")
