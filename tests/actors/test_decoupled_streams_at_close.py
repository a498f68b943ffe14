"""Decoupled streams when the server closes, when consumers leave, and how they are counted."""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import pytest
import trio
import trio.testing
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

import orchestrion
from orchestrion.protocols import InferenceError
from orchestrion.testing import decoupled
from support.decoupled import arepeat, repeat, single


class Boom(Exception):
    """The caller's block failing."""


async def drain(server: orchestrion.AsyncServer) -> None:
    async with contextlib.aclosing(server.stream_infer("f", {"X": single(1)})) as responses:
        async for _ in responses:
            pass


async def test_server_error_mid_stream_is_not_a_clean_end(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A stream cut short by the server stopping on an error must not look complete."""
    outcome: list[Any] = []

    async def consume(server: orchestrion.AsyncServer) -> None:
        got = []
        try:
            with trio.fail_after(100):
                async with contextlib.aclosing(
                    server.stream_infer("rep", {"X": single(10)})
                ) as responses:
                    async for r in responses:
                        got.append(float(r.outputs["Y"][0]))
                        await trio.sleep(1)  # a slow consumer
            outcome.append(("ended", got))
        except BaseException as exc:
            outcome.append((type(exc).__name__, got))

    async with trio.open_nursery() as outer:
        with contextlib.suppress(Boom):
            async with orchestrion.open_server(models=[decoupled("rep", arepeat)]) as server:
                outer.start_soon(consume, server)
                await trio.sleep(2.5)  # a few responses taken
                raise Boom
    name, got = outcome[0]
    assert len(got) < 10
    assert name != "ended", f"a truncated stream ({got}) ended as if complete"


async def test_server_error_with_a_stream_queued_behind_a_busy_instance(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A stream still queued when the server stops on an error is answered, not left waiting."""
    outcome: list[str] = []

    async def consume(server: orchestrion.AsyncServer, v: float, slow: bool) -> None:
        try:
            with trio.fail_after(100):
                async with contextlib.aclosing(
                    server.stream_infer("rep", {"X": single(v)})
                ) as responses:
                    async for _ in responses:
                        if slow:
                            await trio.sleep(1)
            outcome.append("ended")
        except trio.TooSlowError:
            outcome.append("hung")
        except BaseException as exc:
            outcome.append(type(exc).__name__)

    async with trio.open_nursery() as outer:
        with contextlib.suppress(Boom):
            async with orchestrion.open_server(models=[decoupled("rep", arepeat)]) as server:
                outer.start_soon(consume, server, 10, True)  # holds the only instance
                await trio.testing.wait_all_tasks_blocked()
                outer.start_soon(consume, server, 2, False)  # queued behind it
                await trio.testing.wait_all_tasks_blocked()
                raise Boom
    assert "hung" not in outcome, outcome


async def test_a_stream_abandoned_while_waiting_for_a_slot_is_not_an_execution(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A stream whose caller left while every compute slot was busy never ran: no execution;
    a stream waiting on its reader holds no slot (a second stream then runs at once)."""

    async def slow_steps(X: Any) -> Any:
        for i in range(int(X[0])):
            await trio.sleep(10)  # computing: holds the model's only compute slot
            yield {"Y": X * i}

    async with orchestrion.open_server(models=[decoupled("rep", slow_steps)]) as server:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(drain_model, server, "rep", 2)  # computes for 10 s per step
            await trio.sleep(1)
            with trio.move_on_after(1):  # waits for the slot, then gives up
                await drain_model(server, "rep", 1)
        await trio.testing.wait_all_tasks_blocked()
        stats = server.model_statistics("rep")[0]
    assert stats.pending_request_count == 0
    assert stats.failures_by_reason == {"CANCELED": 1}
    assert stats.inference_stats.success.count == 1
    assert stats.execution_count == 1, "the abandoned, never-run stream counted as executed"


async def drain_model(server: orchestrion.AsyncServer, name: str, v: float) -> None:
    async with contextlib.aclosing(server.stream_infer(name, {"X": single(v)})) as responses:
        async for _ in responses:
            pass


async def test_a_failed_stream_has_a_failed_compute_span() -> None:
    """A generator that raised gets an ERROR compute span, like a failed execute."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))

    def fails(X: Any) -> Any:
        yield {"Y": X}
        raise RuntimeError("broke")

    async with orchestrion.open_server(models=[decoupled("f", fails)], tracing=provider) as server:
        with pytest.raises(InferenceError):
            await drain(server)
    provider.shutdown()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"InferRequest", "compute"}, set(spans)
    assert spans["InferRequest"].status.status_code is StatusCode.ERROR
    assert spans["compute"].status.status_code is StatusCode.ERROR


async def test_closing_with_an_unfinished_stream_held_by_the_caller(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Leaving the server's block normally while holding a started stream does not hang."""
    closed = False
    with trio.CancelScope() as scope:
        async with orchestrion.open_server(models=[decoupled("rep", arepeat)]) as server:
            responses = server.stream_infer("rep", {"X": single(5)})
            await responses.__anext__()
            scope.deadline = trio.current_time() + 100
        closed = True
    with trio.CancelScope(shield=True):
        await responses.aclose()
    assert closed, "server close waits forever for a consumer that is not consuming"


def test_blocking_iterator_held_unfinished_at_close() -> None:
    """Leaving a Server's with block while an unfinished iterator is still referenced."""
    done = threading.Event()
    holder: dict[str, Any] = {}

    def run() -> None:
        with orchestrion.Server(models=[decoupled("rep", repeat)]) as server:
            holder["it"] = it = server.stream_infer("rep", {"X": single(5)})
            next(it)
        done.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    finished = done.wait(10)
    if not finished:
        holder["it"].close()  # unblocks the close
        done.wait(10)
    assert finished, "Server.__exit__ hangs while an unfinished stream iterator is alive"


def test_blocking_iterator_finalized_after_an_error_exit_is_quiet() -> None:
    """An unfinished iterator dropped after the Server left by an error raises nothing."""
    import gc
    import sys

    seen: list[Any] = []
    old = sys.unraisablehook
    sys.unraisablehook = seen.append
    try:
        with (
            contextlib.suppress(Boom),
            orchestrion.Server(models=[decoupled("rep", repeat)]) as server,
        ):
            it = server.stream_infer("rep", {"X": single(5)})
            next(it)
            raise Boom
        del it
        gc.collect()
    finally:
        sys.unraisablehook = old
    assert not seen, [f"{u.exc_type.__name__}: {u.exc_value}" for u in seen]
