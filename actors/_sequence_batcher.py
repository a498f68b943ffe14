"""Triton's sequence batcher: the requests of a stateful model's sequences, batched, with their
control inputs and implicit state filled in by the runtime.

How this works: sequences sit in slots of the instances, or wait in a backlog
(``_sequence_slots.py``); a sequence's requests queue in it, so that they run one at a time and
in the order they came. Each instance has a lane, an actor that turns the first requests of
its slots' sequences into one execution: with Direct, every slot up to the highest one with a
request ready, in slot order, the empty ones as copies of a ready request marked not ready
(READY false), so that a sequence always sits at its own row; with Oldest, the oldest requests
of its candidate sequences, up to ``max_batch_size`` rows. Either waits up to
``max_queue_delay_microseconds`` for a fuller batch (Direct: until ``minimum_slot_utilization``
of the slots are ready; Oldest: until a preferred batch size, or ``max_batch_size``). Before the
model runs, each request gets its control tensors (START, END, READY, CORRID) and its implicit
state (the state outputs of its sequence's previous request; on a start, the initial state);
afterwards the state outputs become the sequence's state (a failed request leaves it as it
was) and leave the response unless the config lists them. The END request's completion frees
the slot; so does ``max_sequence_idle_microseconds`` without a request. A backend that answers
each request of a batch itself (`Capabilities.request_lists`, Triton's python models) gets the
ready requests as a list, without not-ready rows.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np
import trio

from ..backends import join_inputs, split_outputs
from ..protocols import (
    InferRequest,
    InvalidRequestError,
    ModelConfig,
    SequenceTensors,
    ServerClosedError,
    Tensors,
    start_value,
)
from ._batch_queue import rows_of
from ._instances import Instance, Work
from ._sequence_slots import Lane, Sequence, SequenceSlots

if TYPE_CHECKING:
    from ._executor import Executor


@attrs.define(eq=False, slots=True)
class _Row:
    """One request of a batch: its sequence, its work, and the request as the model takes it
    (with its controls and state)."""

    sequence: Sequence
    work: Work
    request: InferRequest | None = None
    """None: it could not be prepared (``work.error`` says why)."""


@attrs.define(eq=False)
class SequenceBatcher:
    """A stateful model's sequence batcher (see the module docstring)."""

    executor: Executor
    tensors: SequenceTensors
    start_states: dict[str, Any]
    """Each state input's value at a sequence's start (with its batch dimension)."""
    idle_s: float
    """Seconds without a request after which a sequence loses its slot."""
    _slots: SequenceSlots | None = None
    _closing: bool = False
    _closed: trio.Event = attrs.field(factory=trio.Event)

    @classmethod
    def of(cls, executor: Executor, initial_data: dict[str, bytes]) -> SequenceBatcher:
        """The sequence batcher of ``executor``'s model; ``initial_data``: the bytes of each
        state's ``initial_state`` ``data_file`` (by state input name)."""
        config = executor.config
        assert config.sequence_batching is not None
        tensors = SequenceTensors.of(config)
        lead = (1,) if config.max_batch_size > 0 else ()
        start = {
            s.input_name: start_value(s, initial_data.get(s.input_name)).reshape(
                lead + s.start_shape()
            )
            for s in tensors.states
        }
        idle_us = config.sequence_batching.max_sequence_idle_microseconds
        return cls(executor, tensors, start, (idle_us or 1_000_000) / 1e6)  # Triton's: 1 s

    @property
    def _config(self) -> ModelConfig:
        return self.executor.config

    # -- requests --------------------------------------------------------------------------

    async def run(self, request: InferRequest) -> Work:
        """Queue ``request`` in its sequence and wait until it has run; its outputs are on
        the work.

        Raises:
            InvalidRequestError: no correlation id, a batch of more than one, no sequence
                of that id has started (Triton's words), or the model failed it.
            ServerClosedError: the model is being unloaded.
        """
        name = self._config.name
        if request.options.sequence_id in (0, ""):
            raise InvalidRequestError(
                f"inference request to model '{name}' must specify a non-zero or non-empty "
                "correlation ID (sequence_id): the model is stateful (sequence_batching)"
            )
        if self._config.max_batch_size > 0 and rows_of(request) != 1:
            raise InvalidRequestError(
                f"inference request to model '{name}' must specify batch-size 1 due to "
                "requirements of sequence batcher"
            )
        if self._closing or self._slots is None:
            raise ServerClosedError(f"model '{name}' is being unloaded")
        sequence = self._slots.admit(request)
        work = Work(request=request, enqueued_ns=time.perf_counter_ns())
        sequence.queue.append(work)
        sequence.last_used = trio.current_time()
        self.executor.queued += 1
        if sequence.slot is not None:
            sequence.slot.lane.poke()
        try:
            await work.done.wait()
        except BaseException:
            work.abandon()  # skipped when its turn comes (running: it finishes, unseen)
            raise
        if work.error is not None:
            raise work.error
        return work

    # -- the lanes -------------------------------------------------------------------------

    async def serve(
        self,
        instances: list[Instance],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Run one lane per instance, and the idle sweeper, until `close` and the queued
        requests have run."""
        per_instance = self.tensors.slots(self._config.max_batch_size)
        self._slots = slots = SequenceSlots.of(self._config.name, instances, per_instance)
        try:
            async with trio.open_nursery() as nursery:
                for lane in slots.lanes:
                    nursery.start_soon(self._run_lane, lane)
                nursery.start_soon(self._sweep, slots)
                task_status.started()
        finally:
            # Stopped from outside: answer what still waits, so that no caller waits forever.
            for sequence in slots.holders():
                while sequence.queue:
                    self._drop(
                        sequence.queue.popleft(), ServerClosedError("the server is shutting down")
                    )

    def close(self) -> None:
        """Take no new requests; the lanes end once the queued ones have run."""
        self._closing = True
        self._closed.set()
        self._poke_all()

    def _poke_all(self) -> None:
        if self._slots is not None:
            for lane in self._slots.lanes:
                lane.poke()

    def _drained(self) -> bool:
        """Closing, and no request waits or runs."""
        assert self._slots is not None
        holders = self._slots.holders()
        return self._closing and not any(s.queue or s.running for s in holders)

    def _drop(self, work: Work, error: BaseException | None = None) -> None:
        """Answer a work that will not run (its caller left, or the server stops)."""
        self.executor.queued -= 1
        if error is not None:
            work.error = error
        work.done.set()

    async def _sweep(self, slots: SequenceSlots) -> None:
        """Release sequences idle past ``max_sequence_idle_microseconds`` (until closing)."""
        while not self._closing:
            with trio.move_on_after(max(self.idle_s / 4, 0.01)):
                await self._closed.wait()
            slots.release_idle(trio.current_time(), self.idle_s)

    async def _run_lane(self, lane: Lane) -> None:
        """One instance's batch loop, until closing and drained."""
        while not self._drained():
            if not any(slot.ready() for slot in lane.slots):
                lane.wake = trio.Event()
                await lane.wake.wait()
                continue
            await self._fill(lane)
            rows = self._choose(lane)
            if any(row is not None for row in rows):
                await self._execute(lane, rows)
        self._poke_all()  # the others may be waiting for work that will not come

    async def _fill(self, lane: Lane) -> None:
        """Wait up to the queue delay, from the oldest ready request's arrival, for the batch
        to fill (see `_full`)."""
        tensors = self.tensors
        if tensors.max_queue_delay_us <= 0 or self._closing:
            return
        ready = [slot.sequence for slot in lane.slots if slot.ready()]
        oldest = min(s.queue[0].enqueued_ns for s in ready if s is not None)
        waited = (time.perf_counter_ns() - oldest) / 1e9
        with trio.move_on_after(tensors.max_queue_delay_us / 1e6 - waited):
            while not self._full(lane, len(ready)):
                lane.wake = trio.Event()
                await lane.wake.wait()
                ready = [slot.sequence for slot in lane.slots if slot.ready()]

    def _full(self, lane: Lane, ready: int) -> bool:
        """Direct: ``minimum_slot_utilization`` of the slots are ready; Oldest: a preferred
        batch size (or ``max_batch_size``) is."""
        tensors = self.tensors
        if tensors.oldest:
            most = max(1, self._config.max_batch_size)
            return ready >= most or ready in tensors.preferred_batch_size
        return ready >= math.ceil(tensors.minimum_slot_utilization * len(lane.slots))

    def _choose(self, lane: Lane) -> list[_Row | None]:
        """The batch's rows: each ready slot's first request (requests whose callers left
        are dropped), prepared; None for a not-ready row (Direct, below the highest ready
        slot)."""
        rows: list[_Row | None] = []
        for slot in lane.slots:
            sequence = slot.sequence
            if sequence is not None and not sequence.running:
                while sequence.queue and sequence.queue[0].abandoned:
                    gone = sequence.queue.popleft()
                    sequence.ended = sequence.ended or gone.request.options.sequence_end
                    self._drop(gone)
                if not sequence.queue and sequence.ended:
                    self._release(sequence)
            if (
                sequence is None
                or sequence.running
                or not sequence.queue
                or slot.sequence is not sequence
            ):
                rows.append(None)
                continue
            rows.append(_Row(sequence, sequence.queue[0]))
        if self.tensors.oldest:  # the oldest requests, one row each
            most = max(1, self._config.max_batch_size)
            ready = [row for row in rows if row is not None]
            rows = list(sorted(ready, key=lambda r: r.work.enqueued_ns)[:most])
        while rows and rows[-1] is None:  # Direct: up to the highest ready slot
            rows.pop()
        if self.executor.capabilities.request_lists:
            rows = [row for row in rows if row is not None]  # a list has no empty rows
        for row in rows:
            if row is not None:
                self._take_turn(row)
        return rows

    def _take_turn(self, row: _Row) -> None:
        """Take ``row``'s request out of its sequence's queue, and prepare it."""
        sequence, work = row.sequence, row.work
        sequence.queue.popleft()
        sequence.running = True
        sequence.ended = sequence.ended or work.request.options.sequence_end
        self.executor.queued -= 1
        try:
            row.request = self._prepared(sequence, work.request)
        except InvalidRequestError as exc:
            work.error = exc

    def _release(self, sequence: Sequence) -> None:
        assert self._slots is not None
        self._slots.release(sequence)

    # -- one execution ---------------------------------------------------------------------

    def _prepared(self, sequence: Sequence, request: InferRequest) -> InferRequest:
        """``request`` as the model takes it: with its controls and its sequence's state."""
        inputs = dict(request.inputs)
        inputs.update(
            self.tensors.control_values(
                start=request.options.sequence_start,
                end=request.options.sequence_end,
                ready=True,
                correlation_id=self._correlation_id(sequence.key),
                batching=self._config.max_batch_size > 0,
            )
        )
        state = sequence.state
        inputs.update(
            self.start_states if request.options.sequence_start or state is None else state
        )
        return request.derive(
            model_name=request.model_name,
            model_version=request.model_version,
            inputs=inputs,
            requested_outputs=None,
        )

    def _correlation_id(self, key: int | str) -> int | str:
        """The id as the CORRID control carries it: a string id of digits as a number for a
        numeric CORRID (any other string is refused)."""
        corrid = next((c for c in self.tensors.controls if c.kind == "CORRID"), None)
        if corrid is None or isinstance(key, int) or corrid.data_type.value == "BYTES":
            return key
        if key.isascii() and key.isdigit():
            return int(key)
        raise InvalidRequestError(
            f"model '{self._config.name}': its CONTROL_SEQUENCE_CORRID is "
            f"{corrid.data_type.value}, so sequence ids must be integers, not '{key:.40}'"
        )

    def _not_ready(self, like: InferRequest) -> InferRequest:
        """A not-ready row: ``like``'s inputs (any request of the batch serves, as in
        Triton), controls that say not ready, the state's start value."""
        inputs = dict(like.inputs)
        inputs.update(
            self.tensors.control_values(
                start=False, end=False, ready=False, correlation_id=0, batching=True
            )
        )
        inputs.update(self.start_states)
        return like.derive(
            model_name=like.model_name,
            model_version=like.model_version,
            inputs=inputs,
            requested_outputs=None,
        )

    async def _execute(self, lane: Lane, rows: list[_Row | None]) -> None:
        """Run the batch, give each request its outputs or error, free ended slots."""
        taken = [row for row in rows if row is not None]
        runnable = [row for row in taken if row.request is not None]
        try:
            if runnable and self.executor.capabilities.request_lists:
                await self._run_listed(lane, runnable)
            elif runnable:
                await self._run_joined(lane, rows)
        finally:
            for row in taken:
                sequence = row.sequence
                sequence.running = False
                sequence.last_used = trio.current_time()
                row.work.done.set()
                if sequence.ended and not sequence.queue:
                    self._release(sequence)
            lane.poke()
            if self._closing:
                self._poke_all()

    async def _run_listed(self, lane: Lane, rows: list[_Row]) -> None:
        works = []
        for row in rows:
            assert row.request is not None  # only prepared rows are run
            works.append(Work(request=row.request, enqueued_ns=row.work.enqueued_ns))
        try:
            await self.executor.run_listed(lane.instance, works)
        finally:
            for row, ran in zip(rows, works, strict=True):
                self._give(row, ran.outputs, ran.error)

    async def _run_joined(self, lane: Lane, rows: list[_Row | None]) -> None:
        runnable = [row for row in rows if row is not None and row.request is not None]
        first = runnable[0].request
        assert first is not None
        requests = [
            row.request if row is not None and row.request is not None else self._not_ready(first)
            for row in rows
        ]
        if len(requests) == 1:
            combined = Work(request=first, enqueued_ns=runnable[0].work.enqueued_ns)
        else:
            joined = first.derive(
                model_name=first.model_name,
                model_version=first.model_version,
                inputs=join_inputs(requests, len(requests)),
                requested_outputs=None,
            )
            combined = Work(request=joined, enqueued_ns=min(r.work.enqueued_ns for r in runnable))
        members = [row.work for row in runnable]
        try:
            await self.executor.run_work(lane.instance, combined, len(members), members)
        finally:
            parts = self._parts(combined, len(requests))
            for at, row in enumerate(rows):
                if row is not None and row.request is not None:
                    outputs = parts[at] if not isinstance(parts, BaseException) else None
                    self._give(row, outputs, parts if isinstance(parts, BaseException) else None)

    def _parts(self, combined: Work, count: int) -> list[dict[str, Any]] | BaseException:
        """Each row's outputs of a joined execution, or the error that answers them all."""
        if combined.error is not None:
            return combined.error
        if combined.outputs is None:
            return ServerClosedError("the server is shutting down")
        if count == 1:  # also a model that does not batch: the outputs as they are
            return [dict(combined.outputs)]
        try:
            return split_outputs(combined.outputs, [1] * count)
        except ValueError as exc:
            return self.executor.pool.bad_batch(exc)

    def _give(self, row: _Row, outputs: Tensors | None, error: BaseException | None) -> None:
        """Give ``row``'s work its outputs (less the state outputs the client does not see)
        or its error; a success makes the state outputs its sequence's state."""
        work = row.work
        if error is not None or outputs is None:
            work.error = error or ServerClosedError("the server is shutting down")
            return
        states = self.tensors.states
        if states:
            missing = [s.output_name for s in states if s.output_name not in outputs]
            if missing:
                problem = f"it returned no state output {', '.join(map(repr, missing))}"
                work.error = self.executor.pool.error(ValueError(problem))
                return
            row.sequence.state = {s.input_name: np.asarray(outputs[s.output_name]) for s in states}
            shown = self.executor.output_names
            outputs = {k: v for k, v in outputs.items() if k in shown}
        work.outputs = outputs
