"""Dynamic batching's lone-request short path (`ModelRunner.run_alone`) behaves as the batcher would:
its rows, its row checks, late results discarded, statistics, cancellation, ensembles batching."""

from __future__ import annotations

from typing import Any

import numpy as np
import trio
import trio.testing

import orchestrion
from orchestrion.protocols import InferenceError
from orchestrion.testing import assert_idle, cached, ensemble, inside, outcome, step, tensor
from support.batching import ROW, batching, plain, row


def recorder(calls: list[int], tasks: list[object] | None = None) -> Any:
    def execute(X: Any) -> dict[str, Any]:
        calls.append(int(X.shape[0]))
        if tasks is not None:
            tasks.append(trio.lowlevel.current_task())
        return {"Y": X * 2}

    return execute


async def test_lone_request_whose_result_lacks_rows_fails_like_the_batcher() -> None:
    """A batching model returning fewer rows than a request has fails it through the
    batcher ("one row per input row"); alone, the same request must not succeed."""
    m = batching(plain("sum", lambda X: {"Y": X.sum(axis=0, keepdims=True)}))
    results: list[Any] = []
    async with orchestrion.open_server(models=[m]) as server:
        await outcome(server, results, "sum", {"X": row(1, rows=3)})
        assert_idle(server)
    assert isinstance(results[0], InferenceError), results[0]
    assert "one row per input row" in str(results[0])


async def test_lone_request_gets_only_its_own_rows_like_the_batcher() -> None:
    """The batcher gives each request its own rows of the outputs; alone, a model that
    returns extra rows must not leak them into the response."""
    m = batching(plain("pad", lambda X: {"Y": np.concatenate([X, np.zeros_like(X)])}))
    async with orchestrion.open_server(models=[m]) as server:
        response = await server.infer("pad", {"X": row(1, rows=2)})
    assert response.outputs["Y"].shape == (2, *ROW)


async def test_guard_concurrent_ensemble_requests_still_batch_the_composing_model() -> None:
    """(guard) 32 concurrent ensemble requests over a batched model (no queue delay): the step
    actor hands runs over one per scheduling pass, so each step request must not run
    alone: the model must still batch them."""
    calls: list[int] = []
    models = [
        batching(plain("double", recorder(calls))),
        ensemble(
            "pipe",
            [tensor("IN", dims=ROW)],
            [tensor("OUT", dims=ROW)],
            [step("double", {"X": "IN"}, {"Y": "OUT"})],
            max_batch_size=8,
        ),
    ]
    results: list[Any] = []
    async with orchestrion.open_server(models=models) as server:
        async with trio.open_nursery() as nursery:
            for i in range(32):
                nursery.start_soon(outcome, server, results, "pipe", {"IN": row(i)})
        assert_idle(server, "pipe")
    assert sorted(float(r.outputs["OUT"][0, 0]) for r in results) == [2.0 * i for i in range(32)]
    assert len(calls) < 32, calls


async def test_guard_cancel_in_the_checkpoint_leaves_the_short_path_open() -> None:
    """(guard) A lone request cancelled in its checkpoint is counted once as a failure, and
    the next lone request still runs in its caller's task."""
    calls: list[int] = []
    tasks: list[object] = []
    m = batching(plain("m", recorder(calls, tasks)))
    async with orchestrion.open_server(models=[m]) as server:
        runner = inside(server).runner("m")
        with trio.CancelScope() as scope:
            scope.cancel()
            await server.infer("m", {"X": row(1)})
        assert runner._alone_candidates == 0
        await server.infer("m", {"X": row(2)})
        stats = server.model_statistics("m")[0]
        assert_idle(server)
    assert calls == [1]
    assert tasks == [trio.lowlevel.current_task()]
    assert stats.inference_stats.fail.count + stats.inference_stats.success.count == 2


