"""Streaming through an ensemble with a decoupled step: one response per iteration.

How this works. A streamed request does not go through the step actors: `EnsembleStreams`
runs its needed steps in order (`Plans.order`), in the caller's task, each through the
registry like any step. A decoupled step's responses are iterations: for each one, the steps
after it run on a copy of the tensors so far (forking, recursively, at a later decoupled
step), and the finished tensors are yielded before the producer is asked for its next
response. The producer's generator thus stays suspended while its iteration travels
downstream, so memory holds one iteration per stream, whatever the producer's speed.

Each step still honours its ``max_inflight_requests`` across every stream and request of the
ensemble: a streamed step holds one of its step's stream slots while it runs (`Step`), and
counts as in flight in the step's statistics. Its model's errors leave prefixed with the
step, as the scheduler reports them, and so do outputs a model leaves out (see `iterate`).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import attrs

from ..protocols import (
    InferenceError,
    InferRequest,
    InferResponse,
    InvalidRequestError,
    ServerClosedError,
    StepPlan,
)
from ._ensemble_errors import left_out_note, step_failed
from ._ensemble_flow import with_step_parameters
from ._ensemble_plans import Plan
from ._ensemble_runs import Step
from ._ensemble_scheduler import Scheduler


@attrs.define(eq=False)
class EnsembleStreams:
    """The streamed requests of one ensemble, run step by step in the caller's task."""

    scheduler: Scheduler
    """The ensemble's steps (their slots and counts) and its router."""

    async def iterate(
        self,
        request: InferRequest,
        plan: Plan,
        order: list[int],
        tensors: dict[str, Any],
        left_out: frozenset[str] = frozenset(),
    ) -> AsyncGenerator[dict[str, Any], None]:
        """Run ``order`` on ``tensors``; a decoupled step forks one iteration per response.

        ``left_out``: the tensors a step's model left out of its answer so far. As on the
        scheduler's path, a step that takes one runs without it (an error when its model
        requires it), and an ensemble output left out is missing from the response.
        """
        router = self.scheduler.router
        for position, index in enumerate(order):
            step = self.scheduler.steps[index]
            plan_step = step.plan
            wanted = plan.step_outputs[index]
            step_request = request.derive(
                model_name=plan_step.model_name,
                model_version=plan_step.model_version,
                inputs={i: tensors[t] for i, t in plan_step.inputs if t in tensors},
                requested_outputs=wanted,
            )
            control = self.scheduler.controls[index]
            if control is not None and control.parameters:
                step_request = with_step_parameters(step_request, control)
            if router.decoupled(plan_step.model_name):
                produced = self._stream_step(step, step_request, left_out)
                async with contextlib.aclosing(produced) as responses:
                    async for response in responses:
                        branch = dict(tensors)
                        lost = self._mapped(plan_step, wanted, response, branch)
                        rest = order[position + 1 :]
                        async with contextlib.aclosing(
                            self.iterate(request, plan, rest, branch, left_out | lost)
                        ) as runs:
                            async for done in runs:
                                yield done
                return
            response = await self._step_once(step, step_request, left_out)
            left_out |= self._mapped(plan_step, wanted, response, tensors)
        yield tensors

    @staticmethod
    def _mapped(
        plan: StepPlan, wanted: frozenset[str], response: InferResponse, tensors: dict[str, Any]
    ) -> frozenset[str]:
        """Put the step's outputs in ``tensors``; the tensors it was asked for and left out."""
        lost = []
        for output, tensor in plan.outputs:
            value = response.outputs.get(output)
            if value is not None:
                tensors[tensor] = value
            elif output in wanted:
                lost.append(tensor)
        return frozenset(lost)

    @contextlib.asynccontextmanager
    async def _streamed(self, step: Step, left_out: frozenset[str]) -> AsyncIterator[None]:
        """Hold one of the step's stream slots; its model's errors leave prefixed with it
        (and with the tensors it takes that an earlier step left out)."""
        slots = step.stream_slots
        if slots is not None:
            await slots.acquire()
        step.in_flight += 1
        scheduler = self.scheduler
        name = scheduler.config.name
        try:
            yield
        except InferenceError as exc:
            note = left_out_note(scheduler.graph, step.plan, left_out)
            raise step_failed(name, step.plan, exc, note) from exc.__cause__
        except (InvalidRequestError, ServerClosedError) as exc:
            note = left_out_note(scheduler.graph, step.plan, left_out)
            raise step_failed(name, step.plan, exc, note) from exc
        finally:
            step.in_flight -= 1
            if slots is not None:
                slots.release()

    async def _step_once(
        self, step: Step, request: InferRequest, left_out: frozenset[str]
    ) -> InferResponse:
        async with self._streamed(step, left_out):
            return await self.scheduler.router.infer(request, from_ensemble=True)

    async def _stream_step(
        self, step: Step, request: InferRequest, left_out: frozenset[str]
    ) -> AsyncGenerator[InferResponse, None]:
        """A decoupled step's responses; it holds one of the step's slots while it runs."""
        async with (
            self._streamed(step, left_out),
            contextlib.aclosing(self.scheduler.router.stream_infer(request)) as responses,
        ):
            async for response in responses:
                yield response
