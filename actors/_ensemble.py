"""The ensemble scheduler: one actor per step, connected by bounded channels.

How this works. A request for an ensemble becomes a `_Run`: a board of named tensors, and
for each step that must run (pruning keeps only the steps that lead to requested outputs) the
number of its input tensors still missing. Each step is an actor: it owns the receive end of
its channel (capacity ``max_inflight_requests``, unbounded for 0) and a semaphore of the same
size, and it takes a run off the channel only when it has a free slot, then calls the step's
composing model in a task of its own nursery. When the model answers, its outputs go on the
board; every step whose last missing input just arrived is sent to that step's channel. A full
channel blocks the sender, and the sender still holds its own slot while it waits, so
backpressure travels upstream to the client's ``infer`` call; memory stays bounded.

Errors: the first error wins (prefixed ``in ensemble '<name>', ``, naming the step's model),
no new steps start for that run, in-flight ones drain, then the client gets the error. When
the client goes away (cancellation, timeout), every task working for the run is cancelled and
runs already queued are dropped when they reach the front, releasing their slots.
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable

import attrs
import numpy as np
import trio

from ..protocols import (
    EnsembleGraph,
    InferenceError,
    InferRequest,
    InferResponse,
    ModelConfig,
    ModelStatistics,
    Observer,
    ServerClosedError,
    StepPlan,
    StepStatistics,
)
from ._stats import StatsRecorder

Dispatch = Callable[[InferRequest], Awaitable[InferResponse]]


@attrs.frozen
class _Plan:
    """What runs for one set of requested outputs (cached per set)."""

    needed: frozenset[int]
    """The steps that lead to a requested output."""
    step_outputs: dict[int, frozenset[str]]
    """For each needed step, the model outputs someone consumes."""


@attrs.define(eq=False, slots=True)
class _Run:
    """One client request travelling through the ensemble."""

    request: InferRequest
    plan: _Plan
    tensors: dict[str, np.ndarray] = attrs.field(factory=dict)
    missing: dict[int, int] = attrs.field(factory=dict)
    outstanding: int = 0
    error: BaseException | None = None
    abandoned: bool = False
    finished: trio.Event = attrs.Factory(trio.Event)
    scopes: set[trio.CancelScope] = attrs.field(factory=set)

    @property
    def dead(self) -> bool:
        """No further step should start for this run."""
        return self.error is not None or self.abandoned

    def abandon(self) -> None:
        """The client went away: cancel everything working for this run."""
        self.abandoned = True
        for scope in self.scopes:
            scope.cancel()

    def step_done(self) -> None:
        self.outstanding -= 1
        if self.outstanding == 0:
            self.finished.set()


@attrs.define(eq=False)
class _Step:
    plan: StepPlan
    capacity: int
    send: trio.MemorySendChannel[_Run]
    receive: trio.MemoryReceiveChannel[_Run]
    slots: trio.Semaphore | None
    in_flight: int = 0
    blocked_ns: int = 0


@attrs.define(eq=False)
class EnsembleRunner:
    """One loaded ensemble: its graph, its step actors and their channels."""

    config: ModelConfig
    version: int
    dispatch: Dispatch
    """How a step reaches its composing model (the registry's routing, with input checks)."""
    observer: Observer
    graph: EnsembleGraph = attrs.field(init=False)
    stats: StatsRecorder = attrs.field(init=False)
    _steps: list[_Step] = attrs.field(init=False)
    _active: int = 0
    _idle: trio.Event = attrs.field(init=False, factory=trio.Event)
    _closing: bool = False
    _plans: dict[frozenset[str], _Plan] = attrs.field(init=False, factory=dict)

    def __attrs_post_init__(self) -> None:
        self.graph = EnsembleGraph.from_config(self.config)
        self.stats = StatsRecorder(self.config.name, self.version)
        assert self.config.ensemble_scheduling is not None
        limit = self.config.ensemble_scheduling.max_inflight_requests
        self._steps = []
        for plan in self.graph.steps:
            send, receive = trio.open_memory_channel[_Run](limit or math.inf)
            self._steps.append(
                _Step(
                    plan=plan,
                    capacity=limit,
                    send=send,
                    receive=receive,
                    slots=trio.Semaphore(limit) if limit else None,
                )
            )
        self._idle.set()

    def statistics(self) -> ModelStatistics:
        """A snapshot of the ensemble's own statistics."""
        return self.stats.snapshot()

    def step_statistics(self) -> tuple[StepStatistics, ...]:
        """The live queue depth, in-flight count and blocked time of every step."""
        return tuple(
            StepStatistics(
                ensemble=self.config.name,
                step=s.plan.index,
                model_name=s.plan.model_name,
                queued=s.receive.statistics().current_buffer_used,
                in_flight=s.in_flight,
                max_inflight_requests=s.capacity,
                blocked_ns=s.blocked_ns,
            )
            for s in self._steps
        )

    # -- actors ----------------------------------------------------------------------------

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the step actors until `close` has drained every run."""
        async with trio.open_nursery() as nursery:
            for step in self._steps:
                await nursery.start(self._serve_step, step)
            task_status.started()

    async def close(self) -> None:
        """Refuse new requests, wait for running ones, then stop the step actors."""
        self._closing = True
        await self._idle.wait()
        for step in self._steps:
            step.send.close()

    async def _serve_step(
        self, step: _Step, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        async with step.receive, trio.open_nursery() as nursery:
            task_status.started()
            while True:
                if step.slots is not None:
                    await step.slots.acquire()
                try:
                    run = await step.receive.receive()
                except trio.EndOfChannel:
                    break
                if run.dead:
                    self._release(step)
                    run.step_done()
                    continue
                step.in_flight += 1
                nursery.start_soon(self._run_step, step, run)

    def _release(self, step: _Step) -> None:
        if step.slots is not None:
            step.slots.release()

    async def _send_to(self, run: _Run, index: int) -> None:
        """Queue ``run`` at step ``index``; blocks while that step's channel is full."""
        step = self._steps[index]
        run.outstanding += 1
        try:
            try:
                step.send.send_nowait(run)
            except trio.WouldBlock:
                start = time.perf_counter_ns()
                try:
                    await step.send.send(run)
                finally:
                    step.blocked_ns += time.perf_counter_ns() - start
        except BaseException:
            run.step_done()
            raise

    async def _run_step(self, step: _Step, run: _Run) -> None:
        with trio.CancelScope() as scope:
            run.scopes.add(scope)
            try:
                if run.abandoned:
                    scope.cancel()
                response = await self._call_model(step, run)
                if response is not None:
                    for index in self._deliver(run, step.plan, response):
                        await self._send_to(run, index)
            finally:
                run.scopes.discard(scope)
                self._release(step)
                run.step_done()

    async def _call_model(self, step: _Step, run: _Run) -> InferResponse | None:
        """Send the step's request to its model; on failure record the run's error."""
        plan = step.plan
        name = self.config.name
        try:
            request = attrs.evolve(
                run.request,
                model_name=plan.model_name,
                model_version=plan.model_version,
                inputs={inp: run.tensors[tensor] for inp, tensor in plan.inputs},
                requested_outputs=run.plan.step_outputs[plan.index],
            )
            self.observer.step_started(name, plan.index, plan.model_name, request)
            try:
                response = await self.dispatch(request)
            except Exception as exc:
                self.observer.step_finished(name, plan.index, plan.model_name, request, exc)
                if run.error is None:
                    run.error = InferenceError(
                        f"in ensemble '{name}', step[{plan.index}]: {exc}",
                        model_name=plan.model_name,
                    )
                    run.error.__cause__ = exc
                return None
            self.observer.step_finished(name, plan.index, plan.model_name, request, None)
            return response
        finally:
            step.in_flight -= 1

    def _make_plan(self, requested: frozenset[str]) -> _Plan:
        needed = self.graph.needed_steps(requested)
        wanted = set(requested)
        for index in needed:
            wanted.update(t for _, t in self.graph.steps[index].inputs)
        plan = _Plan(
            needed=needed,
            step_outputs={
                i: frozenset(o for o, t in self.graph.steps[i].outputs if t in wanted)
                for i in needed
            },
        )
        self._plans[requested] = plan
        return plan

    def _deliver(self, run: _Run, plan: StepPlan, response: InferResponse) -> list[int]:
        """Put a step's outputs on the board; return the steps that just became ready."""
        if run.dead:
            return []
        ready = []
        for output, tensor in plan.outputs:
            value = response.outputs.get(output)
            if value is None:
                continue
            run.tensors[tensor] = value
            for consumer in self.graph.consumers.get(tensor, ()):
                if consumer in run.missing:
                    run.missing[consumer] -= 1
                    if run.missing[consumer] == 0:
                        ready.append(consumer)
        return ready

    # -- requests --------------------------------------------------------------------------

    async def infer(self, request: InferRequest) -> InferResponse:
        """Run the pipeline for ``request`` (inputs already checked).

        Raises:
            InferenceError: a step failed (first error wins), or an explicitly requested
                output was not produced.
            ServerClosedError: the ensemble is being unloaded.
        """
        if self._closing:
            raise ServerClosedError(f"ensemble '{self.config.name}' is being unloaded")
        requested = request.requested_outputs or frozenset(self.graph.outputs)
        plan = self._plans.get(requested) or self._make_plan(requested)
        run = _Run(request=request, plan=plan, tensors=dict(request.inputs))
        ready = []
        for index in plan.needed:
            inputs = {t for _, t in self.graph.steps[index].inputs}
            missing = len(inputs - run.tensors.keys())
            run.missing[index] = missing
            if missing == 0:
                ready.append(index)
        self._active += 1
        self._idle = trio.Event() if self._active == 1 else self._idle
        try:
            # Hold one count ourselves so the run cannot finish while we are still seeding.
            run.outstanding += 1
            try:
                for index in ready:
                    await self._send_to(run, index)
            finally:
                run.step_done()
            await run.finished.wait()
        except BaseException:
            run.abandon()
            raise
        finally:
            self._active -= 1
            if self._active == 0:
                self._idle.set()
        if run.error is not None:
            raise run.error
        outputs = {t: run.tensors[t] for t in requested if t in run.tensors}
        if request.requested_outputs is not None:
            lost = sorted(request.requested_outputs - outputs.keys())
            if lost:
                raise InferenceError(
                    f"in ensemble '{self.config.name}', requested outputs were not produced: "
                    + ", ".join(f"'{t}'" for t in lost)
                    + " (a composing model left out an output they depend on)",
                    model_name=self.config.name,
                )
        return InferResponse(
            model_name=self.config.name,
            model_version=self.version,
            request_id=request.request_id,
            outputs=outputs,
        )
