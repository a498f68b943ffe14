"""Where a stateful model's sequences are: each in a slot of an instance, or in the backlog.

How this works: each instance has a `Lane` of ``slots`` places (Triton's sequence slots). A
sequence's first request takes the free slot with the lowest place across the instances (so
sequences spread over the instances first), or, when every slot is held, waits in the
backlog, first come first served. Its requests queue in the sequence, and the slot is its
until its END request has run or it goes idle (`SequenceSlots.release`); then the backlog's
oldest sequence takes it. The ids of sequences that have started and not yet sent their END
request are known (`SequenceSlots.admit`): a request of an id that is not is refused, in
Triton's words, unless it starts a sequence.
"""

from __future__ import annotations

import collections
import heapq
import logging
from typing import Any

import attrs
import trio

from ..protocols import InferRequest, InvalidRequestError
from ._instances import Instance, Work

_log = logging.getLogger("orchestrion")


@attrs.define(eq=False)
class Sequence:
    """One sequence: its queued requests, its place, its implicit state."""

    key: int | str
    queue: collections.deque[Work] = attrs.field(factory=collections.deque)
    slot: Slot | None = None
    """Its place (None: in the backlog)."""
    state: dict[str, Any] | None = None
    """Its implicit state (state inputs by name, one row), once a request has set it."""
    last_used: float = attrs.field(factory=trio.current_time)
    running: bool = False
    """One of its requests is being run."""
    ended: bool = False
    """Its END request has been taken: its slot goes once that has run."""


@attrs.define(eq=False)
class Slot:
    """One place for a sequence in one instance's batches."""

    lane: Lane
    index: int
    sequence: Sequence | None = None

    def ready(self) -> bool:
        """Whether its sequence has a request waiting, and none running."""
        sequence = self.sequence
        return sequence is not None and bool(sequence.queue) and not sequence.running


@attrs.define(eq=False)
class Lane:
    """One instance's slots, and the event that wakes its batch loop."""

    instance: Instance
    slots: list[Slot] = attrs.field(factory=list)
    wake: trio.Event = attrs.field(factory=trio.Event)

    def poke(self) -> None:
        """Wake the lane's batch loop (a request came, a slot changed hands)."""
        self.wake.set()


@attrs.define(eq=False)
class SequenceSlots:
    """A model's sequences, their slots and the backlog (see the module docstring)."""

    model: str
    lanes: list[Lane]
    _ids: dict[int | str, Sequence] = attrs.field(factory=dict)
    """Sequences by correlation id, until their END request has come."""
    _backlog: collections.deque[Sequence] = attrs.field(factory=collections.deque)
    _free: list[tuple[int, int, Slot]] = attrs.field(factory=list)
    """Free slots, lowest place first (then instance): a heap."""

    @classmethod
    def of(cls, model: str, instances: list[Instance], per_instance: int) -> SequenceSlots:
        """``per_instance`` slots on each of ``instances``, all free."""
        slots = cls(model, [Lane(instance) for instance in instances])
        for lane in slots.lanes:
            lane.slots = [Slot(lane, index) for index in range(per_instance)]
            for slot in lane.slots:
                heapq.heappush(slots._free, (slot.index, lane.instance.index, slot))
        return slots

    def admit(self, request: InferRequest) -> Sequence:
        """The sequence ``request`` belongs to: started (and placed) by it, or one that has
        started; its END forgets the id (a later request of it starts a new sequence).

        Raises:
            InvalidRequestError: no sequence of that id has started (Triton's words).
        """
        key = request.options.sequence_id
        sequence = self._ids.get(key)
        if sequence is None:
            if not request.options.sequence_start:
                raise InvalidRequestError(
                    f"inference request for sequence {key} to model '{self.model}' must "
                    "specify the START flag on the first request of the sequence"
                )
            sequence = self._ids[key] = Sequence(key)
            self._place(sequence)
        elif request.options.sequence_start:
            _log.warning(
                "sequence %s for model '%s' has a conflict: the previous sequence did not "
                "end before this one started; it goes on from this request",
                key,
                self.model,
            )
        if request.options.sequence_end:
            del self._ids[key]
        return sequence

    def _place(self, sequence: Sequence) -> None:
        """Give ``sequence`` the lowest free slot, or put it in the backlog."""
        if self._free:
            _, _, slot = heapq.heappop(self._free)
            slot.sequence = sequence
            sequence.slot = slot
        else:
            self._backlog.append(sequence)

    def release(self, sequence: Sequence) -> None:
        """Free ``sequence``'s slot (it has ended, or gone idle with nothing queued) for the
        backlog's oldest sequence, or for later; its id is forgotten."""
        slot = sequence.slot
        if slot is None or slot.sequence is not sequence:
            return
        sequence.slot = None
        slot.sequence = None
        if self._ids.get(sequence.key) is sequence:
            del self._ids[sequence.key]
        if self._backlog:
            waiting = self._backlog.popleft()
            slot.sequence = waiting
            waiting.slot = slot
            slot.lane.poke()
        else:
            heapq.heappush(self._free, (slot.index, slot.lane.instance.index, slot))

    def holders(self) -> list[Sequence]:
        """Every sequence that may hold requests: in a slot, or in the backlog."""
        placed = [slot.sequence for lane in self.lanes for slot in lane.slots]
        return [*self._backlog, *(s for s in placed if s is not None)]

    def release_idle(self, now: float, idle_s: float) -> None:
        """Release the sequences in slots that have had no request for ``idle_s`` seconds
        and wait for none (Triton's ``max_sequence_idle_microseconds``)."""
        for lane in self.lanes:
            for slot in lane.slots:
                sequence = slot.sequence
                if sequence is None or sequence.queue or sequence.running:
                    continue
                if now - sequence.last_used > idle_s:
                    self.release(sequence)
