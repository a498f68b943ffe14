"""ListedFusion: an ensemble of Triton python-backend models, run step after step without
the scheduler.

How this works. A python-backend model takes a list of requests (``execute(requests)``)
and answers each. When every step of an ensemble is such a model, stateless, not
decoupled, making no BLS calls, with an idle instance that runs inline (its executions
short), the scheduler's actors, channels and batch queues add nothing but cost: about
250 µs a request against 30-40 µs for the three ``execute`` calls of a three-step
ensemble. `ListedFusion` then runs the requests that arrive in one scheduling pass
together: for each step in the ensemble's order, one ``execute`` with one request per
client request (at most ``max_batch_size`` rows, as the step's dynamic batcher would
form), each request derived from the client's (its id, parameters and flags) with the
inputs the earlier steps produced, checked against the step's config as the router checks
them. A model without dynamic batching gets one request per ``execute``, as it would from
the scheduler.

What stays the same for the client and the metrics: the outputs; the errors, word for word
(a step's error, or a step's refusal of an input an earlier step left out, ends that
request with the ensemble's message naming the step; the other requests of the pass go
on); each composing model's request and execution statistics; and the inline rule (each
execution teaches its instance how long it takes: a step that turns slow leaves the event
loop, and the ensemble's requests then take the scheduler's path). Nothing is run twice:
a batch either starts with an inline instance free for every step or takes the
scheduler's path before any step runs. Anything unusual takes the scheduler's path, as for
`Fusion`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import numpy as np
import trio

from ..protocols import (
    EnsembleGraph,
    InferenceError,
    InferenceTimeoutError,
    InferRequest,
    InvalidRequestError,
    ModelNotFoundError,
    StepPlan,
    Tensors,
)
from ._batch_queue import OnePass, batch_size, gathered_batches
from ._ensemble_errors import left_out_note, step_failed
from ._executor import Executor
from ._fusion import FusedSteps
from ._instances import Instance

_log = logging.getLogger("orchestrion")


@attrs.define(eq=False, slots=True)
class _Waiting:
    """A client request of one scheduling pass, and where it stands."""

    request: InferRequest
    rows: int
    board: dict[str, Any]
    """The tensors so far: the ensemble's inputs, then each step's outputs."""
    done: trio.Event = attrs.Factory(trio.Event)
    ran: bool = False
    """Its batch ran (the outputs or the error below); False: the scheduler's path."""
    error: InferenceError | InferenceTimeoutError | None = None
    left_out: set[str] | None = None
    """Tensors a step was asked for and left out of its answer (for the error's note)."""
    abandoned: bool = False

    @property
    def inputs(self) -> Tensors:
        """The ensemble's inputs (grouping into batches looks at them)."""
        return self.request.inputs


