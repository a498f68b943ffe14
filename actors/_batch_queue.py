"""Dynamic batching's queue: the requests a model with ``dynamic_batching`` holds, and how
batches form from them.

How this works: `ModelRunner.infer` still puts one work item per request on the model's
channel; with dynamic batching the batcher actor (`orchestrion.actors._batcher`) reads that
channel into a `BatchQueue` (a priority heap) and hands whole batches to the instance
actors. A batch holds requests whose inputs agree on everything but the batch dimension, in
priority order (then arrival order), up to ``max_batch_size`` rows, preferring the largest
``preferred_batch_size`` that the queue can fill. The batcher waits at most
``max_queue_delay_microseconds`` for a batch to fill; while every instance is busy, requests
simply pile up and the next batch takes them all. A jitted model's batch is padded to one
of a few sizes (powers of two, the preferred sizes and ``max_batch_size``), all compiled
before the model is ready, so load never triggers a compilation.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Generic, Protocol, TypeVar

import attrs
import trio

from ..protocols import (
    InferRequest,
    ModelConfig,
    QueueFullError,
    QueuePolicy,
    QueueTimeoutError,
    Tensors,
)


def rows_of(request: InferRequest) -> int:
    """The batch size of a request (the leading dimension of its inputs)."""
    for array in request.inputs.values():
        return int(array.shape[0]) if array.ndim else 1
    return 1


def shape_key(request: InferRequest) -> tuple[Any, ...]:
    """What must agree for two requests to share a batch: names, dtypes, per-item shapes."""
    inputs = request.inputs
    items = inputs.items() if len(inputs) < 2 else sorted(inputs.items())
    return tuple((name, array.dtype, array.shape[1:]) for name, array in items)


@attrs.define(eq=False)
class _Entry:
    work: Any  # the runner's _Work (kept opaque here)
    level: int
    order: int
    """Arrival order (ties within a level; kept when an entry goes back to the queue)."""
    rows: int
    key: tuple[Any, ...]
    arrived: float
    """``trio.current_time()`` at arrival: ``max_queue_delay_microseconds`` counts from it."""


@attrs.define(eq=False)
class BatchQueue:
    """The requests a batching model has accepted and not yet started.

    Every admitted work item is *counted* against its priority level (what
    ``max_queue_size`` bounds) until an instance starts it, it expires, or its requester
    gives up (`withdraw`): each path uncounts it exactly once.
    """

    config: ModelConfig
    _heap: list[tuple[int, int, _Entry]] = attrs.field(factory=list)
    _count: itertools.count[int] = attrs.field(factory=itertools.count)
    _per_level: dict[int, int] = attrs.field(factory=dict)
    # Per-level settings, resolved once: these are consulted for every request.
    _levels: int = attrs.field(init=False)
    _default_level: int = attrs.field(init=False)
    _limits: dict[int, int] = attrs.field(init=False, factory=dict)
    _timeouts_ns: dict[int, int] = attrs.field(init=False, factory=dict)

    def __attrs_post_init__(self) -> None:
        batching = self.config.dynamic_batching
        assert batching is not None
        self._levels = batching.priority_levels
        self._default_level = batching.default_priority_level if self._levels else 1
        for level in range(1, max(self._levels, 1) + 1):
            policy = self.policy(level)
            if policy is None:
                continue
            if policy.max_queue_size > 0:
                self._limits[level] = policy.max_queue_size
            if policy.default_timeout_microseconds > 0 and policy.timeout_action == "REJECT":
                self._timeouts_ns[level] = policy.default_timeout_microseconds * 1000

    @property
    def max_rows(self) -> int:
        """The most rows one batch may hold."""
        return self.config.max_batch_size

    def level(self, request: InferRequest) -> int:
        """The request's priority level (1 is the highest; 0 asks for the default)."""
        if not self._levels:
            return 1
        if 1 <= request.options.priority <= self._levels:
            return request.options.priority
        return self._default_level

    def policy(self, level: int) -> QueuePolicy | None:
        """The queue policy of a priority level."""
        batching = self.config.dynamic_batching
        assert batching is not None
        return batching.priority_queue_policy.get(str(level), batching.default_queue_policy)

    def admit(self, work: Any) -> None:
        """Count a work item in for its priority level, or refuse it when the level is full.

        Raises:
            QueueFullError: ``max_queue_size`` requests of that level are already waiting.
        """
        level = self.level(work.request)
        waiting = self._per_level.get(level, 0)
        limit = self._limits.get(level)
        if limit is not None and waiting >= limit:
            raise QueueFullError(
                f"Exceeds maximum queue size: model '{self.config.name}' has "
                f"{limit} requests waiting (max_queue_size)"
            )
        self._per_level[level] = waiting + 1
        work.level = level
        work.counted = True

    def withdraw(self, work: Any) -> None:
        """Uncount a work item that will not start (refused, abandoned, expired, drained)."""
        if work.counted:
            work.counted = False
            self._per_level[work.level] -= 1

    def started(self, works: Iterable[Any]) -> None:
        """An instance has taken these requests: they no longer wait."""
        for work in works:
            self.withdraw(work)

    def push(self, work: Any) -> None:
        """Queue an admitted work item (its ``request``), in priority then arrival order."""
        request: InferRequest = work.request
        entry = _Entry(
            work=work,
            level=work.level,
            order=next(self._count),
            rows=rows_of(request),
            key=shape_key(request),
            arrived=trio.current_time(),
        )
        self._push(entry)

    def _push(self, entry: _Entry) -> None:
        heapq.heappush(self._heap, (entry.level, entry.order, entry))

    def push_back(self, works: Sequence[Any]) -> None:
        """Return taken (still counted) work items to the queue, ahead of later arrivals."""
        for work in works:
            self.push(work)

    def __len__(self) -> int:
        return len(self._heap)

    def oldest_arrival(self) -> float | None:
        """When the longest-waiting queued request arrived (None: the queue is empty)."""
        return min((e.arrived for _, _, e in self._heap), default=None)

    def full(self) -> bool:
        """Whether the head's batch cannot grow (no point in waiting for more)."""
        if not self._heap:
            return False
        head = self._heap[0][2]
        rows = sum(e.rows for _, _, e in self._heap if e.key == head.key)
        batching = self.config.dynamic_batching
        preferred = batching.preferred_batch_size if batching is not None else ()
        return rows >= self.max_rows or (bool(preferred) and rows in preferred)

    def take(self, expired: list[Any]) -> list[Any]:
        """The next batch: work items that share the head's shapes, up to ``max_rows``.

        Abandoned work is dropped; work past its queue policy's timeout (``REJECT``) is
        appended to ``expired`` with its error set. The batch's requests still count as
        waiting until `started`.
        """
        batch: list[_Entry] = []
        rows = 0
        keep: list[_Entry] = []
        key = None
        while self._heap:
            entry = heapq.heappop(self._heap)[2]
            if entry.work.abandoned:
                self.withdraw(entry.work)
                continue
            if self.overdue(entry.work):
                self.withdraw(entry.work)
                self.expire(entry.work, self.config.name)
                expired.append(entry.work)
                continue
            if key is None:
                key = entry.key
            if entry.key != key or rows + entry.rows > self.max_rows:
                keep.append(entry)
                if rows >= self.max_rows:
                    break
                continue
            batch.append(entry)
            rows += entry.rows
        for entry in keep:
            self._push(entry)
        return [e.work for e in self._trim(batch)]

    def _trim(self, batch: list[_Entry]) -> list[_Entry]:
        """Cut the batch, in order, to the longest prefix whose size is a preferred batch
        size; with no such prefix the whole batch runs. Cut entries keep their place."""
        batching = self.config.dynamic_batching
        preferred = set(batching.preferred_batch_size) if batching is not None else set()
        if not preferred:
            return batch
        cut = len(batch)
        rows = 0
        best = None
        for index, entry in enumerate(batch):
            rows += entry.rows
            if rows in preferred:
                best = index + 1
        if best is not None:
            cut = best
        for entry in batch[cut:]:
            self._push(entry)
        return batch[:cut]

    def overdue(self, work: Any) -> bool:
        """Whether ``work`` has waited past its level's queue-policy timeout (``REJECT``)."""
        if not self._timeouts_ns:
            return False
        limit = self._timeouts_ns.get(work.level)
        if limit is None:
            return False
        waited_ns: int = time.perf_counter_ns() - work.enqueued_ns
        return waited_ns > limit

    @staticmethod
    def expire(work: Any, model_name: str) -> None:
        """Fail ``work`` for waiting too long."""
        work.error = QueueTimeoutError(
            f"request for model '{model_name}' timed out in the queue "
            "(dynamic_batching queue policy)"
        )

    def drain(self) -> Iterable[Any]:
        """Every work item still queued (the server is stopping), uncounted."""
        while self._heap:
            work = heapq.heappop(self._heap)[2].work
            self.withdraw(work)
            yield work


