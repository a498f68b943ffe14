"""The dynamic batcher: the actor that turns a batching model's queue into executions.

How this works: with ``dynamic_batching``, the model's channel is read by one batcher actor
(`Batcher.serve`) instead of the instances. It pushes what arrives into the model's
`BatchQueue` (``_batch_queue.py``), and each time an instance is free it forms a batch: it
waits at most ``max_queue_delay_microseconds`` (counted from the oldest request's arrival)
for the batch to fill, takes it out of the queue (priorities first, expired requests
answered), and hands it to the next free instance (`serve_instance`), which runs it as one
execution of the joined inputs, padded to a compiled size, and gives each request its rows
(a backend that takes lists of requests, `Capabilities.request_lists`, gets the batch's
requests as they are and answers each).
A batch forms only when an instance is free for it, so the queue (and its priorities)
decides what runs next. With one inline instance that is free, the batcher runs the batch
itself, saving a scheduling pass. ``preserve_ordering`` answers batches in the order they
formed.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import attrs
import trio

from ..backends import join_inputs, split_outputs
from ..protocols import ServerClosedError
from ._batch_queue import BatchQueue, rows_of
from ._instances import Instance, Work

if TYPE_CHECKING:
    from ._executor import Executor


@attrs.define(eq=False, slots=True)
class Batch:
    """Requests that run as one execution, and the batch's place in arrival order."""

    sequence: int
    works: list[Work]