@attrs.define(eq=False)
class ListedFusion(FusedSteps):
    """The fused call of one ensemble of python-backend steps, for one set of models."""

    graph: EnsembleGraph
    step_outputs: Mapping[int, frozenset[str]]
    """Each step's outputs that someone consumes (what its requests ask for)."""
    max_batch: int = 0
    max_requests: int = 0
    """The ensemble's max_inflight_requests: the most requests one batch may hold."""
    slow: bool = False
    """Never set: each step's instance learns, and a slow one makes `idle` False."""
    announced: bool = attrs.field(init=False, default=False)
    """A batch has run fused (and the log said so, once)."""
    _pass: OnePass[_Waiting] = attrs.field(init=False, factory=OnePass)

    async def run(
        self, request: InferRequest, usable: Callable[[], bool]
    ) -> dict[str, np.ndarray[Any, Any]] | None:
        """The ensemble's outputs for ``request``, run with the other requests of this
        scheduling pass; None: take the scheduler's path (nothing of it ran).

        The requests of the pass are gathered (`OnePass`) and run in batches; ``usable``
        says, at that moment, whether fusing is still right.

        Raises:
            InferenceError: a step failed or refused its request (the ensemble's message).
        """
        me = _Waiting(request, batch_size(self.max_batch, request.inputs), dict(request.inputs))

        def run(live: list[_Waiting]) -> None:
            if usable():
                if self.max_batch:
                    batches = gathered_batches(live, self.max_batch, self.max_requests)
                else:
                    batches = [[w] for w in live]
                for batch in batches:
                    self._run_batch(batch)

        await self._pass.join(me, run)
        return self._answer(me)

    def _answer(self, me: _Waiting) -> dict[str, np.ndarray[Any, Any]] | None:
        if not me.ran:
            return None
        if me.error is not None:
            raise me.error
        board = me.board
        return {name: board[name] for name in self.outputs if name in board}

    def _instances(self) -> list[Instance] | None:
        """For every step, an inline instance free now; None: some step has none."""
        chosen = []
        for step in self.steps:
            found = step.free_inline()
            if found is None:
                return None
            chosen.append(found)
        return chosen

    def _run_batch(self, batch: list[_Waiting]) -> None:
        """Run every step for ``batch``; each request ends with its outputs on its board or
        its error. Nothing runs when some step has no free inline instance."""
        instances = self._instances()
        if instances is None:
            return
        live = batch
        for plan, step, instance in zip(self.order, self.steps, instances, strict=True):
            requests = self._step_requests(plan, step, live)
            if step.capabilities.request_lists:
                groups = [requests] if requests else []
            else:
                groups = [[r] for r in requests]
            for group in groups:
                self._execute(plan, step, instance, group)
            live = [w for w in live if w.error is None]
            if not live:
                break
        for waiting in batch:
            waiting.ran = True
        if not self.announced:
            self.announced = True
            steps = ", ".join(f"'{step.model.name}'" for step in self.steps)
            _log.info("ensemble '%s' runs fused: its python steps (%s) in turn", self.name, steps)

    def _step_requests(
        self, plan: StepPlan, step: Executor, live: list[_Waiting]
    ) -> list[tuple[_Waiting, InferRequest]]:
        """The step's request of each live client request, checked as the router checks
        it (a refused one ends its client request with the ensemble's message)."""
        wanted = self.step_outputs[plan.index]
        made = []
        for waiting in live:
            board = waiting.board
            args = {name: board[tensor] for name, tensor in plan.inputs if tensor in board}
            try:
                inputs = step.checker.inputs(args, adapt_batching=True)
            except InvalidRequestError as exc:
                if not isinstance(exc, ModelNotFoundError):
                    step.request_finished(exc, 0, 0)
                note = left_out_note(self.graph, plan, waiting.left_out)
                waiting.error = step_failed(self.name, plan, exc, note)
                continue
            request = waiting.request.derive(
                model_name=plan.model_name,
                model_version=plan.model_version,
                inputs=inputs,
                requested_outputs=wanted,
            )
            made.append((waiting, request))
        return made

    def _execute(
        self,
        plan: StepPlan,
        step: Executor,
        instance: Instance,
        group: list[tuple[_Waiting, InferRequest]],
    ) -> None:
        """One ``execute`` of ``group``'s requests, counted as the scheduler counts it;
        each client request gets the step's outputs on its board, or its error."""
        requests = [r for _, r in group]
        outcomes, elapsed = step.run_listed_now(instance, requests)
        max_batch = step.config.max_batch_size
        wanted = self.step_outputs[plan.index]
        for (waiting, request), outcome in zip(group, outcomes, strict=True):
            count = batch_size(max_batch, request.inputs)
            if isinstance(outcome, InferenceError):
                step.request_finished(outcome, elapsed, count)
                note = left_out_note(self.graph, plan, waiting.left_out)
                waiting.error = step_failed(self.name, plan, outcome, note)
                continue
            step.request_finished(None, elapsed, count)
            board = waiting.board
            for output, tensor in plan.outputs:
                value = outcome.get(output)
                if value is not None:
                    board[tensor] = value
                elif output in wanted:
                    if waiting.left_out is None:
                        waiting.left_out = set()
                    waiting.left_out.add(tensor)
