"""The ensemble scheduler: one actor per step, connected by bounded channels.

How this works. A request for an ensemble becomes a `Run`: a board of named tensors, and
for each step that must run (pruning keeps only the steps that lead to requested outputs: its
`Plan`) the number of its input tensors still missing. Each step is an actor: it owns the
receive end of its channel (capacity ``max_inflight_requests``, unbounded for 0) and a
semaphore of the same size, and it takes a run off the channel only when it has a free slot,
then calls the step's composing model in a task of its own nursery. When the model answers,
its outputs go on the board; every step whose last missing input just arrived is sent to that
step's channel. A full channel blocks the sender, and the sender still holds its own slot
while it waits, so backpressure travels upstream to the client's ``infer`` call; memory stays
bounded.

An output a model leaves out of its answer arrives too, as nothing (Triton's rule): a step
that takes it runs without it (its model refuses the request if it requires it: the run's
error, which names the step that left the tensor out), and an ensemble output left out is
left out of the response.

A step that can run at once (its channel empty, a slot free, its model with an idle inline
instance) runs in the task that made it ready instead, synchronously: the same limits and
order, two task switches fewer (`Scheduler._advance`).

Errors: the first error wins (prefixed ``in ensemble '<name>', ``, naming the step's model),
no new steps start for that run, sends blocked by backpressure are given up, in-flight model
calls drain, then the client gets the error. When the client goes away (cancellation,
timeout), every task working for the run is cancelled and runs already queued are dropped when
they reach the front, releasing their slots. When the server itself stops, every run still
inside gets a `ServerClosedError`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping

import attrs
import numpy as np
import trio

from ..protocols import (
    EnsembleGraph,
    InferenceTimeoutError,
    InferRequest,
    InferResponse,
    ModelConfig,
    Observer,
    ServerClosedError,
    StepControl,
    StepPlan,
    StepStatistics,
)
from ._ensemble_errors import ItemFailed, left_out_note, step_failed
from ._ensemble_flow import Flow, map_step, with_step_parameters
from ._ensemble_plans import Plan
from ._ensemble_runs import FlowState, Router, Run, Step


def _closed() -> ServerClosedError:
    return ServerClosedError("the server is shutting down")


@attrs.define(eq=False)
class Scheduler:
    """The step actors of one ensemble and their channels."""

    config: ModelConfig
    graph: EnsembleGraph
    router: Router
    observer: Observer | None
    """Receives step events; None when nobody listens (the hot path skips the calls)."""
    defaults: Mapping[str, np.ndarray] = attrs.field(factory=dict)
    """The value of each ``default.T`` the ensemble declares (inline or read from a file)."""
    steps: list[Step] = attrs.field(init=False)
    limited: bool = attrs.field(init=False, default=False)
    """The ensemble has a max_inflight_requests."""
    flow: Flow | None = attrs.field(init=False, default=None)
    """The ensemble's conditions, joins and loops (None: it declares none)."""
    controls: list[StepControl | None] = attrs.field(init=False, factory=list)
    """What each step's parameters declare (maps, timeouts, parameters)."""
    in_task: list[bool] = attrs.field(init=False, factory=list)
    """Steps that always run in a task of their own (a map, a timeout)."""
    in_loop: list[bool] = attrs.field(init=False, factory=list)
    """Steps of a loop. Such a step gives its slot back before it waits for room at the
    next step: the next iteration goes back to the loop's own steps, whose slots may be held
    by runs waiting for room in this step's channel, and holding on would deadlock. What
    waits then is one run each, never more than the clients in flight."""

    def __attrs_post_init__(self) -> None:
        assert self.config.ensemble_scheduling is not None
        limit = self.config.ensemble_scheduling.max_inflight_requests
        self.steps = []
        for plan in self.graph.steps:
            send, receive = trio.open_memory_channel[Run](limit or math.inf)
            self.steps.append(
                Step(
                    plan=plan,
                    capacity=limit,
                    send=send,
                    receive=receive,
                    slots=trio.Semaphore(limit) if limit else None,
                    stream_slots=trio.Semaphore(limit) if limit else None,
                )
            )
        self.limited = bool(limit)
        control = self.graph.control
        self.controls = [control.step(plan.index) for plan in self.graph.steps]
        self.in_task = [c is not None and c.needs_task for c in self.controls]
        self.in_loop = [control.loop_of(plan.index) is not None for plan in self.graph.steps]
        if control.flows:
            self.flow = Flow(self.graph, self.defaults)

    # -- state -----------------------------------------------------------------------------

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
                runs=s.runs,
                skipped=s.skipped,
                items=s.items,
            )
            for s in self.steps
        )

    def empty(self) -> bool:
        """No run is queued at or running in any step."""
        return all(s.in_flight == 0 and s.queued == 0 for s in self.steps)

    # -- the step actors -------------------------------------------------------------------

    async def serve_step(
        self, step: Step, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Run ``step``'s actor until its channel is closed (`close_channels`)."""
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
                        if self.in_task[step.plan.index] or not self.router.ready_now(request):
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

    def close_channels(self) -> None:
        """Close every step's channel: its actor stops once the runs buffered there left."""
        for step in self.steps:
            step.send.close()

    def _drain(self, step: Step) -> None:
        while True:
            try:
                run = step.receive.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                return
            step.queued -= 1
            run.fail(_closed())
            run.step_done()

    def _release(self, step: Step) -> None:
        if step.slots is not None:
            step.slots.release()

    # -- moving a run along ----------------------------------------------------------------

    async def run(
        self, request: InferRequest, plan: Plan, tensors: dict[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        """Run ``plan`` for ``request`` through the step actors, starting from ``tensors``
        (the ensemble's inputs); the board of tensors once every step is done.

        Raises:
            InferenceError: a step failed (first error wins).
            ServerClosedError: the server is stopping.
        """
        run = Run(request=request, plan=plan, tensors=tensors)
        run.missing = dict(plan.missing)
        if self.flow is not None:
            run.flow = FlowState()
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
        return run.tensors

    def _advance(self, run: Run, ready: list[int]) -> list[int]:
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
            step = self.steps[index]
            plan = step.plan
            flow = self.flow
            if flow is not None and flow.skips(run, index):
                step.skipped += 1
                flow.skip(run, index, ready)
                continue
            if step.queued == 0 and not self.in_task[index] and self._take_slot(step):
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

    def _take_slot(self, step: Step) -> bool:
        if step.slots is None:
            return True
        try:
            step.slots.acquire_nowait()
        except trio.WouldBlock:
            return False
        return True

    async def _send_to(self, run: Run, index: int) -> None:
        """Queue ``run`` at step ``index``, waiting while its channel is full.

        The wait is given up when the run dies meanwhile (an error elsewhere, the client gone).
        The caller holds a count on the run while this waits.
        """
        step = self.steps[index]
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

    async def _run_step(self, step: Step, run: Run, request: InferRequest) -> None:
        """A step whose model must be awaited (async, threaded, busy, nested ensemble)."""
        held = True
        with trio.CancelScope() as scope:
            run.scopes.add(scope)
            try:
                if run.dead:  # failed or abandoned since it was queued
                    return
                response = await self._call_model(step, run, request)
                blocked = self._advance(run, self._deliver(run, step.plan, response))
                if blocked and self.in_loop[step.plan.index]:
                    held = False  # see `in_loop`
                    self._release(step)
                for index in blocked:
                    await self._send_to(run, index)
            except BaseException:
                if not run.abandoned:  # cancelled from outside: the server is stopping
                    run.fail(_closed())
                raise
            finally:
                run.scopes.discard(scope)
                if held:
                    self._release(step)
                run.step_done()

    async def _hand_over(self, step: Step, run: Run, ready: list[int]) -> None:
        """Finish a synchronous step whose successors' channels were full (keeps its slot,
        unless it is a loop's step: see `in_loop`)."""
        held = not self.in_loop[step.plan.index]
        if not held:
            self._release(step)
        try:
            for index in ready:
                await self._send_to(run, index)
        except BaseException:
            if not run.abandoned:
                run.fail(_closed())
            raise
        finally:
            if held:
                self._release(step)
            run.step_done()

    def _deliver(self, run: Run, plan: StepPlan, response: InferResponse | None) -> list[int]:
        """Put a step's outputs on the board; return the steps that just became ready.

        An output the step was asked for and left out counts as arrived, as in Triton: its
        consumers run without it (their model refuses them if it requires it).
        """
        if response is None or run.dead:
            return []
        ready: list[int] = []
        wanted = run.plan.step_outputs[plan.index]
        flow = self.flow
        for output, tensor in plan.outputs:
            value = response.outputs.get(output)
            if value is not None:
                run.tensors[tensor] = value
            elif output in wanted:
                if run.left_out is None:
                    run.left_out = set()
                run.left_out.add(tensor)
            else:
                continue
            if flow is not None:
                flow.arrived(run, tensor, ready)
                continue
            for consumer in self.graph.consumers.get(tensor, ()):
                if consumer in run.missing:
                    run.missing[consumer] -= 1
                    if run.missing[consumer] == 0:
                        ready.append(consumer)
        if flow is not None:
            flow.step_done(run, plan.index, ready)
        return ready

    # -- calling the composing model -------------------------------------------------------

    def _step_request(self, step: Step, run: Run) -> InferRequest:
        plan = step.plan
        tensors = run.tensors
        request = run.request.derive(
            model_name=plan.model_name,
            model_version=plan.model_version,
            # An omitted optional ensemble input, or a tensor a step left out, is simply
            # not passed on.
            inputs={inp: tensors[t] for inp, t in plan.inputs if t in tensors},
            requested_outputs=run.plan.step_outputs[plan.index],
        )
        control = self.controls[plan.index]
        if control is not None and control.parameters:
            return with_step_parameters(request, control)
        return request

    def _begin_step(self, step: Step, request: InferRequest) -> None:
        plan = step.plan
        step.in_flight += 1
        step.runs += 1
        if self.observer is not None:
            self.observer.step_started(self.config.name, plan.index, plan.model_name, request)

    def _end_step(
        self, step: Step, run: Run, request: InferRequest, error: BaseException | None
    ) -> None:
        plan = step.plan
        step.in_flight -= 1
        if self.observer is not None:
            self.observer.step_finished(
                self.config.name, plan.index, plan.model_name, request, error
            )
        if isinstance(error, Exception):
            note = left_out_note(self.graph, plan, run.left_out)
            item = ""
            if isinstance(error, ItemFailed):
                item, error = error.where, error.error
            run.fail(step_failed(self.config.name, plan, error, note, item=item))

    async def _call_model(
        self, step: Step, run: Run, request: InferRequest
    ) -> InferResponse | None:
        """Send the step's request to its model; on failure record the run's error."""
        self._begin_step(step, request)
        try:
            control = self.controls[step.plan.index]
            if control is None:
                response = await self.router.infer(request, from_ensemble=True)
            else:
                response = await self._controlled(step, control, request)
        except BaseException as exc:
            self._end_step(step, run, request, exc)
            if isinstance(exc, Exception):
                return None
            raise
        self._end_step(step, run, request, None)
        return response

    def _call_model_now(self, step: Step, run: Run, request: InferRequest) -> InferResponse | None:
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

    async def _controlled(
        self, step: Step, control: StepControl, request: InferRequest
    ) -> InferResponse:
        """A step with a timeout of its own, or mapped over items (`map_step`)."""
        plan = step.plan
        limit = control.timeout
        if limit is None:
            return await self._once_or_mapped(step, control, request)
        with trio.move_on_after(limit):
            return await self._once_or_mapped(step, control, request)
        raise InferenceTimeoutError(
            f"model '{plan.model_name}' did not answer within the step's timeout of "
            f"{round(limit * 1000)} ms (parameter 'step[{plan.index}].timeout_ms')"
        )

    async def _once_or_mapped(
        self, step: Step, control: StepControl, request: InferRequest
    ) -> InferResponse:
        if control.mapped:
            return await map_step(self.router, step, control, request)
        return await self.router.infer(request, from_ensemble=True)
