"""`TrioBridge`, the crossing of the gRPC front end: a real asyncio loop in another thread
calls trio functions. Results and exceptions come back as themselves, cancellation crosses
both ways (an abandoned asyncio call cancels its trio task; a closed trio side answers
`ServerClosedError`), and the mailboxes batch their wake-ups without losing or reordering an
item. Each test bounds its wait (`trio.fail_after`, `asyncio.timeout`)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import pytest
import trio

from orchestrion.backends._asyncio_bridge import TrioBridge, _Mailbox, call_sync
from orchestrion.protocols import ServerClosedError

LIMIT = 30.0
"""Seconds any one test may wait for the other loop."""


@contextlib.asynccontextmanager
async def bridged() -> AsyncIterator[TrioBridge]:
    """A bridge whose calls run in a nursery of this trio run, open for the block."""
    with trio.fail_after(LIMIT):
        async with trio.open_nursery() as nursery:
            yield TrioBridge(trio.lowlevel.current_trio_token(), nursery)


async def on_asyncio(main: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
    """``asyncio.run(main())`` in a worker thread (as gRPC's loop runs); what it returns."""

    def run() -> Any:
        async def bounded() -> Any:
            async with asyncio.timeout(LIMIT):
                return await main()

        return asyncio.run(bounded())

    return await trio.to_thread.run_sync(run, abandon_on_cancel=True)


async def test_results_come_back_as_the_same_objects() -> None:
    """A call returns the trio function's own result object; the function runs on the trio
    thread, the caller on the asyncio one."""
    trio_thread = threading.get_ident()
    payload = [1, 2, 3]

    async def add(a: int, b: int) -> tuple[int, int, list[int]]:
        await trio.lowlevel.checkpoint()
        return a + b, threading.get_ident(), payload

    async with bridged() as bridge:

        async def main() -> tuple[Any, int]:
            return await bridge.call(add, 2, 3), threading.get_ident()

        (total, ran_on, returned), caller = await on_asyncio(main)
    assert total == 5
    assert ran_on == trio_thread
    assert caller != trio_thread
    assert returned is payload


async def test_exceptions_come_back_as_themselves() -> None:
    """An exception raised by the trio function is raised to the asyncio caller, the same
    object, its type and message intact."""

    class Refused(Exception):
        pass

    raised = Refused("no")

    async def fail() -> None:
        await trio.lowlevel.checkpoint()
        raise raised

    async with bridged() as bridge:

        async def main() -> BaseException | None:
            try:
                await bridge.call(fail)
            except Refused as exc:
                return exc
            return None

        caught = await on_asyncio(main)
    assert caught is raised


async def test_many_calls_in_flight_each_get_their_own_answer() -> None:
    """500 concurrent calls, finishing in another order than they started: each caller gets
    its own result."""

    async def echo(value: int) -> int:
        for _ in range(value % 7):
            await trio.lowlevel.checkpoint()
        return value

    async with bridged() as bridge:

        async def main() -> list[int]:
            return list(await asyncio.gather(*(bridge.call(echo, i) for i in range(500))))

        results = await on_asyncio(main)
    assert results == list(range(500))


async def test_two_asyncio_loops_share_one_bridge() -> None:
    """Two asyncio loops in two threads call through one bridge at once; each gets its own
    answers (each loop has its own mailbox)."""

    async def tag(loop: int, value: int) -> tuple[int, int]:
        await trio.lowlevel.checkpoint()
        return loop, value

    async with bridged() as bridge:
        answers: dict[int, list[tuple[int, int]]] = {}

        async def loop(number: int) -> None:
            async def main() -> list[tuple[int, int]]:
                return list(
                    await asyncio.gather(*(bridge.call(tag, number, i) for i in range(200)))
                )

            answers[number] = await on_asyncio(main)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(loop, 0)
            nursery.start_soon(loop, 1)
    assert answers == {n: [(n, i) for i in range(200)] for n in (0, 1)}


async def test_run_soon_runs_on_the_trio_thread_in_order() -> None:
    """`TrioBridge.run_soon` runs each function on the trio thread, in the order posted, and
    before a call posted after them."""
    trio_thread = threading.get_ident()
    ran: list[tuple[int, int]] = []

    async def noop() -> None:
        await trio.lowlevel.checkpoint()

    async with bridged() as bridge:

        async def main() -> None:
            for i in range(100):
                bridge.run_soon(lambda i=i: ran.append((i, threading.get_ident())))
            await bridge.call(noop)

        await on_asyncio(main)
    assert ran == [(i, trio_thread) for i in range(100)]


async def test_call_sync_runs_a_plain_function_on_the_trio_thread() -> None:
    """``call(call_sync, fn, *args)``: ``fn(*args)`` on the trio thread, its result back."""
    trio_thread = threading.get_ident()

    async with bridged() as bridge:

        async def main() -> tuple[int, int]:
            return await bridge.call(call_sync, lambda x: (x * 2, threading.get_ident()), 21)

        doubled, ran_on = await on_asyncio(main)
    assert (doubled, ran_on) == (42, trio_thread)


# -- cancellation, both ways -----------------------------------------------------------------


async def test_cancelling_the_asyncio_caller_cancels_the_trio_task() -> None:
    """An asyncio caller cancelled while its trio task runs: the task is cancelled (its
    ``finally`` sees `trio.Cancelled`), and the caller gets `asyncio.CancelledError`."""
    started, finished = trio.Event(), trio.Event()
    seen: list[str] = []

    async def forever() -> None:
        started.set()
        try:
            await trio.sleep_forever()
        except trio.Cancelled:
            seen.append("cancelled")
            raise
        finally:
            finished.set()

    async with bridged() as bridge:

        async def main() -> bool:
            task = asyncio.ensure_future(bridge.call(forever))
            await bridge.call(started.wait)
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
            else:
                return False
            await bridge.call(finished.wait)
            return True

        caller_cancelled = await on_asyncio(main)
    assert caller_cancelled
    assert seen == ["cancelled"]


async def test_a_call_abandoned_before_trio_starts_it_never_gets_past_a_checkpoint() -> None:
    """A call and its cancellation reach trio in one batch (the trio thread was held while
    both were posted): its task starts already cancelled, so the function stops at its first
    checkpoint."""
    holding, release = threading.Event(), threading.Event()
    reached: list[str] = []
    finished = trio.Event()

    def hold() -> None:  # runs on the trio thread: nothing on trio moves meanwhile
        holding.set()
        release.wait(LIMIT)

    async def work() -> None:
        reached.append("entered")
        try:
            await trio.lowlevel.checkpoint()
            reached.append("past the checkpoint")
        finally:
            finished.set()

    async with bridged() as bridge:

        async def main() -> bool:
            loop = asyncio.get_running_loop()
            bridge.run_soon(hold)
            assert await loop.run_in_executor(None, holding.wait, LIMIT)
            task = asyncio.ensure_future(bridge.call(work))
            await asyncio.sleep(0)  # the call is posted
            task.cancel()
            await asyncio.wait([task])  # its cancellation is posted
            release.set()
            await bridge.call(finished.wait)
            return task.cancelled()

        caller_cancelled = await on_asyncio(main)
    assert caller_cancelled
    assert reached == ["entered"]


async def test_closing_the_trio_side_answers_calls_in_flight_with_server_closed() -> None:
    """The bridge's nursery cancelled while a call runs (the front end closing): the asyncio
    caller gets `ServerClosedError`, and a call made after the nursery closed gets it too."""
    started = trio.Event()
    closed = threading.Event()
    outcome: list[BaseException] = []

    async def forever() -> None:
        started.set()
        await trio.sleep_forever()

    with trio.fail_after(LIMIT):
        async with trio.open_nursery() as outer:
            async with trio.open_nursery() as calls:
                bridge = TrioBridge(trio.lowlevel.current_trio_token(), calls)

                async def main() -> None:
                    try:
                        await bridge.call(forever)
                    except ServerClosedError as exc:
                        outcome.append(exc)
                    loop = asyncio.get_running_loop()
                    assert await loop.run_in_executor(None, closed.wait, LIMIT)
                    try:
                        await bridge.call(forever)
                    except ServerClosedError as exc:
                        outcome.append(exc)

                outer.start_soon(on_asyncio, main)
                await started.wait()
                calls.cancel_scope.cancel()
            closed.set()
    assert len(outcome) == 2
    assert all("shutting down" in str(exc) for exc in outcome)


def test_a_call_after_trio_has_finished_is_server_closed() -> None:
    """Once the trio run has finished, a call raises `ServerClosedError` at once and
    `TrioBridge.run_soon` does nothing."""
    bridges: list[TrioBridge] = []

    async def trio_main() -> None:
        async with trio.open_nursery() as nursery:
            bridges.append(TrioBridge(trio.lowlevel.current_trio_token(), nursery))

    trio.run(trio_main)
    ran: list[int] = []

    async def asyncio_main() -> None:
        async with asyncio.timeout(LIMIT):
            with pytest.raises(ServerClosedError, match="shutting down"):
                await bridges[0].call(trio.lowlevel.checkpoint)
            bridges[0].run_soon(lambda: ran.append(1))

    asyncio.run(asyncio_main())
    assert ran == []


# -- the mailbox -------------------------------------------------------------------------------


def test_a_mailbox_wakes_its_loop_once_per_batch_in_order() -> None:
    """`_Mailbox`: items posted before the other loop drains share one wake-up and are
    handled in order; an item posted after a drain schedules a new one; a wake that fails
    raises to the poster and does not leave the mailbox stuck."""
    wakes: list[Callable[[], None]] = []
    handled: list[int] = []
    mailbox = _Mailbox(wakes.append, handled.append)
    for i in range(3):
        mailbox.post(i)
    assert len(wakes) == 1
    wakes.pop()()
    assert handled == [0, 1, 2]
    mailbox.post(3)
    assert len(wakes) == 1
    wakes.pop()()
    assert handled == [0, 1, 2, 3]

    def closed(callback: Callable[[], None]) -> None:
        raise RuntimeError("the loop is closed")

    failing = _Mailbox(closed, handled.append)
    with pytest.raises(RuntimeError, match="closed"):
        failing.post(4)
    failing.wake = wakes.append
    failing.post(5)
    assert len(wakes) == 1
    wakes.pop()()
    assert handled == [0, 1, 2, 3, 4, 5]  # the item whose wake failed went with the next batch
