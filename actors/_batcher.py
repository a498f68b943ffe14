"""Dynamic batching: the queue of a model with ``dynamic_batching``, and how batches form.

How this works: `ModelRunner.infer` still puts one work item per request on the model's
channel; with dynamic batching a *batcher* actor reads that channel into a `BatchQueue` (a
priority heap) and hands whole batches to the instance actors. A batch holds requests whose
inputs agree on everything but the batch dimension, in priority order (then arrival order),
up to ``max_batch_size`` rows, preferring the largest ``preferred_batch_size`` that the
queue can fill. The batcher waits at most ``max_queue_delay_microseconds`` for a batch to
fill; while every instance is busy, requests simply pile up and the next batch takes them
all. A jitted model's batch is padded to one of a few sizes (powers of two, the preferred
sizes and ``max_batch_size``), all compiled before the model is ready, so load never
triggers a compilation.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Iterable, Sequence
from typing import Any

import attrs
import numpy as np

from ..protocols import (
    InferenceTimeoutError,
    InferRequest,
    ModelConfig,
    QueueFullError,
    QueuePolicy,
    Tensors,
)


def padded_sizes(config: ModelConfig) -> tuple[int, ...]:
    """The batch sizes a jitted batching model is compiled for (ascending)."""
    top = config.max_batch_size
    sizes = {top}
    size = 1
    while size < top:
        sizes.add(size)
        size *= 2
    if config.dynamic_batching is not None:
        sizes.update(s for s in config.dynamic_batching.preferred_batch_size if s <= top)
    return tuple(sorted(sizes))


def rows_of(request: InferRequest) -> int:
    """The batch size of a request (the leading dimension of its inputs)."""
    for array in request.inputs.values():
        return int(array.shape[0]) if array.ndim else 1
    return 1


def shape_key(request: InferRequest) -> tuple[Any, ...]:
    """What must agree for two requests to share a batch: names, dtypes, per-item shapes."""
    return tuple(
        (name, array.dtype.str, array.shape[1:]) for name, array in sorted(request.inputs.items())
    )


@attrs.define(eq=False)
class _Entry:
    work: Any  # the runner's _Work (kept opaque here)
    level: int
    rows: int
    key: tuple[Any, ...]
    enqueued: float
    """``time.monotonic()`` at arrival (queue-policy timeouts)."""


@attrs.define(eq=False)
class BatchQueue:
    """The requests a batching model has accepted and not yet started."""

    config: ModelConfig
    _heap: list[tuple[int, int, _Entry]] = attrs.field(factory=list)
    _count: itertools.count[int] = attrs.field(factory=itertools.count)
    _per_level: dict[int, int] = attrs.field(factory=dict)

    @property
    def max_rows(self) -> int:
        """The most rows one batch may hold."""
        return self.config.max_batch_size

    def level(self, request: InferRequest) -> int:
        """The request's priority level (1 is the highest; 0 asks for the default)."""
        batching = self.config.dynamic_batching
        assert batching is not None
        if not batching.priority_levels:
            return 1
        if 1 <= request.priority <= batching.priority_levels:
            return request.priority
        return batching.default_priority_level

    def policy(self, level: int) -> QueuePolicy | None:
        """The queue policy of a priority level."""
        batching = self.config.dynamic_batching
        assert batching is not None
        return batching.priority_queue_policy.get(str(level), batching.default_queue_policy)

    def admit(self, request: InferRequest) -> None:
        """Count a request in for its priority level, or refuse it when the level is full.

        Every admitted request is counted until `take` or `drain` hands it out.

        Raises:
            QueueFullError: ``max_queue_size`` requests of that level are already waiting.
        """
        level = self.level(request)
        policy = self.policy(level)
        waiting = self._per_level.get(level, 0)
        if policy is not None and 0 < policy.max_queue_size <= waiting:
            raise QueueFullError(
                f"Exceeds maximum queue size: model '{self.config.name}' has "
                f"{policy.max_queue_size} requests waiting (max_queue_size)"
            )
        self._per_level[level] = waiting + 1

    def withdraw(self, request: InferRequest) -> None:
        """Undo `admit` for a request that never reached the queue."""
        self._per_level[self.level(request)] -= 1

    def push(self, work: Any) -> None:
        """Queue an admitted work item (its ``request``), in priority then arrival order."""
        request: InferRequest = work.request
        level = self.level(request)
        entry = _Entry(
            work=work,
            level=level,
            rows=rows_of(request),
            key=shape_key(request),
            enqueued=time.monotonic(),
        )
        heapq.heappush(self._heap, (level, next(self._count), entry))

    def push_back(self, work: Any) -> None:
        """Return a taken (still counted) work item to the queue."""
        self.push(work)

    def __len__(self) -> int:
        return len(self._heap)

    def waiting(self, level: int) -> int:
        """Requests of ``level`` in the queue (what ``max_queue_size`` bounds)."""
        return self._per_level.get(level, 0)

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
        waiting until `started` says an instance has them.
        """
        batch: list[_Entry] = []
        rows = 0
        keep: list[tuple[int, int, _Entry]] = []
        key = None
        now = time.monotonic()
        while self._heap:
            item = heapq.heappop(self._heap)
            entry = item[2]
            if entry.work.abandoned:
                self._per_level[entry.level] -= 1
                continue
            if self._expired(entry, now):
                self._per_level[entry.level] -= 1
                self.expire(entry.work, self.config.name)
                expired.append(entry.work)
                continue
            if key is None:
                key = entry.key
            if entry.key != key or rows + entry.rows > self.max_rows:
                keep.append(item)
                if rows >= self.max_rows:
                    break
                continue
            batch.append(entry)
            rows += entry.rows
        for item in keep:
            heapq.heappush(self._heap, item)
        return [e.work for e in self._trim(batch)]

    def started(self, works: Iterable[Any]) -> None:
        """An instance has taken these requests: they no longer wait."""
        for work in works:
            self._per_level[self.level(work.request)] -= 1

    def _trim(self, batch: list[_Entry]) -> list[_Entry]:
        """Cut the batch to the largest preferred size it can fill (the rest waits)."""
        batching = self.config.dynamic_batching
        preferred = sorted(batching.preferred_batch_size) if batching is not None else []
        total = sum(e.rows for e in batch)
        fitting = [p for p in preferred if p <= total]
        if not fitting or total in preferred:
            return batch
        target = fitting[-1]
        kept: list[_Entry] = []
        rows = 0
        for entry in batch:
            if rows + entry.rows > target:
                heapq.heappush(self._heap, (entry.level, next(self._count), entry))
            else:
                kept.append(entry)
                rows += entry.rows
        return kept

    def _expired(self, entry: _Entry, now: float) -> bool:
        return self.overdue(entry.work)

    def overdue(self, work: Any) -> bool:
        """Whether ``work`` has waited past its level's queue-policy timeout (``REJECT``)."""
        policy = self.policy(self.level(work.request))
        if policy is None or policy.default_timeout_microseconds <= 0:
            return False
        if policy.timeout_action != "REJECT":
            return False
        waited_ns: int = time.perf_counter_ns() - work.enqueued_ns
        return waited_ns > policy.default_timeout_microseconds * 1000

    @staticmethod
    def expire(work: Any, model_name: str) -> None:
        """Fail ``work`` for waiting too long."""
        work.error = InferenceTimeoutError(
            f"request for model '{model_name}' timed out in the queue "
            "(dynamic_batching queue policy)"
        )

    def drain(self) -> Iterable[Any]:
        """Every work item still queued (the server is stopping)."""
        while self._heap:
            entry = heapq.heappop(self._heap)[2]
            self._per_level[entry.level] -= 1
            yield entry.work