def batch_size(max_batch_size: int, inputs: Tensors) -> int:
    """The number of inferences in a request: its batch size, or 1 without batching."""
    if max_batch_size <= 0 or not inputs:
        return 1
    return int(next(iter(inputs.values())).shape[0])


class Gathered(Protocol):
    """A request gathered into a batched fused call: its inputs and their rows, whether
    its pass has run (`done`), and whether its caller went away before (`abandoned`)."""

    @property
    def inputs(self) -> Tensors: ...

    @property
    def rows(self) -> int: ...

    @property
    def done(self) -> trio.Event: ...

    abandoned: bool


W = TypeVar("W", bound=Gathered)


def gathered_batches(taken: list[W], max_batch: int, max_requests: int) -> list[list[W]]:
    """Requests that agree on names, dtypes and per-row shapes, at most ``max_batch`` rows
    (and at most ``max_requests`` requests, 0: any number) each, in their order."""
    groups: dict[tuple[Any, ...], list[list[W]]] = {}
    for waiting in taken:
        key = tuple(sorted((n, v.dtype.str, v.shape[1:]) for n, v in waiting.inputs.items()))
        chunks = groups.setdefault(key, [[]])
        full = max_requests and len(chunks[-1]) >= max_requests
        if full or sum(w.rows for w in chunks[-1]) + waiting.rows > max_batch:
            chunks.append([])
        chunks[-1].append(waiting)
    return [chunk for chunks in groups.values() for chunk in chunks]