@attrs.define(eq=False)
class Batcher:
    """One batching model's batcher and the instances' batch loops."""

    executor: Executor
    queue: BatchQueue
    sizes: tuple[int, ...]
    """Batch sizes a batch is padded to (all compiled at load); empty: as it is."""
    formed: int = 0
    """Batches formed so far (their sequence numbers)."""
    last_batch: int = 0
    """Requests in the last batch formed (the fast path is for light load)."""
    _released: int = 0
    """preserve_ordering: the next batch whose requests may be answered."""
    _held: dict[int, list[Work]] = attrs.field(factory=dict)
    """preserve_ordering: answered batches waiting for an earlier one, by sequence number."""

    async def serve(
        self,
        receive: trio.MemoryReceiveChannel[Work],
        instances: list[Instance],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Run the batcher and one batch loop per instance until the channel ends."""
        async with trio.open_nursery() as nursery:
            batch_send, batch_receive = trio.open_memory_channel[Batch](0)
            idle = trio.Semaphore(len(instances))
            async with batch_receive:
                for instance in instances:
                    await nursery.start(self.serve_instance, instance, batch_receive.clone(), idle)
            await nursery.start(self._form_batches, receive, batch_send, idle)
            task_status.started()

    async def _form_batches(
        self,
        receive: trio.MemoryReceiveChannel[Work],
        send: trio.MemorySendChannel[Batch],
        idle: trio.Semaphore,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Gather queued requests into batches and hand each to the next free instance."""
        queue = self.queue
        ended = False
        async with receive, send:
            task_status.started()
            try:
                while not ended or len(queue):
                    if not len(queue):
                        try:
                            queue.push(await receive.receive())
                        except trio.EndOfChannel:
                            break
                    await idle.acquire()  # released by the instance when the batch is done
                    ended = _drain_into(receive, queue) or ended  # priorities see all
                    ended = await self._fill(receive, ended)
                    expired: list[Work] = []
                    before = len(queue)
                    batch = queue.take(expired)
                    self.executor.queued -= before - len(queue)  # batched, expired or abandoned
                    for work in expired:
                        work.done.set()
                    if not batch:
                        idle.release()
                        continue
                    await self._hand_over(batch, send, idle)
            finally:
                # Stopped from outside: answer what is still queued, in the channel too (no
                # caller waits forever).
                with contextlib.suppress(trio.ClosedResourceError):
                    _drain_into(receive, queue)
                for work in queue.drain():
                    self.executor.queued -= 1
                    work.error = ServerClosedError("the server is shutting down")
                    work.done.set()

    async def _fill(self, receive: trio.MemoryReceiveChannel[Work], ended: bool) -> bool:
        """Wait for the batch to fill, up to the queue delay counted from the oldest
        request's arrival; True once the channel has ended."""
        queue = self.queue
        batching = self.executor.config.dynamic_batching
        assert batching is not None
        delay = batching.max_queue_delay_microseconds / 1e6
        oldest = queue.oldest_arrival()
        deadline = (oldest if oldest is not None else trio.current_time()) + delay
        while not ended and not queue.full():
            try:
                queue.push(receive.receive_nowait())
                continue
            except trio.WouldBlock:
                pass
            except trio.EndOfChannel:
                return True
            if trio.current_time() >= deadline:
                break
            with trio.move_on_at(deadline):
                try:
                    queue.push(await receive.receive())
                except trio.EndOfChannel:
                    ended = True
                continue
            break
        return ended

    async def _hand_over(
        self, batch: list[Work], send: trio.MemorySendChannel[Batch], idle: trio.Semaphore
    ) -> None:
        """Run ``batch`` here (one free inline instance) or send it to a free instance."""
        queue = self.queue
        self.formed += 1
        self.last_batch = len(batch)
        formed = Batch(self.formed - 1, batch)
        if self._runs_here():
            # One inline instance, and it is free: run the batch here rather than hand it
            # over, which would cost one more scheduling pass (about 10 µs per request;
            # bench/vs_triton/inprocess.py).
            queue.started(batch)
            try:
                await self.run(self.executor.instances[0], formed)
            finally:
                idle.release()
            return
        # Waits for a free instance; arrivals meanwhile queue for the next.
        try:
            await send.send(formed)
        except BaseException:
            # Not started: back in the queue, answered with the rest by the caller.
            queue.push_back(batch)
            self.executor.queued += len(batch)
            raise
        queue.started(batch)

    def _runs_here(self) -> bool:
        """Whether the batcher runs its batch itself: a single instance that runs inline
        (short synchronous work) and is free. Nothing else could run the batch sooner."""
        instances = self.executor.instances
        if self.executor.capabilities.is_async or len(instances) != 1:
            return False
        return instances[0].inline and not instances[0].busy

    async def serve_instance(
        self,
        instance: Instance,
        receive: trio.MemoryReceiveChannel[Batch],
        idle: trio.Semaphore,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """One instance's loop: run each batch handed to it."""
        async with receive:
            task_status.started()
            try:
                async for batch in receive:
                    try:
                        await self.run(instance, batch)
                    finally:
                        idle.release()
            finally:
                while True:
                    try:
                        batch = receive.receive_nowait()
                    except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                        break
                    for work in batch.works:
                        work.error = ServerClosedError("the server is shutting down")
                    self._answer(batch.sequence, batch.works)

    async def run(self, instance: Instance, batch: Batch) -> None:
        """Run a batch as one execution and give each request its rows of the outputs."""
        queue = self.queue
        works = []
        for work in batch.works:
            if work.abandoned:
                continue
            if queue.overdue(work):  # it waited for this instance past its queue policy
                queue.expire(work, self.executor.model.name)
                work.done.set()
                continue
            works.append(work)
        if not works:
            self._answer(batch.sequence, [])
            return
        if self.executor.capabilities.request_lists:  # the model answers each request itself
            try:
                await self.executor.run_listed(instance, works)
            finally:
                self._answer(batch.sequence, works)
            return
        rows = [rows_of(w.request) for w in works]
        total = sum(rows)
        padded = next((size for size in self.sizes if size >= total), total)
        first = works[0].request
        joined = first.derive(
            model_name=first.model_name,
            model_version=first.model_version,
            inputs=join_inputs([w.request for w in works], padded),
            requested_outputs=None,
        )
        combined = Work(request=joined, enqueued_ns=min(w.enqueued_ns for w in works))
        try:
            await self.executor.run_work(instance, combined, inferences=total, members=works)
        finally:
            self._deliver(works, rows, combined)
            self._answer(batch.sequence, works)

    def _answer(self, sequence: int, works: list[Work]) -> None:
        """Wake the batch's requesters; with preserve_ordering, only once every earlier
        batch has been answered (a later batch that finished first waits)."""
        batching = self.executor.config.dynamic_batching
        if batching is None or not batching.preserve_ordering:
            for work in works:
                work.done.set()
            return
        self._held[sequence] = works
        while self._released in self._held:
            for work in self._held.pop(self._released):
                work.done.set()
            self._released += 1

    def _deliver(self, works: list[Work], rows: list[int], combined: Work) -> None:
        parts: list[dict[str, Any]] | None = None
        error = combined.error
        if error is None and combined.outputs is not None:
            try:
                parts = split_outputs(combined.outputs, rows)
            except ValueError as exc:
                error = self.executor.pool.bad_batch(exc)
        for index, work in enumerate(works):
            if parts is not None:
                work.outputs = parts[index]
            else:
                work.error = error or ServerClosedError("the server is shutting down")


def _drain_into(receive: trio.MemoryReceiveChannel[Work], queue: BatchQueue) -> bool:
    """Move every request waiting in the channel into the queue; True if it ended."""
    while True:
        try:
            queue.push(receive.receive_nowait())
        except trio.WouldBlock:
            return False
        except trio.EndOfChannel:
            return True
