"""When an ensemble's request runs fused (`Fusion` for jitted steps, `ListedFusion` for
python-backend ones), and when it takes the scheduler's path.

How this works. `FusionGate.fused` answers a request with the ensemble's fused call when it
can, and with None otherwise (the caller then runs the request through the `Scheduler`). A
request is fused only when it asks for every output, passes every input, and the fusion is
usable: its composing models are still the ones it was built for (the registry's generation
says whether anything was loaded or unloaded since; a change rebuilds it, or finds that the
models cannot be fused any more), it has not turned slow, its models are idle, and, with
``max_inflight_requests``, no request is in the steps (a fused call would run past their
limit).

Epochs. Requests on the scheduler's path count in the current `Epoch`. A fusable request
that finds the models busy with them closes the epoch and waits for its requests (not for
ones that start later, which open a new epoch) to end, then tries again, once. Without that,
under steady load, each request would find the steps busy with the previous ones and none
would be fused again. Models busy with other work (a direct call to a composing model,
another ensemble) are not waited for: the request takes the scheduler's path.

In mode "xla" a new input signature is compiled in a task of the ensemble's own nursery
(`FusionGate.nursery`, set once the step actors run) while its requests take the scheduler's
path.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import attrs
import numpy as np
import trio

from ..backends import on_default_device
from ..protocols import (
    FusionMode,
    InferRequest,
    ModelConfig,
    OrchestrionError,
    StepPlan,
    Tensors,
    fusion_mode,
)
from ._batch_queue import batch_size
from ._ensemble_runs import Router
from ._ensemble_scheduler import Scheduler
from ._executor import Executor
from ._fusion import Fusion, SignatureState
from ._listed_fusion import ListedFusion
from ._runner import ModelRunner


def fusable(runner: object, max_batch_size: int) -> Executor | None:
    """The executor of ``runner`` when it can be a step of an ensemble's fused call (of a
    `Fusion`: a jitted model, or of a `ListedFusion`: a python-backend model); None: it
    cannot (an ensemble, or a model the scheduler must run)."""
    if not isinstance(runner, ModelRunner):
        return None
    step = runner.executor
    capabilities = step.capabilities
    if not (
        not capabilities.stateful
        and not capabilities.is_async
        and not capabilities.streaming
        and _batching_fusable(step)
        and all(t.reshape is None for t in step.config.input)
        and step.observer is None
        and step.tracing is None
        and step.config.max_batch_size == max_batch_size
    ):
        return None
    if step.runs_listed_inline:
        return step
    if (
        capabilities.traceable
        and not capabilities.takes_request
        and on_default_device([i.device for i in step.instances])
    ):
        return step
    return None


def _batching_fusable(step: Executor) -> bool:
    """No dynamic batching, or one that gathering requests into the fused call honours:
    no queue delay, no priorities, no queue policy (timeouts, a queue size)."""
    batching = step.config.dynamic_batching
    if not step.batches or batching is None:
        return not step.batches
    return (
        batching.max_queue_delay_microseconds == 0
        and batching.priority_levels == 0
        and batching.default_queue_policy is None
        and not batching.priority_queue_policy
    )


@attrs.define(eq=False)
class Epoch:
    """Requests on the scheduler's path that fusable requests wait for (`FusionGate`)."""

    runs: int = 0
    closed: bool = False
    """A request waits for these: later ones start a new epoch."""
    done: trio.Event = attrs.field(factory=trio.Event)


