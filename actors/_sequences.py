"""Sequences: the state a stateful model (``sequence_batching``) keeps per sequence id.

How this works: each active sequence id has a `Sequence`, its state and a lock. A request
of the sequence takes the lock (so the sequence's requests run one at a time, in the order
they came), runs with the sequence's state (the model's initial state on
``sequence_start``) through the model's queue like any other request, and on success the
state becomes what ``execute`` returned; a failed request leaves the state alone.
``sequence_end`` ends the sequence; one idle longer than ``max_sequence_idle_microseconds``
is released by a sweeper task. A sequence id is reused safely: a restart waits for the id's
running request like any other, and replaces the state only if it succeeds.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import trio

from ..protocols import InferRequest, InvalidRequestError, ModelConfig
from ._instances import Work


@attrs.define(eq=False)
class Sequence:
    """One active sequence of a stateful model: its state, and the lock that keeps its
    requests in order."""

    state: Any
    lock: trio.Lock = attrs.Factory(trio.Lock)
    last_used: float = attrs.Factory(trio.current_time)
    active: bool = False
    """Started (by a successful sequence_start) and not ended or released."""
    released: str | None = None
    """Why it is no longer active: "ended" or "idle"."""


@attrs.define(eq=False)
class Sequences:
    """A stateful model's active sequences, by correlation id."""

    name: str
    initial_state: Callable[[], Any]
    submit: Callable[[Work], Awaitable[None]]
    """Queues a work item for the model's instances and waits until it is done."""
    idle_s: float = 1.0
    active: dict[int | str, Sequence] = attrs.field(factory=dict)

    @classmethod
    def of(
        cls,
        config: ModelConfig,
        initial_state: Callable[[], Any],
        submit: Callable[[Work], Awaitable[None]],
    ) -> Sequences:
        """The sequences of a model with ``sequence_batching``."""
        assert config.sequence_batching is not None
        idle_us = config.sequence_batching.max_sequence_idle_microseconds
        # Triton's default: 1 s.
        return cls(config.name, initial_state, submit, (idle_us or 1_000_000) / 1e6)

    async def run(self, request: InferRequest) -> Work:
        """Run a request of a sequence with the sequence's state, one at a time, in order.

        Raises:
            InvalidRequestError: no sequence id, or the sequence is not active.
        """
        key = request.options.sequence_id
        if key in (0, ""):
            raise InvalidRequestError(
                f"model '{self.name}' is stateful (sequence_batching): its requests need a "
                "sequence_id (correlation id); inside an ensemble, give it to the ensemble's "
                "request"
            )
        # One Sequence (one lock) per id for as long as anyone uses it: a restart waits for
        # the id's running request like any other, and replaces the state only if it succeeds.
        sequence = self.active.get(key)
        if sequence is None:
            if not request.options.sequence_start:
                raise self._inactive(key, None)
            sequence = self.active[key] = Sequence(state=None)
        async with sequence.lock:  # a sequence's requests run one at a time, in order
            if not request.options.sequence_start and not sequence.active:
                raise self._inactive(key, sequence.released)
            state = self.initial_state() if request.options.sequence_start else sequence.state
            work = Work(request=request, enqueued_ns=time.perf_counter_ns(), state=state)
            try:
                await self.submit(work)
            except BaseException:
                if work.scope is not None:  # still running (a thread cannot be cancelled):
                    with trio.CancelScope(shield=True):  # keep the sequence's turn till done
                        await work.done.wait()
                raise
            else:  # a failed request leaves the state (and whether it is active) alone
                sequence.state = work.new_state
                sequence.active = True
                sequence.released = None
            finally:
                sequence.last_used = trio.current_time()
                if request.options.sequence_end:
                    sequence.active = False
                    sequence.released = "ended"
                unused = not sequence.active and not sequence.lock.statistics().tasks_waiting
                if unused and self.active.get(key) is sequence:
                    del self.active[key]
        return work

    def _inactive(self, key: int | str, why: str | None) -> InvalidRequestError:
        name = self.name
        if why == "ended":
            return InvalidRequestError(
                f"model '{name}': sequence {key!r} has ended; start it again with "
                "sequence_start=True"
            )
        if why == "idle":
            return InvalidRequestError(
                f"model '{name}': sequence {key!r} was released after {self.idle_s:g} s idle "
                "(max_sequence_idle_microseconds); start it again with sequence_start=True"
            )
        return InvalidRequestError(
            f"model '{name}': sequence {key!r} is not active: start it with "
            "sequence_start=True (it may have ended, or been released after "
            f"{self.idle_s:g} s idle: max_sequence_idle_microseconds)"
        )

    async def sweep(self) -> None:
        """Release sequences idle longer than ``max_sequence_idle_microseconds`` (runs until
        cancelled)."""
        while True:
            await trio.sleep(max(self.idle_s / 4, 0.01))
            now = trio.current_time()
            for key, sequence in list(self.active.items()):
                if not sequence.lock.locked() and now - sequence.last_used > self.idle_s:
                    del self.active[key]
                    sequence.active = False
                    sequence.released = "idle"
