"""Dynamic batching at the edges: preferred sizes, order, freed queue places, delays, shutdown."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import trio
import trio.testing

import orchestrion
from orchestrion.protocols import QueuePolicy
from orchestrion.testing import outcome
from support.batching import batching, plain, row

ROW = (4,)


def gated(gate: trio.Event, order: list[list[float]]) -> Any:
    async def execute(X: Any) -> dict[str, Any]:
        await gate.wait()
        order.append([float(v) for v in X[:, 0]])
        return {"Y": X * 2}

    return execute


async def test_request_larger_than_a_preferred_size_is_answered() -> None:
    """A 3-row request with preferred_batch_size 2 (max 4) is run, not trimmed away forever."""
    m = batching(plain("m", lambda X: {"Y": X * 2}, max_batch_size=4), preferred_batch_size=(2,))
    async with orchestrion.open_server(models=[m]) as server:
        with trio.move_on_after(3) as scope:
            response = await server.infer("m", {"X": row(1, 3)})
    assert not scope.cancelled_caught, "a 3-row request was never answered (empty batches)"
    np.testing.assert_array_equal(response.outputs["Y"], row(2, 3))


async def test_trimming_to_a_preferred_size_keeps_arrival_order() -> None:
    """A (1 row), B (2 rows), C (1 row) queued with preferred 2: C must not overtake B."""
    gate, order = trio.Event(), []
    m = batching(plain("m", gated(gate, order), max_batch_size=4), preferred_batch_size=(2,))
    async with orchestrion.open_server(models=[m]) as server, trio.open_nursery() as nursery:
        nursery.start_soon(server.infer, "m", {"X": row(0)})
        await trio.testing.wait_all_tasks_blocked()
        for value, rows in ((1, 1), (2, 2), (3, 1)):
            nursery.start_soon(server.infer, "m", {"X": row(value, rows)})
            await trio.testing.wait_all_tasks_blocked()
        gate.set()
    flat = [v for batch in order for v in batch]
    assert flat.index(2.0) < flat.index(3.0), order


async def test_a_cancelled_queued_request_frees_its_queue_slot() -> None:
    """max_queue_size 1: once the one waiting request is cancelled, another is accepted."""
    gate, order, results = trio.Event(), [], []
    m = batching(
        plain("m", gated(gate, order), max_batch_size=1),
        default_queue_policy=QueuePolicy(max_queue_size=1),
    )
    async with orchestrion.open_server(models=[m]) as server, trio.open_nursery() as nursery:
        nursery.start_soon(server.infer, "m", {"X": row(0)})  # runs, waits for the gate
        await trio.testing.wait_all_tasks_blocked()
        scope = trio.CancelScope()

        async def queued() -> None:
            with scope:
                await server.infer("m", {"X": row(1)})

        nursery.start_soon(queued)
        await trio.testing.wait_all_tasks_blocked()
        scope.cancel()  # the client of the queued request goes away
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(outcome, server, results, "m", {"X": row(2)})
        await trio.testing.wait_all_tasks_blocked()
        gate.set()
    assert not isinstance(results[0], orchestrion.QueueFullError), results[0]


async def test_queue_delay_counts_from_arrival_not_from_a_free_instance(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A request that already waited longer than max_queue_delay runs as soon as an
    instance is free; it is not held for a second full delay."""
    answered: dict[int, float] = {}

    async def execute(X: Any) -> dict[str, Any]:
        await trio.sleep(float(X[0, 0]))  # request 0 takes 5 s, request 1 no time
        return {"Y": X}

    m = batching(plain("m", execute), max_queue_delay_microseconds=1_000_000)  # 1 s

    async def one(server: orchestrion.AsyncServer, i: int, value: float) -> None:
        await server.infer("m", {"X": row(value)})
        answered[i] = trio.current_time() - start

    async with orchestrion.open_server(models=[m]) as server:
        start = trio.current_time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(one, server, 0, 5.0)  # waits 1 s (delay), runs 1 s .. 6 s
            await trio.sleep(2)
            nursery.start_soon(one, server, 1, 0.0)  # arrives at 2 s: its delay ends at 3 s
    assert answered[0] == pytest.approx(6)
    assert answered[1] == pytest.approx(6), answered  # not 7: it already waited 4 s


class _Boom(Exception):
    """The caller's own error, raised inside the server's block."""


async def test_leaving_by_an_error_answers_requests_still_in_the_channel(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """One running, one in the batcher's heap, one still in the model's channel: all three
    callers (other tasks) get ServerClosedError when the block fails."""
    results: list[Any] = []
    m = batching(plain("m", gated(trio.Event(), []), max_batch_size=1))

    async def fail_while_serving(outer: trio.Nursery, guard: trio.CancelScope) -> None:
        async with orchestrion.open_server(models=[m]) as server:
            guard.deadline = trio.current_time() + 60
            for i in range(3):
                outer.start_soon(outcome, server, results, "m", {"X": row(i)})
                await trio.testing.wait_all_tasks_blocked()
            raise _Boom

    with trio.CancelScope() as guard:
        async with trio.open_nursery() as outer:
            with pytest.raises(_Boom):
                await fail_while_serving(outer, guard)
    assert not guard.cancelled_caught, f"a request never got an answer: {results}"
    assert len(results) == 3


async def test_queue_and_compute_statistics_count_requests(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Triton counts queue and compute durations per request: 20 successful requests in 3
    executions give queue.count == compute_infer.count == success.count == 20."""
    m = batching(plain("m", lambda X: {"Y": X * 2}), max_queue_delay_microseconds=1000)
    async with orchestrion.open_server(models=[m]) as server:
        async with trio.open_nursery() as nursery:
            for i in range(20):
                nursery.start_soon(server.infer, "m", {"X": row(i)})
        stats = server.model_statistics("m")[0]
    assert stats.execution_count == 3
    inference = stats.inference_stats
    assert inference.success.count == 20
    assert (inference.queue.count, inference.compute_infer.count) == (20, 20), inference