def join_inputs(requests: Sequence[InferRequest], padded: int) -> dict[str, np.ndarray[Any, Any]]:
    """The batched inputs: each input concatenated along the batch dimension, then padded
    with zero rows (for a jitted model, up to a compiled size)."""
    joined: dict[str, np.ndarray[Any, Any]] = {}
    for name in requests[0].inputs:
        parts = [r.inputs[name] for r in requests]
        array = np.concatenate(parts) if len(parts) > 1 else parts[0]
        missing = padded - array.shape[0]
        if missing > 0:
            filler = np.zeros((missing, *array.shape[1:]), dtype=array.dtype)
            if array.dtype.kind == "O":
                filler[...] = b""
            array = np.concatenate([array, filler])
        joined[name] = array
    return joined


def split_outputs(outputs: Tensors, rows: Sequence[int]) -> list[dict[str, Any]]:
    """Each request's rows of the batched outputs.

    Raises:
        ValueError: an output does not have one row per input row.
    """
    needed = sum(rows)
    for name, array in outputs.items():
        if array.ndim == 0 or array.shape[0] < needed:
            raise ValueError(
                f"output '{name}' has shape {list(array.shape)}: a batching model must return "
                f"one row per input row ({needed} or more)"
            )
    parts: list[dict[str, Any]] = []
    start = 0
    for count in rows:
        parts.append({name: array[start : start + count] for name, array in outputs.items()})
        start += count
    return parts
