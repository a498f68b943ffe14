"""What the ensemble scheduler moves and where: a `Run` (one client request travelling
through the ensemble: its board of tensors, its counts, its error, its control-flow state),
a `Step` (one step actor's channel, slots and counts), and the `Router` a step reaches its
composing model by. The scheduler (``_ensemble_scheduler``) and the control flow
(``_ensemble_flow``) both work on them.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Protocol

import attrs
import numpy as np
import trio

from ..protocols import InferRequest, InferResponse, ModelConfig, StepPlan
from ._ensemble_plans import Plan
from ._executor import Executor


@attrs.define(eq=False)
class FlowState:
    """One run's place in the control flow."""

    skipped: set[str] = attrs.field(factory=set)
    """Tensors whose maker was skipped (and that have no default)."""
    joined: set[str] = attrs.field(factory=set)
    """Joins already decided (their first alternative arrived, or all were absent)."""
    absent: dict[str, int] = attrs.field(factory=dict)
    """For each join, how many of its alternatives arrived absent so far."""
    left: dict[str, int] = attrs.field(factory=dict)
    """For each loop, how many of its steps are still to finish the current iteration."""
    iterations: dict[str, int] = attrs.field(factory=dict)
    """For each loop, the iterations finished."""


class Router(Protocol):
    """How a step reaches its composing model: the registry's `RequestRouter`, with its input
    checks and statistics."""

    async def infer(
        self, request: InferRequest, *, from_ensemble: bool = False
    ) -> InferResponse: ...

    def ready_now(self, request: InferRequest) -> bool: ...

    def infer_now(self, request: InferRequest) -> InferResponse: ...

    def stream_infer(self, request: InferRequest) -> AsyncGenerator[InferResponse, None]: ...

    def decoupled(self, model_name: str) -> bool: ...

    def resolve(self, name: str, version: int = -1) -> object: ...

    def fusable(self, runner: object, max_batch_size: int) -> Executor | None: ...

    def model_config(self, name: str, version: int = -1) -> ModelConfig: ...

    @property
    def generation(self) -> int: ...


@attrs.define(eq=False, slots=True)
class Run:
    """One client request travelling through the ensemble."""

    request: InferRequest
    plan: Plan
    tensors: dict[str, np.ndarray] = attrs.field(factory=dict)
    missing: dict[int, int] = attrs.field(factory=dict)
    outstanding: int = 0
    """Steps queued, running or handing over for this run (plus the client's own hold)."""
    error: BaseException | None = None
    abandoned: bool = False
    finished: trio.Event = attrs.Factory(trio.Event)
    scopes: set[trio.CancelScope] = attrs.field(factory=set)
    """Tasks working for this run: cancelled when the client goes away."""
    blocked: set[trio.CancelScope] = attrs.field(factory=set)
    """Sends waiting for room downstream: given up as soon as the run is dead."""
    left_out: set[str] | None = None
    """Tensors a step's model left out of its answer (None: none so far)."""
    flow: FlowState | None = None
    """Where the run is in the ensemble's control flow (None: the ensemble declares none)."""

    @property
    def dead(self) -> bool:
        """No further step should start for this run."""
        return self.error is not None or self.abandoned

    def fail(self, error: BaseException) -> None:
        """Record the run's error (the first one wins) and give up waiting for room."""
        if self.error is None:
            self.error = error
        for scope in self.blocked:
            scope.cancel()

    def abandon(self) -> None:
        """The client went away: cancel everything working for this run."""
        self.abandoned = True
        for scope in (*self.scopes, *self.blocked):
            scope.cancel()

    def step_done(self) -> None:
        """One step of this run (or the client's own hold) is over."""
        self.outstanding -= 1
        if self.outstanding == 0:
            self.finished.set()


@attrs.define(eq=False)
class Step:
    """One step's actor: its channel, its slots and its live counts."""

    plan: StepPlan
    capacity: int
    send: trio.MemorySendChannel[Run]
    receive: trio.MemoryReceiveChannel[Run]
    slots: trio.Semaphore | None
    stream_slots: trio.Semaphore | None
    """The same limit for streamed runs (the step actor holds a slot of ``slots`` while it
    waits, so streams count on their own: an ensemble with a decoupled step is only ever
    streamed)."""
    queued: int = 0
    """Runs buffered in the channel (sent and not yet received)."""
    in_flight: int = 0
    blocked_ns: int = 0
    runs: int = 0
    skipped: int = 0
    items: int = 0
