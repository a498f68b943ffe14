"""The load lock: loads and unloads one at a time, except the calls a load makes itself
(from the worker thread of a model's ``initialize``, back into trio), which pass; other
tasks wait, those started during the hold too."""

from __future__ import annotations

import trio
import trio.testing

from orchestrion.actors import LoadLock
from orchestrion.actors._load_lock import passing_holds


async def test_a_holds_own_call_from_its_worker_thread_passes() -> None:
    lock = LoadLock()
    inner_ran = trio.Event()

    async def nested() -> str:
        async with lock.hold():  # would wait forever on a plain trio.Lock
            inner_ran.set()
            return "nested"

    def initialize() -> str:
        return trio.from_thread.run(nested)

    with trio.fail_after(10):
        async with lock.hold():
            assert await trio.to_thread.run_sync(passing_holds(initialize)) == "nested"
    assert inner_ran.is_set()


async def test_other_tasks_wait_and_a_task_started_in_a_hold_waits_once_it_ended() -> None:
    lock = LoadLock()
    order: list[str] = []

    async def other(name: str) -> None:
        async with lock.hold():
            order.append(name)

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery, lock.hold():
            nursery.start_soon(other, "started inside the hold")  # copies its context
            await trio.testing.wait_all_tasks_blocked()
            assert order == []  # a task of its own: it waits for the hold to end
            order.append("holder")
    assert order == ["holder", "started inside the hold"]