@attrs.define(eq=False)
class FusionGate:
    """Decides whether a request of one ensemble runs fused, and keeps its fusion current."""

    config: ModelConfig
    router: Router
    scheduler: Scheduler
    order: tuple[StepPlan, ...]
    """Every step, each after the steps it needs: the order of the fused call."""
    observed: bool
    """An observer listens: nothing is fused (it must see every step)."""
    step_outputs: Mapping[int, frozenset[str]]
    """Each step's outputs that someone consumes, when every output is requested."""
    constants: Mapping[str, Any] = attrs.field(factory=dict)
    """The ensemble's constants: a fused call starts from them as from the inputs."""
    fusion: Fusion | ListedFusion | None = None
    """The fusion for the composing models last checked; None: none (yet, or possible)."""
    nursery: trio.Nursery | None = None
    """Where new signatures compile (the ensemble's own); None until it serves."""
    may_fuse: bool = attrs.field(init=False, default=False)
    """The ensemble's configuration allows fusing at all."""
    _outputs: frozenset[str] = attrs.field(init=False)
    _generation: int = -1
    """The registry's generation when `fusion` was last checked (or found impossible)."""
    _mode: FusionMode = attrs.field(init=False, default=FusionMode.ON)
    _epoch: Epoch | None = None
    """The requests of this ensemble on the scheduler's path that later ones may wait for."""

    def __attrs_post_init__(self) -> None:
        self._outputs = frozenset(self.scheduler.graph.outputs)
        self._mode = fusion_mode(self.config)
        self.may_fuse = (
            self._mode is not FusionMode.OFF
            and not self.observed
            and self._declares_at_most_constants()
            and all(t.reshape is None for t in self.config.input)
            and all(t.reshape is None for t in self.config.output)
        )

    def _declares_at_most_constants(self) -> bool:
        """Control flow, step parameters and timeouts need the scheduler; constants do not,
        where no request's rows are gathered with another's (a constant has no batch
        dimension to join along)."""
        control = self.scheduler.graph.control
        if control.empty:
            return True
        return not control.flows and not control.steps and self.config.max_batch_size == 0

    # -- epochs ----------------------------------------------------------------------------

    def open_epoch(self) -> Epoch:
        """Count a request that takes the scheduler's path; `close_epoch` when it is done."""
        epoch = self._epoch
        if epoch is None or epoch.closed:
            epoch = self._epoch = Epoch()
        epoch.runs += 1
        return epoch

    def close_epoch(self, epoch: Epoch) -> None:
        """A request counted by `open_epoch` is done."""
        epoch.runs -= 1
        if epoch.runs == 0:
            epoch.done.set()
            if self._epoch is epoch:
                self._epoch = None

    # -- the fused call --------------------------------------------------------------------

    async def fused(self, request: InferRequest) -> dict[str, np.ndarray[Any, Any]] | None:
        """Every output of the fused call (see `Fusion`), or None: the scheduler runs it."""
        requested = request.requested_outputs
        if requested is not None and requested != self._outputs:
            return None
        inputs = request.inputs
        if len(inputs) != len(self.config.input):  # an optional input left out
            return None
        inputs = {**self.constants, **inputs} if self.constants else inputs
        fusion = self.current()
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
            fusion = self.current()
            if fusion is None or fusion.slow or not fusion.idle() or not self._steps_free():
                return None
        if isinstance(fusion, ListedFusion):
            return await fusion.run(request, lambda: self._still_fusing(fusion))
        rows = batch_size(self.config.max_batch_size, inputs)
        if fusion.gathers:  # never with constants (`_declares_at_most_constants`)
            gathered = await fusion.gather(
                inputs, rows, lambda: self._still_fusing(fusion), self._compile_later
            )
            if gathered is None:
                return None
            await trio.lowlevel.checkpoint_if_cancelled()  # a late result is cancelled
            return gathered
        outputs = fusion.run(inputs, [rows], self._compile_later)
        if outputs is None:
            return None
        await trio.lowlevel.checkpoint()  # a result past the request's deadline is cancelled
        return outputs

    def current(self) -> Fusion | ListedFusion | None:
        """The fusion for the composing models loaded now (built when they changed), or None
        when they cannot be fused."""
        generation = self.router.generation
        if generation == self._generation:
            return self.fusion  # nothing loaded or unloaded since it was checked
        try:
            runners = tuple(self.router.resolve(p.model_name, p.model_version) for p in self.order)
        except OrchestrionError:
            return None
        self._generation = generation
        mbs = self.config.max_batch_size
        steps = tuple(self.router.fusable(r, mbs) for r in runners)
        fusion = self.fusion
        if fusion is not None and fusion.current(steps):
            return fusion
        if any(step is None for step in steps):
            self.fusion = None
            return None
        composing = cast(tuple[Executor, ...], steps)  # none is None
        scheduler = self.scheduler
        limit = scheduler.steps[0].capacity if scheduler.limited else 0
        python = [step.runs_listed_inline for step in composing]
        if any(python):  # python-backend steps: all of them, or no fusion
            self.fusion = None
            if all(python) and not self.constants:  # its requests carry the client's inputs
                self.fusion = ListedFusion(
                    self.config.name,
                    self.order,
                    composing,
                    tuple(scheduler.graph.outputs),
                    scheduler.graph,
                    self.step_outputs,
                    max_batch=mbs,
                    max_requests=limit,
                )
            return self.fusion
        self.fusion = Fusion(
            self.config.name,
            self.order,
            composing,
            tuple(scheduler.graph.outputs),
            mode=self._mode,
            max_batch=mbs,
            max_requests=limit,
        )
        return self.fusion

    def _still_fusing(self, fusion: Fusion | ListedFusion) -> bool:
        """After a wait: no composing model reloaded, nothing queued, no step busy beyond
        what max_inflight_requests allows. (An unload that began meanwhile still lets this
        admitted request finish, fused or not.)"""
        return self.current() is fusion and fusion.idle() and self._steps_free()

    def _steps_free(self) -> bool:
        """With max_inflight_requests, a fused request must not run while the scheduler has
        requests in the steps (it would run past their limit)."""
        if not self.scheduler.limited:
            return True
        return self.scheduler.empty()

    def _compile_later(self, signature: Any, inputs: Tensors) -> None:
        """Prepare a new signature of the current fusion in a task of the ensemble's own;
        the requests meanwhile take the scheduler's path."""
        fusion, nursery = self.fusion, self.nursery
        if not isinstance(fusion, Fusion) or nursery is None:
            return
        if fusion.state(signature) is not SignatureState.NEW:
            return
        fusion.compiling(signature)
        try:
            nursery.start_soon(fusion.prepare, signature, dict(inputs))
        except RuntimeError:  # the ensemble is shutting down: no more compilations
            fusion.compiling(signature, preparing=False)