def slow(calls: list[int]) -> Any:
    """Synchronous, and 5 s pass on the mock clock while it runs."""

    def execute(X: Any) -> dict[str, Any]:
        calls.append(int(X.shape[0]))
        trio.lowlevel.current_clock().jump(5)
        return {"Y": X * 2}

    return execute


async def test_lone_request_late_result_is_discarded(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """`timeout`: "a synchronous execution that is running finishes, and its late result is
    discarded". A lone request running in its caller's task must not return it."""
    calls: list[int] = []
    m = batching(plain("m", slow(calls)))
    results: list[Any] = []
    async with orchestrion.open_server(models=[m]) as server:
        await outcome(server, results, "m", {"X": row(1)}, timeout=1)
        stats = server.model_statistics("m")[0]
        assert_idle(server)
    assert calls == [1]
    assert isinstance(results[0], orchestrion.protocols.InferenceTimeoutError), results[0]
    assert stats.inference_stats.fail.count == 1


async def test_batcher_late_result_is_discarded(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Same through the batcher (the last batch held 8: the lone request goes there).
    Also fails with count=2 (no batcher-runs-the-batch): the batcher path predates the
    change; the short path copies it instead of the ready_now path's final checkpoint."""
    calls: list[int] = []
    m = batching(plain("m", slow(calls)))
    results: list[Any] = []
    async with orchestrion.open_server(models=[m]) as server:
        async with trio.open_nursery() as nursery:
            for i in range(8):
                nursery.start_soon(server.infer, "m", {"X": row(i)})
        await outcome(server, results, "m", {"X": row(1)}, timeout=1)
        assert_idle(server)
    assert calls == [8, 1]
    assert isinstance(results[0], orchestrion.protocols.InferenceTimeoutError), results[0]


async def test_guard_an_error_alone_is_reported_and_counted_once() -> None:
    """(guard) execute raising on the short path: InferenceError naming the model, one
    execution, one failure, nothing pending; the next request still runs."""
    calls: list[int] = []

    def execute(X: Any) -> dict[str, Any]:
        calls.append(int(X.shape[0]))
        if float(X[0, 0]) < 0:
            raise ValueError("negative")
        return {"Y": X * 2}

    m = batching(plain("m", execute))
    results: list[Any] = []
    async with orchestrion.open_server(models=[m]) as server:
        await outcome(server, results, "m", {"X": row(-1)})
        await outcome(server, results, "m", {"X": row(1)})
        stats = server.model_statistics("m")[0]
        assert_idle(server)
    assert calls == [1, 1]
    assert isinstance(results[0], InferenceError)
    assert "'m'" in str(results[0])
    assert results[0].model_name == "m"
    assert (stats.inference_stats.fail.count, stats.inference_stats.success.count) == (1, 1)
    assert (stats.execution_count, stats.inference_count) == (2, 1)


async def test_a_cached_models_misses_take_the_same_short_paths() -> None:
    """The runner alone chooses how a request runs: a cached model's miss runs at once in
    the caller's task like an uncached request (a plain model on an idle inline instance, a
    batching one alone past its batcher); its hit runs nothing."""
    plain_calls: list[int] = []
    plain_tasks: list[object] = []
    batch_calls: list[int] = []
    batch_tasks: list[object] = []
    direct = cached(plain("p", recorder(plain_calls, plain_tasks)))
    batched = cached(batching(plain("b", recorder(batch_calls, batch_tasks))))
    async with orchestrion.open_server(
        models=[direct, batched], cache_config="local,size=1048576"
    ) as server:
        for name in ("p", "b", "p", "b"):
            response = await server.infer(name, {"X": row(3)})
            np.testing.assert_array_equal(response.outputs["Y"], row(3) * 2)
        hits = {s.name: s.inference_stats.cache_hit.count for s in server.model_statistics()}
        assert_idle(server)
    me = trio.lowlevel.current_task()
    assert (plain_calls, plain_tasks) == ([1], [me])
    assert (batch_calls, batch_tasks) == ([1], [me])
    assert hits == {"p": 1, "b": 1}
