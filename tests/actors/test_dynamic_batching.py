"""Dynamic batching: requests gathered into executions, split back, queue limits, timeouts,
priorities, ordering, compiled sizes, and ensembles that benefit unchanged."""

from __future__ import annotations

import functools
import time
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest
import trio
import trio.testing

import orchestrion
from orchestrion.protocols import (
    InferenceError,
    InferenceTimeoutError,
    QueueFullError,
    QueuePolicy,
)
from orchestrion.protocols._kserve_documents import model_statistics_json
from orchestrion.testing import assert_idle, ensemble, inside, model, outcome, step, tensor
from support.batching import ROW, batching, plain, row


def recorder(calls: list[int], factor: float = 2.0) -> Any:
    def execute(X: Any) -> dict[str, Any]:
        calls.append(int(X.shape[0]))
        return {"Y": X * factor}

    return execute


def gated_rows(gate: trio.Event, calls: list[int], order: list[float] | None = None) -> Any:
    async def execute(X: Any) -> dict[str, Any]:
        calls.append(int(X.shape[0]))
        await gate.wait()
        if order is not None:
            order.extend(float(v) for v in X[:, 0])
        return {"Y": X * 2}

    return execute


async def test_concurrent_requests_become_few_executions(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """20 concurrent requests, max_batch_size 8: 3 executions, each answer its own rows."""
    calls: list[int] = []
    m = batching(plain("m", recorder(calls)), max_queue_delay_microseconds=1000)
    results: dict[int, Any] = {}

    async def one(server: orchestrion.AsyncServer, i: int) -> None:
        results[i] = (await server.infer("m", {"X": row(i)})).outputs["Y"]

    async with orchestrion.open_server(models=[m]) as server:
        async with trio.open_nursery() as nursery:
            for i in range(20):
                nursery.start_soon(one, server, i)
        stats = server.model_statistics("m")[0]
        assert_idle(server)
    assert calls == [8, 8, 4]
    for i in range(20):
        np.testing.assert_array_equal(results[i], row(2 * i))
    assert (stats.execution_count, stats.inference_count) == (3, 20)
    assert stats.inference_stats.success.count == 20
    # Triton's batch statistics: executions by batch size, each counted once.
    assert [(b.batch_size, b.compute_infer.count) for b in stats.batch_stats] == [(4, 1), (8, 2)]
    assert all(b.compute_infer.ns > 0 for b in stats.batch_stats)
    document = model_statistics_json([stats])["model_stats"][0]["batch_stats"]
    assert [(b["batch_size"], b["compute_infer"]["count"]) for b in document] == [(4, 1), (8, 2)]


async def test_requests_of_several_rows_are_split_back() -> None:
    """Requests with batch sizes 3, 2 and 1 share an execution and get their own rows."""
    gate, calls = trio.Event(), []
    m = batching(plain("m", gated_rows(gate, calls), count=1))
    results: list[Any] = []
    async with orchestrion.open_server(models=[m]) as server, trio.open_nursery() as nursery:
        nursery.start_soon(outcome, server, results, "m", {"X": row(9)})
        await trio.testing.wait_all_tasks_blocked()  # it runs alone; the rest queue
        for value, rows in ((1, 3), (2, 2), (3, 1)):
            nursery.start_soon(outcome, server, results, "m", {"X": row(value, rows)})
        await trio.testing.wait_all_tasks_blocked()
        gate.set()
    assert calls == [1, 6]
    shapes = sorted((float(r.outputs["Y"][0, 0]), r.outputs["Y"].shape[0]) for r in results)
    assert shapes == [(2.0, 3), (4.0, 2), (6.0, 1), (18.0, 1)]


async def test_preferred_batch_size(autojump_clock: trio.testing.MockClock) -> None:
    """With preferred_batch_size 4, six waiting requests run as 4 then 2."""
    gate, calls = trio.Event(), []
    m = batching(plain("m", gated_rows(gate, calls)), preferred_batch_size=(4,))
    async with orchestrion.open_server(models=[m]) as server, trio.open_nursery() as nursery:
        nursery.start_soon(server.infer, "m", {"X": row(0)})
        await trio.testing.wait_all_tasks_blocked()
        for i in range(6):
            nursery.start_soon(server.infer, "m", {"X": row(i)})
        await trio.testing.wait_all_tasks_blocked()
        gate.set()
    assert calls == [1, 4, 2]


async def test_a_full_queue_rejects_with_tritons_error() -> None:
    """max_queue_size: the next request is refused at once, counted as REJECTED."""
    gate, calls = trio.Event(), []
    m = batching(
        plain("m", gated_rows(gate, calls), max_batch_size=1),
        default_queue_policy=QueuePolicy(max_queue_size=2),
    )
    async with orchestrion.open_server(models=[m]) as server:
        async with trio.open_nursery() as nursery:
            for i in range(3):  # one runs, two wait
                nursery.start_soon(server.infer, "m", {"X": row(i)})
                await trio.testing.wait_all_tasks_blocked()
            with pytest.raises(QueueFullError, match="Exceeds maximum queue size"):
                await server.infer("m", {"X": row(9)})
            gate.set()
        stats = server.model_statistics("m")[0]
        assert_idle(server)
        await server.infer("m", {"X": row(1)})  # room again
    assert stats.failures_by_reason == {"REJECTED": 1}
    assert stats.inference_stats.success.count == 3


async def test_a_queued_request_times_out(autojump_clock: trio.testing.MockClock) -> None:
    """A request's timeout expires while it waits: it fails, the others run, nothing leaks."""
    gate, calls, results = trio.Event(), [], []
    m = batching(plain("m", gated_rows(gate, calls), max_batch_size=2))
    async with orchestrion.open_server(models=[m]) as server:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(outcome, server, results, "m", {"X": row(0)})
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(
                functools.partial(outcome, timeout=1.0), server, results, "m", {"X": row(1)}
            )
            nursery.start_soon(outcome, server, results, "m", {"X": row(2)})
            await trio.sleep(2)
            gate.set()
        assert_idle(server)
    assert [type(r).__name__ for r in results].count("InferenceTimeoutError") == 1
    assert calls == [1, 1]  # the timed-out one never ran


async def test_queue_policy_timeout_rejects(autojump_clock: trio.testing.MockClock) -> None:
    """default_timeout_microseconds with REJECT fails requests that waited too long."""
    gate, calls, results = trio.Event(), [], []
    m = batching(
        plain("m", gated_rows(gate, calls), max_batch_size=1),
        default_queue_policy=QueuePolicy(
            default_timeout_microseconds=100_000, timeout_action="REJECT"
        ),
    )
    async with orchestrion.open_server(models=[m]) as server:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(outcome, server, results, "m", {"X": row(0)})
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(outcome, server, results, "m", {"X": row(1)})
            await trio.testing.wait_all_tasks_blocked()
            await trio.to_thread.run_sync(time.sleep, 0.2)  # real time: the policy's clock
            gate.set()
        assert_idle(server)
    errors = [r for r in results if isinstance(r, Exception)]
    assert len(errors) == 1
    assert isinstance(errors[0], InferenceTimeoutError)
    assert "timed out in the queue" in str(errors[0])


async def test_higher_priority_requests_go_first() -> None:
    """With priority levels, a level-1 request overtakes level-2 requests queued earlier."""
    gate, calls, order = trio.Event(), [], []
    m = batching(
        plain("m", gated_rows(gate, calls, order), max_batch_size=1),
        priority_levels=2,
        default_priority_level=2,
    )
    async with orchestrion.open_server(models=[m]) as server, trio.open_nursery() as nursery:
        nursery.start_soon(server.infer, "m", {"X": row(0)})
        await trio.testing.wait_all_tasks_blocked()
        for value in (1, 2):
            nursery.start_soon(server.infer, "m", {"X": row(value)})  # default level 2
            await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(functools.partial(server.infer, priority=1), "m", {"X": row(3)})
        await trio.testing.wait_all_tasks_blocked()
        gate.set()
    assert order == [0.0, 3.0, 1.0, 2.0]


@pytest.mark.parametrize("preserve", [False, True])
async def test_preserve_ordering(autojump_clock: trio.testing.MockClock, preserve: bool) -> None:
    """Three instances, the first request slowest: with preserve_ordering no request is
    answered before the ones that arrived earlier."""
    answered: dict[int, float] = {}

    async def execute(X: Any) -> dict[str, Any]:
        await trio.sleep(10 - float(X[0, 0]))  # request 0 takes 10 s, 1 takes 9, 2 takes 8
        return {"Y": X}

    m = batching(plain("m", execute, max_batch_size=1, count=3), preserve_ordering=preserve)

    async def one(server: orchestrion.AsyncServer, i: int) -> None:
        await server.infer("m", {"X": row(i)})
        answered[i] = trio.current_time() - start

    async with orchestrion.open_server(models=[m]) as server:
        start = trio.current_time()
        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(one, server, i)
                await trio.testing.wait_all_tasks_blocked()
    if preserve:
        assert answered == {0: 10, 1: 10, 2: 10}
    else:
        assert answered == {0: 10, 1: 9, 2: 8}


async def test_jitted_batches_pad_to_sizes_compiled_at_load() -> None:
    """A jitted batching model compiles its padded sizes at load and never under load."""

    def mlp(X: Any) -> dict[str, Any]:
        return {"Y": jnp.tanh(X) * 2}

    m = batching(
        model("mlp", mlp, [tensor("X", dims=ROW)], [tensor("Y", dims=ROW)], max_batch_size=8),
        max_queue_delay_microseconds=500,
    )
    async with orchestrion.open_server(models=[m]) as server:
        runner = inside(server).runner("mlp")
        compiled = set(runner.instances[0].compiled)
        assert {s[0][0] for s in compiled if s[0] is not None} == {1, 2, 4, 8}
        results: list[Any] = []
        async with trio.open_nursery() as nursery:
            for i in range(13):
                nursery.start_soon(outcome, server, results, "mlp", {"X": row(i / 10, 1 + i % 2)})
        assert runner.instances[0].compiled == compiled
    for r in results:
        x = np.asarray(r.outputs["Y"])
        assert x.shape[1:] == ROW


async def test_ensembles_batch_their_composing_models(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Concurrent ensemble requests reach a batching composing model's queue unchanged."""
    calls: list[int] = []
    models = [
        batching(plain("double", recorder(calls)), max_queue_delay_microseconds=1000),
        ensemble(
            "pipe",
            [tensor("IN", dims=ROW)],
            [tensor("OUT", dims=ROW)],
            [step("double", {"X": "IN"}, {"Y": "OUT"})],
            max_batch_size=8,
        ),
    ]
    results: list[Any] = []
    async with orchestrion.open_server(models=models) as server, trio.open_nursery() as nursery:
        for i in range(16):
            nursery.start_soon(outcome, server, results, "pipe", {"IN": row(i)})
    assert calls == [8, 8]
    assert sorted(float(r.outputs["OUT"][0, 0]) for r in results) == [2.0 * i for i in range(16)]


async def test_a_batched_result_with_too_few_rows_fails_every_request(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A model that drops the batch dimension fails the whole batch with a clear error."""
    m = batching(
        plain("sum", lambda X: {"Y": X.sum(axis=0, keepdims=True)}),
        max_queue_delay_microseconds=1000,
    )
    results: list[Any] = []
    async with orchestrion.open_server(models=[m]) as server:
        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(outcome, server, results, "sum", {"X": row(i)})
        assert_idle(server)
    assert len(results) == 3
    for r in results:
        assert isinstance(r, InferenceError)
        assert "one row per input row" in str(r)


async def test_concurrent_requests_batch_even_with_no_queue_delay() -> None:
    """max_queue_delay 0: 20 requests submitted together still run as 3 executions."""
    calls: list[int] = []
    m = batching(plain("m", recorder(calls)))

    async def one(server: orchestrion.AsyncServer, i: int) -> None:
        response = await server.infer("m", {"X": row(i)})
        np.testing.assert_array_equal(response.outputs["Y"], row(2 * i))

    async with orchestrion.open_server(models=[m]) as server:
        async with trio.open_nursery() as nursery:
            for i in range(20):
                nursery.start_soon(one, server, i)
        assert_idle(server)
    assert calls == [8, 8, 4]


@pytest.mark.parametrize(("delay", "in_caller"), [(0, True), (1000, False)])
async def test_a_lone_request_runs_in_its_callers_task(delay: int, in_caller: bool) -> None:
    """With no queue delay, a request nobody else can join runs at once in the caller's task
    (no trip through the batcher); with a delay it waits in the batcher for company."""
    tasks: list[object] = []

    def execute(X: Any) -> dict[str, Any]:
        tasks.append(trio.lowlevel.current_task())
        return {"Y": X * 2}

    m = batching(plain("m", execute), max_queue_delay_microseconds=delay)
    async with orchestrion.open_server(models=[m]) as server:
        for i in range(3):
            response = await server.infer("m", {"X": row(i)})
            np.testing.assert_array_equal(response.outputs["Y"], row(2 * i))
        stats = server.model_statistics("m")[0]
        assert_idle(server)
    me = trio.lowlevel.current_task()
    assert [task is me for task in tasks] == [in_caller] * 3
    assert (stats.execution_count, stats.inference_count) == (3, 3)


async def test_after_a_burst_lone_requests_take_the_short_path_again() -> None:
    """A burst batches; the next lone requests run in their caller's task again."""
    calls: list[int] = []
    tasks: list[object] = []

    def execute(X: Any) -> dict[str, Any]:
        calls.append(int(X.shape[0]))
        tasks.append(trio.lowlevel.current_task())
        return {"Y": X * 2}

    m = batching(plain("m", execute))
    async with orchestrion.open_server(models=[m]) as server:
        async with trio.open_nursery() as nursery:
            for i in range(8):
                nursery.start_soon(server.infer, "m", {"X": row(i)})
        assert calls == [8]
        for i in range(3):
            await server.infer("m", {"X": row(i)})
    me = trio.lowlevel.current_task()
    assert calls == [8, 1, 1, 1]
    # The first lone request goes through the batcher (the last batch was 8); then direct.
    assert [task is me for task in tasks[1:]] == [False, True, True]


async def test_requests_arriving_in_the_same_pass_batch_instead_of_running_alone() -> None:
    """Two requests that both check for company in the same scheduling pass both go to the
    batcher and share one execution (neither runs alone)."""
    calls: list[int] = []
    m = batching(plain("m", recorder(calls)))
    async with orchestrion.open_server(models=[m]) as server:
        await server.infer("m", {"X": row(0)})  # light load: the short path is open
        assert calls == [1]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.infer, "m", {"X": row(1)})
            nursery.start_soon(server.infer, "m", {"X": row(2)})
        assert_idle(server)
    assert calls == [1, 2]