@attrs.define(eq=False)
class OnePass(Generic[W]):
    """Gathers the requests that arrive in one scheduling pass, to run them together (as a
    batcher with no queue delay would)."""

    _waiting: list[W] = attrs.field(factory=list)
    _collecting: bool = False

    @property
    def collecting(self) -> bool:
        """A request is letting the others of its pass arrive (tests look)."""
        return self._collecting

    @property
    def waiting(self) -> int:
        """Requests that joined the pass being gathered (tests look)."""
        return len(self._waiting)

    async def join(self, me: W, run: Callable[[list[W]], None]) -> None:
        """Add ``me`` to this pass, and return once the pass has run: ``run`` gets the
        requests of the pass whose callers still wait, and gives each a result or leaves
        it to take another path.

        The first request to arrive collects: it lets the others of the pass arrive (one
        checkpoint, shielded so that those waiting on it are never left behind), then calls
        ``run``, also when it is cancelled itself meanwhile (it then drops out). A request
        cancelled while it waits drops out; one past its deadline never joins.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        self._waiting.append(me)
        if self._collecting:
            try:
                await me.done.wait()
            except BaseException:
                me.abandoned = True
                raise
            return
        self._collecting = True
        try:
            with trio.CancelScope(shield=True):
                await trio.lowlevel.checkpoint()
        finally:
            self._collecting = False
        taken, self._waiting = self._waiting, []
        try:
            try:  # the collector's own cancellation (during the pass) drops it out too
                await trio.lowlevel.checkpoint_if_cancelled()
            except BaseException:
                me.abandoned = True
                raise
            finally:  # the others are served either way
                run([w for w in taken if not w.abandoned])
        finally:
            for waiting in taken:
                waiting.done.set()
