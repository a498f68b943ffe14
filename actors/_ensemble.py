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

A step that can run at once (its channel empty, a slot free, its model with an idle inline
instance) runs in the task that made it ready instead, synchronously: the same limits and
order, two task switches fewer (`_advance`).

Errors: the first error wins (prefixed ``in ensemble '<name>', ``, naming the step's model),
no new steps start for that run, sends blocked by backpressure are given up, in-flight model
calls drain, then the client gets the error. When the client goes away (cancellation,
timeout), every task working for the run is cancelled and runs already queued are dropped when
they reach the front, releasing their slots. When the server itself stops, every run still
inside gets a `ServerClosedError`.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, Protocol, cast

import attrs
import numpy as np
import trio

from ..protocols import (
    EnsembleGraph,
    InferenceError,
    InferRequest,
    InferResponse,
    InvalidRequestError,
    ModelConfig,
    ModelStatistics,
    Observer,
    OrchestrionError,
    ParameterValue,
    ServerClosedError,
    StepPlan,
    StepStatistics,
    TensorChecker,
    TensorConfig,
    Tensors,
    apply_reshape,
    match_batching,
    undo_reshape,
)
from ._fusion import Fusion
from ._runner import ModelRunner, batch_size
from ._stats import StatsRecorder


class Router(Protocol):
    """How a step reaches its composing model: the registry, with its input checks."""

    async def infer(
        self, request: InferRequest, *, strict_outputs: bool = False, from_ensemble: bool = False
    ) -> InferResponse: ...

    def ready_now(self, request: InferRequest) -> bool: ...

    def infer_now(self, request: InferRequest) -> InferResponse: ...

    def stream_infer(self, request: InferRequest) -> AsyncGenerator[InferResponse, None]: ...

    def decoupled(self, model_name: str) -> bool: ...

    def resolve(self, name: str, version: int = -1) -> object: ...

    def fusable(self, runner: object, max_batch_size: int) -> bool: ...

    @property
    def generation(self) -> int: ...


@attrs.define(eq=False)
class _Epoch:
    """Requests on the scheduler's path that fusable requests wait for (`EnsembleRunner`)."""

    runs: int = 0
    closed: bool = False
    """A request waits for these: later ones start a new epoch."""
    done: trio.Event = attrs.field(factory=trio.Event)


@attrs.frozen
class _Plan:
    """What runs for one set of requested outputs (cached per set)."""

    needed: frozenset[int]
    """The steps that lead to a requested output."""
    step_outputs: dict[int, frozenset[str]]
    """For each needed step, the model outputs someone consumes."""
    missing: dict[int, int]
    """For each needed step, how many of its input tensors are not ensemble inputs."""
    first: tuple[int, ...]
    """The needed steps that take only ensemble inputs: they start each request."""


@attrs.define(eq=False, slots=True)
class _Run:
    """One client request travelling through the ensemble."""

    request: InferRequest
    plan: _Plan
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
        self.outstanding -= 1
        if self.outstanding == 0:
            self.finished.set()


def _closed() -> ServerClosedError:
    return ServerClosedError("the server is shutting down")


@attrs.define(eq=False)
class _Step:
    plan: StepPlan
    capacity: int
    send: trio.MemorySendChannel[_Run]
    receive: trio.MemoryReceiveChannel[_Run]
    slots: trio.Semaphore | None
    stream_slots: trio.Semaphore | None
    """The same limit for streamed runs (the step actor holds a slot of ``slots`` while it
    waits, so streams count on their own: an ensemble with a decoupled step is only ever
    streamed)."""
    queued: int = 0
    """Runs buffered in the channel (sent and not yet received)."""
    in_flight: int = 0
    blocked_ns: int = 0


@attrs.define(eq=False)
class EnsembleRunner:
    """One loaded ensemble: its graph, its step actors and their channels."""

    config: ModelConfig
    version: int
    router: Router
    observer: Observer | None
    """Receives runtime events; None when nobody listens (the hot path skips the calls)."""
    revision: str = ""
    """The fingerprint of the ensemble's own config (`Model.revision`); its cache keys also
    take its composing models' (`ModelRegistry.revision`)."""
    graph: EnsembleGraph = attrs.field(init=False)
    checker: TensorChecker = attrs.field(init=False)
    output_names: frozenset[str] = attrs.field(init=False)
    stats: StatsRecorder = attrs.field(init=False)
    _steps: list[_Step] = attrs.field(init=False)
    _active: int = 0
    _idle: trio.Event = attrs.field(init=False, factory=trio.Event)
    _epoch: _Epoch | None = None
    """The requests of this ensemble on the scheduler's path that later ones may wait for."""
    _closing: bool = False
    _plans: dict[frozenset[str], _Plan] = attrs.field(init=False, factory=dict)
    _reshaped_inputs: tuple[TensorConfig, ...] = attrs.field(init=False)
    _fusion: Fusion | None = None
    _nursery: trio.Nursery | None = None
    _fusion_generation: int = -1
    """The registry's generation when `_fusion` was last checked (or found impossible)."""
    _may_fuse: bool = attrs.field(init=False, default=False)
    _fusion_mode: str = attrs.field(init=False, default="on")
    _limited: bool = attrs.field(init=False, default=False)
    """The ensemble has a max_inflight_requests."""
    _order_all: tuple[StepPlan, ...] = attrs.field(init=False, default=())

    def __attrs_post_init__(self) -> None:
        self.graph = EnsembleGraph.from_config(self.config)
        self.checker = TensorChecker(self.config)
        self.output_names = frozenset(self.graph.outputs)
        self._reshaped_inputs = tuple(t for t in self.config.input if t.reshape is not None)
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
                    stream_slots=trio.Semaphore(limit) if limit else None,
                )
            )
        self._idle.set()
        self._fusion_mode = self.config.parameters.get("fusion", "on")
        self._limited = bool(limit)
        self._may_fuse = (
            self._fusion_mode in ("on", "xla")
            and self.observer is None
            and not self._reshaped_inputs
            and all(t.reshape is None for t in self.config.output)
        )
        everything = self._make_plan(frozenset(self.graph.outputs))
        self._order_all = tuple(self.graph.steps[i] for i in self._order(everything))

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
                queued=s.queued,
                in_flight=s.in_flight,
                max_inflight_requests=s.capacity,
                blocked_ns=s.blocked_ns,
            )
            for s in self._steps
        )

    # -- lifetime --------------------------------------------------------------------------

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the step actors until `close` has drained every run."""
        async with trio.open_nursery() as nursery:
            for step in self._steps:
                await nursery.start(self._serve_step, step)
            self._nursery = nursery  # fused calls compile new signatures in its tasks
            task_status.started()

    @property
    def drained(self) -> bool:
        """Closing, and no request is running any more."""
        return self._closing and self._active == 0

    def begin_close(self) -> None:
        """Refuse new requests; the step actors stop once the running ones are answered.

        Not waiting here is deliberate: a caller that gives up waiting (cancelled) must not
        leave the actors running forever. The last run to finish closes the channels.
        """
        self._closing = True
        if self._active == 0:
            self._close_channels()

    async def close(self) -> None:
        """`begin_close`, then wait until every running request has been answered."""
        self.begin_close()
        await self._idle.wait()

    def _close_channels(self) -> None:
        for step in self._steps:
            step.send.close()

    async def _serve_step(
        self, step: _Step, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        async with step.receive:
            try:
                async with trio.open_nursery() as nursery:
                    task_status.started()
                    while True:
                        if step.slots is not None:
                            await step.slots.acquire()
                        try:
                            run = await step.receive.receive()
                        except trio.EndOfChannel:
                            break
                        step.queued -= 1
                        if run.dead:
                            self._release(step)
                            run.step_done()
                            continue
                        request = self._step_request(step, run)
                        if not self.router.ready_now(request):
                            nursery.start_soon(self._run_step, step, run, request)
                            continue
                        # The model can run right now, synchronously: no task needed.
                        response = self._call_model_now(step, run, request)
                        blocked = self._advance(run, self._deliver(run, step.plan, response))
                        if blocked:  # a successor's channel is full: wait for it in a task
                            nursery.start_soon(self._hand_over, step, run, blocked)
                        else:
                            self._release(step)
                            run.step_done()
            finally:
                # Stopped from outside (the server's nursery was cancelled): answer the runs
                # still buffered here, so that no client waits forever.
                self._drain(step)

    def _drain(self, step: _Step) -> None:
        while True:
            try:
                run = step.receive.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                return
            step.queued -= 1
            run.fail(_closed())
            run.step_done()

    def _release(self, step: _Step) -> None:
        if step.slots is not None:
            step.slots.release()

    # -- moving a run along ----------------------------------------------------------------

    def _advance(self, run: _Run, ready: list[int]) -> list[int]:
        """Start the steps of ``run`` that just became ready, without waiting.

        A step whose channel is empty, that has a free slot and whose model can run at once
        (an idle inline instance) runs right here, synchronously, and its successors are
        advanced in turn: a trip through the step's actor would cost two task switches and
        change nothing (same limits, same order). Other steps are queued on their channels.

        Returns:
            the steps whose channels are full: the caller must send to them with `_send_to`.
        """
        blocked: list[int] = []
        while ready:
            index = ready.pop()
            if run.dead:
                continue
            step = self._steps[index]
            plan = step.plan
            if step.queued == 0 and self._take_slot(step):
                request = self._step_request(step, run)
                if self.router.ready_now(request):
                    run.outstanding += 1
                    try:
                        response = self._call_model_now(step, run, request)
                        ready.extend(self._deliver(run, plan, response))
                    finally:
                        self._release(step)
                        run.step_done()
                    continue
                self._release(step)
            try:
                step.send.send_nowait(run)
            except trio.WouldBlock:
                blocked.append(index)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                run.fail(_closed())
            else:
                step.queued += 1
                run.outstanding += 1
        return blocked

    def _take_slot(self, step: _Step) -> bool:
        if step.slots is None:
            return True
        try:
            step.slots.acquire_nowait()
        except trio.WouldBlock:
            return False
        return True

    async def _send_to(self, run: _Run, index: int) -> None:
        """Queue ``run`` at step ``index``, waiting while its channel is full.

        The wait is given up when the run dies meanwhile (an error elsewhere, the client gone).
        The caller holds a count on the run while this waits.
        """
        step = self._steps[index]
        try:
            try:
                step.send.send_nowait(run)
            except trio.WouldBlock:
                if run.dead:
                    return
                start = time.perf_counter_ns()
                with trio.CancelScope() as scope:
                    run.blocked.add(scope)
                    try:
                        await step.send.send(run)
                    finally:
                        run.blocked.discard(scope)
                        step.blocked_ns += time.perf_counter_ns() - start
                if scope.cancelled_caught:
                    return
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            run.fail(_closed())
            return
        step.queued += 1
        run.outstanding += 1

    async def _run_step(self, step: _Step, run: _Run, request: InferRequest) -> None:
        """A step whose model must be awaited (async, threaded, busy, nested ensemble)."""
        with trio.CancelScope() as scope:
            run.scopes.add(scope)
            try:
                if run.dead:  # failed or abandoned since it was queued
                    return
                response = await self._call_model(step, run, request)
                for index in self._advance(run, self._deliver(run, step.plan, response)):
                    await self._send_to(run, index)
            except BaseException:
                if not run.abandoned:  # cancelled from outside: the server is stopping
                    run.fail(_closed())
                raise
            finally:
                run.scopes.discard(scope)
                self._release(step)
                run.step_done()

    async def _hand_over(self, step: _Step, run: _Run, ready: list[int]) -> None:
        """Finish a synchronous step whose successors' channels were full (keeps its slot)."""
        try:
            for index in ready:
                await self._send_to(run, index)
        except BaseException:
            if not run.abandoned:
                run.fail(_closed())
            raise
        finally:
            self._release(step)
            run.step_done()

    # -- calling the composing model -------------------------------------------------------

    def _step_request(self, step: _Step, run: _Run) -> InferRequest:
        plan = step.plan
        tensors = run.tensors
        return run.request.derive(
            model_name=plan.model_name,
            model_version=plan.model_version,
            # An omitted optional ensemble input is simply not passed on.
            inputs={inp: tensors[t] for inp, t in plan.inputs if t in tensors},
            requested_outputs=run.plan.step_outputs[plan.index],
        )

    def _begin_step(self, step: _Step, request: InferRequest) -> None:
        plan = step.plan
        step.in_flight += 1
        if self.observer is not None:
            self.observer.step_started(self.config.name, plan.index, plan.model_name, request)

    def _end_step(
        self, step: _Step, run: _Run, request: InferRequest, error: BaseException | None
    ) -> None:
        plan = step.plan
        step.in_flight -= 1
        if self.observer is not None:
            self.observer.step_finished(
                self.config.name, plan.index, plan.model_name, request, error
            )
        if isinstance(error, Exception):
            run.fail(self._failed(step, error))

    async def _call_model(
        self, step: _Step, run: _Run, request: InferRequest
    ) -> InferResponse | None:
        """Send the step's request to its model; on failure record the run's error."""
        self._begin_step(step, request)
        try:
            response = await self.router.infer(request, from_ensemble=True)
        except BaseException as exc:
            self._end_step(step, run, request, exc)
            if isinstance(exc, Exception):
                return None
            raise
        self._end_step(step, run, request, None)
        return response

    def _call_model_now(
        self, step: _Step, run: _Run, request: InferRequest
    ) -> InferResponse | None:
        """`_call_model` for a model that can run synchronously right now."""
        self._begin_step(step, request)
        try:
            response = self.router.infer_now(request)
        except BaseException as exc:
            self._end_step(step, run, request, exc)
            if isinstance(exc, Exception):
                return None
            raise
        self._end_step(step, run, request, None)
        return response

    def ready_now(self, inputs: Tensors) -> bool:
        """Ensembles always go through their step actors."""
        return False

    def may_run_alone(self, inputs: Tensors) -> bool:
        """An ensemble has no batcher to skip."""
        return False

    async def run_alone(self, request: InferRequest) -> InferResponse | None:
        """Not available for ensembles (`may_run_alone` is always False)."""
        return None

    def infer_now(self, request: InferRequest) -> InferResponse:
        """Not available for ensembles (`ready_now` is always False)."""
        raise trio.WouldBlock

    def _make_plan(self, requested: frozenset[str]) -> _Plan:
        needed = self.graph.needed_steps(requested)
        wanted = set(requested)
        for index in needed:
            wanted.update(t for _, t in self.graph.steps[index].inputs)
        inputs = set(self.graph.inputs)
        missing = {
            i: len({t for _, t in self.graph.steps[i].inputs} - inputs) for i in sorted(needed)
        }
        plan = _Plan(
            needed=needed,
            step_outputs={
                i: frozenset(o for o, t in self.graph.steps[i].outputs if t in wanted)
                for i in needed
            },
            missing=missing,
            first=tuple(i for i, n in missing.items() if n == 0),
        )
        self._plans[requested] = plan
        return plan

    def _deliver(self, run: _Run, plan: StepPlan, response: InferResponse | None) -> list[int]:
        """Put a step's outputs on the board; return the steps that just became ready."""
        if response is None or run.dead:
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
            InferenceError: a step failed (first error wins). Outputs a composing model left
                out are left out of the response (the embedding API reports the ones a
                client asked for by name).
            ServerClosedError: the ensemble is being unloaded or the server is stopping.
        """
        if self._closing:
            raise ServerClosedError(f"ensemble '{self.config.name}' is being unloaded")
        self._active += 1  # an unload waits for this request, fused or not
        if self._active == 1:
            self._idle = trio.Event()
        try:
            if self._may_fuse:
                response = await self._fused(request)
                if response is not None:
                    return response
            epoch = self._epoch
            if epoch is None or epoch.closed:
                epoch = self._epoch = _Epoch()
            epoch.runs += 1
            try:
                return await self._scheduled(request)
            finally:
                epoch.runs -= 1
                if epoch.runs == 0:
                    epoch.done.set()
                    if self._epoch is epoch:
                        self._epoch = None
        finally:
            self._active -= 1
            if self._active == 0:
                self._idle.set()
                if self._closing:
                    self._close_channels()

    async def _scheduled(self, request: InferRequest) -> InferResponse:
        """`infer` through the step actors."""
        requested, plan, tensors = self._begin(request, admitted=True)
        run = _Run(request=request, plan=plan, tensors=tensors)
        run.missing = dict(plan.missing)
        try:
            # Hold one count ourselves so the run cannot finish while we are still seeding.
            run.outstanding += 1
            try:
                for index in self._advance(run, list(plan.first)):
                    await self._send_to(run, index)
            finally:
                run.step_done()
            await run.finished.wait()
        except BaseException:
            run.abandon()
            raise
        if run.error is not None:
            raise run.error
        return self._response(request, requested, run.tensors)

    async def _fused(self, request: InferRequest) -> InferResponse | None:
        """The response of the fused call (see `Fusion`), or None: the scheduler runs it."""
        requested = request.requested_outputs
        if requested is not None and requested != self.output_names:
            return None
        inputs = request.inputs
        if len(inputs) != len(self.config.input):  # an optional input left out
            return None
        fusion = self._current_fusion()
        if fusion is None or fusion.slow:
            return None
        if not fusion.idle() or not self._steps_free():
            epoch = self._epoch
            if epoch is None:
                return None  # busy with other work (a direct call, another ensemble)
            # Busy with this ensemble's own requests on the scheduler's path: wait for those
            # (not for any that start later) to end, rather than join them. Otherwise, under
            # steady load, each request would find the steps busy with the previous ones and
            # none would be fused again. A request waits at most once, and its wait counts
            # towards its timeout.
            epoch.closed = True
            await epoch.done.wait()
            fusion = self._current_fusion()
            if fusion is None or fusion.slow or not fusion.idle() or not self._steps_free():
                return None
        rows = batch_size(self.config.max_batch_size, inputs)
        if fusion.gathers:
            gathered = await fusion.gather(
                inputs, rows, lambda: self._still_fusing(fusion), self._compile_later
            )
            if gathered is None:
                return None
            await trio.lowlevel.checkpoint_if_cancelled()  # a late result is cancelled
            return self._response(request, self.output_names, gathered)
        outputs = fusion.run(inputs, [rows], self._compile_later)
        if outputs is None:
            return None
        await trio.lowlevel.checkpoint()  # a result past the request's deadline is cancelled
        return self._response(request, self.output_names, outputs)

    def _current_fusion(self) -> Fusion | None:
        """The fusion for the composing models loaded now (built when they changed), or None
        when they cannot be fused."""
        generation = self.router.generation
        if generation == self._fusion_generation:
            return self._fusion  # nothing loaded or unloaded since it was checked
        try:
            runners = tuple(
                self.router.resolve(p.model_name, p.model_version) for p in self._order_all
            )
        except OrchestrionError:
            return None
        self._fusion_generation = generation
        fusion = self._fusion
        if fusion is not None and fusion.current(runners):
            return fusion
        mbs = self.config.max_batch_size
        if not all(self.router.fusable(r, mbs) for r in runners):
            self._fusion = None
            return None
        composing = cast(tuple[ModelRunner, ...], runners)  # each checked by fusable
        self._fusion = Fusion(
            self.config.name,
            self._order_all,
            composing,
            tuple(self.graph.outputs),
            mode=self._fusion_mode,
            max_batch=mbs,
            max_requests=self._steps[0].capacity if self._limited else 0,
        )
        return self._fusion

    def _still_fusing(self, fusion: Fusion) -> bool:
        """After a wait: no composing model reloaded, nothing queued, no step busy beyond
        what max_inflight_requests allows. (An unload that began meanwhile still lets this
        admitted request finish, fused or not.)"""
        return self._current_fusion() is fusion and fusion.idle() and self._steps_free()

    def _steps_free(self) -> bool:
        """With max_inflight_requests, a fused request must not run while the scheduler has
        requests in the steps (it would run past their limit)."""
        if not self._limited:
            return True
        return all(s.in_flight == 0 and s.queued == 0 for s in self._steps)

    def _compile_later(self, signature: Any, inputs: Tensors) -> None:
        """Prepare a new signature of the current fusion in a task of the ensemble's own;
        the requests meanwhile take the scheduler's path."""
        fusion, nursery = self._fusion, self._nursery
        if fusion is None or nursery is None or fusion.state(signature) != "new":
            return
        fusion.compiling(signature)
        try:
            nursery.start_soon(fusion.prepare, signature, dict(inputs))
        except RuntimeError:  # the ensemble is shutting down: no more compilations
            fusion._compiling.discard(signature)

    def _response(
        self, request: InferRequest, requested: frozenset[str], tensors: Tensors
    ) -> InferResponse:
        mbs = self.config.max_batch_size
        outputs = {t: tensors[t] for t in requested if t in tensors}
        for tensor in self.config.output:
            value = outputs.get(tensor.name)
            if value is None:
                continue
            # A producer that batches where the ensemble does not (or the other way round).
            own = tensor.reshape.shape if tensor.reshape is not None else tensor.dims
            value = match_batching(value, own, mbs)
            if tensor.reshape is not None:  # the client sees an output's dims
                value = undo_reshape(tensor, value, mbs)
            outputs[tensor.name] = value
        return InferResponse(
            model_name=self.config.name,
            model_version=self.version,
            request_id=request.request_id,
            outputs=outputs,
            parameters=self.response_parameters(request),
        )

    def response_parameters(self, request: InferRequest) -> dict[str, ParameterValue]:
        """The parameters of a response to ``request``: a sequence's request says which, as a
        step would (a cache hit gets them here too, never from the stored entry)."""
        return request.sequence_parameters()

    # -- streaming (an ensemble with a decoupled step) --------------------------------------

    async def stream(self, request: InferRequest) -> AsyncGenerator[InferResponse, None]:
        """One response per iteration of the ensemble's decoupled step, as they come.

        Each response of a decoupled step is an iteration: the steps after it run once per
        iteration (in order, one iteration at a time per stream), so the producer's
        generator stays suspended while its iteration travels downstream: memory holds one
        iteration per stream, whatever the producer's speed. Each step still honours its
        ``max_inflight_requests`` across every stream and request of the ensemble.

        Raises:
            InferenceError: a step failed (after the responses of earlier iterations).
        """
        requested, plan, tensors = self._begin(request)
        order = self._order(plan)
        # Not counted as an active run: a stream lasts as long as its caller reads, and an
        # unload must not wait for that; its steps then fail with ServerClosedError.
        async with contextlib.aclosing(self._iterate(request, plan, order, tensors)) as runs:
            async for produced in runs:
                yield self._response(request, requested, produced)

    def _begin(
        self, request: InferRequest, *, admitted: bool = False
    ) -> tuple[frozenset[str], _Plan, dict[str, Any]]:
        """What `infer` and `stream` start from: the outputs wanted, the plan of steps for
        them, and the ensemble's input tensors (reshaped as the ensemble sees them).

        Raises:
            ServerClosedError: the ensemble is being unloaded.
        """
        if self._closing and not admitted:  # admitted: counted before the unload began
            raise ServerClosedError(f"ensemble '{self.config.name}' is being unloaded")
        requested = request.requested_outputs or frozenset(self.graph.outputs)
        plan = self._plans.get(requested) or self._make_plan(requested)
        # Missing counts cover the tensors steps produce; the ensemble inputs are all there
        # from the start (an omitted optional one is simply not passed on).
        tensors = dict(request.inputs)
        mbs = self.config.max_batch_size
        for tensor in self._reshaped_inputs:  # the ensemble sees an input's reshape
            if tensor.name in tensors:
                tensors[tensor.name] = apply_reshape(tensor, tensors[tensor.name], mbs)
        return requested, plan, tensors

    def _order(self, plan: _Plan) -> list[int]:
        """The needed steps in an order where each comes after the steps it needs."""
        available = set(self.graph.inputs)
        left = sorted(plan.needed)
        order: list[int] = []
        while left:
            ready = [
                i
                for i in left
                if all(
                    t in available or t not in self.graph.producer
                    for _, t in self.graph.steps[i].inputs
                )
            ]
            if not ready:  # cannot happen in a validated graph
                raise InferenceError(
                    f"ensemble '{self.config.name}': no step can run", model_name=self.config.name
                )
            for index in ready:
                order.append(index)
                left.remove(index)
                available.update(t for _, t in self.graph.steps[index].outputs)
        return order

    async def _iterate(
        self, request: InferRequest, plan: _Plan, order: list[int], tensors: dict[str, Any]
    ) -> AsyncGenerator[dict[str, Any], None]:
        """Run ``order`` on ``tensors``; a decoupled step forks one iteration per response."""
        for position, index in enumerate(order):
            step = self._steps[index]
            plan_step = step.plan
            step_request = request.derive(
                model_name=plan_step.model_name,
                model_version=plan_step.model_version,
                inputs={i: tensors[t] for i, t in plan_step.inputs if t in tensors},
                requested_outputs=plan.step_outputs[index],
            )
            if self.router.decoupled(plan_step.model_name):
                async with contextlib.aclosing(self._stream_step(step, step_request)) as produced:
                    async for response in produced:
                        branch = dict(tensors)
                        branch.update(self._mapped(plan_step, response))
                        rest = order[position + 1 :]
                        async with contextlib.aclosing(
                            self._iterate(request, plan, rest, branch)
                        ) as runs:
                            async for done in runs:
                                yield done
                return
            response = await self._step_once(step, step_request)
            tensors.update(self._mapped(plan_step, response))
        yield tensors

    @staticmethod
    def _mapped(plan: StepPlan, response: InferResponse) -> dict[str, Any]:
        return {t: response.outputs[o] for o, t in plan.outputs if o in response.outputs}

    def _failed(self, step: _Step, error: Exception) -> InferenceError:
        wrapped = InferenceError(
            f"in ensemble '{self.config.name}', step[{step.plan.index}]: {error}",
            model_name=step.plan.model_name,
        )
        wrapped.__cause__ = error
        return wrapped

    @contextlib.asynccontextmanager
    async def _streamed(self, step: _Step) -> AsyncIterator[None]:
        """Hold one of the step's stream slots; its model's errors leave prefixed with it."""
        slots = step.stream_slots
        if slots is not None:
            await slots.acquire()
        step.in_flight += 1
        try:
            yield
        except InferenceError as exc:
            raise self._failed(step, exc) from exc.__cause__
        except (InvalidRequestError, ServerClosedError) as exc:
            raise self._failed(step, exc) from exc
        finally:
            step.in_flight -= 1
            if slots is not None:
                slots.release()

    async def _step_once(self, step: _Step, request: InferRequest) -> InferResponse:
        async with self._streamed(step):
            return await self.router.infer(request, from_ensemble=True)

    async def _stream_step(
        self, step: _Step, request: InferRequest
    ) -> AsyncGenerator[InferResponse, None]:
        """A decoupled step's responses; it holds one of the step's slots while it runs."""
        async with (
            self._streamed(step),
            contextlib.aclosing(self.router.stream_infer(request)) as responses,
        ):
            async for response in responses:
                yield response
