"""One loaded ensemble: a small composition of its scheduler, its fusion gate and its streams.

How this works. `EnsembleRunner.infer` first asks the `FusionGate` whether the request can
run as the ensemble's fused call (`Fusion`: jitted steps in one plain loop, no actors;
`ListedFusion`: python-backend steps, one ``execute`` each for a pass's requests); if not,
the request is counted in the gate's current epoch (fusable requests wait for those rather
than join them) and runs through the `Scheduler`'s step actors, one per step, connected by
bounded channels. `EnsembleRunner.stream` (an ensemble with a decoupled step) runs the steps
in the caller's task through `EnsembleStreams`, one response per iteration of the decoupled
step. Either way the runner reshapes the ensemble's inputs as the ensemble sees them, picks
the plan of steps for the requested outputs, and builds the response (batching and reshape as
the client sees them).

Unloading: `begin_close` refuses new requests; every request already admitted (fused or not)
still finishes, and the last one out closes the step channels, which stops the actors. A
stream is not counted: it lasts as long as its caller reads, and its steps then fail with
`ServerClosedError`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncGenerator, Mapping, Sequence
from typing import Any, ClassVar

import attrs
import numpy as np
import trio

from ..protocols import (
    ConfigError,
    CustomMetricFamily,
    EnsembleGraph,
    InferRequest,
    InferResponse,
    ModelConfig,
    ModelStatistics,
    Observer,
    ParameterValue,
    ServerClosedError,
    StepStatistics,
    TensorChecker,
    TensorConfig,
    Tensors,
    apply_reshape,
    match_batching,
    undo_reshape,
)
from ._ensemble_fusion import FusionGate
from ._ensemble_plans import Plan, Plans
from ._ensemble_runs import Router, Step
from ._ensemble_scheduler import Scheduler
from ._ensemble_streams import EnsembleStreams
from ._fusion import Fusion
from ._listed_fusion import ListedFusion
from ._stats import StatsRecorder

_log = logging.getLogger("orchestrion")


@attrs.define(eq=False)
class EnsembleRunner:
    """One loaded ensemble: its graph, its step actors and their channels."""

    is_ensemble: ClassVar[bool] = True

    config: ModelConfig
    version: int
    router: Router
    observer: Observer | None
    """Receives runtime events; None when nobody listens (the hot path skips the calls)."""
    revision: str = ""
    """The fingerprint of the ensemble's own config (`Model.revision`); its cache keys also
    take its composing models' (`ModelRegistry.revision`)."""
    labels: Mapping[str, Sequence[str]] = attrs.field(factory=dict)
    """Class labels per output (`Model.labels`)."""
    files: Mapping[str, np.ndarray] = attrs.field(factory=dict)
    """The values of constants and defaults declared with a ``file`` (`Model.constants`)."""
    graph: EnsembleGraph = attrs.field(init=False)
    checker: TensorChecker = attrs.field(init=False)
    output_names: frozenset[str] = attrs.field(init=False)
    stats: StatsRecorder = attrs.field(init=False)
    _plans: Plans = attrs.field(init=False)
    _scheduler: Scheduler = attrs.field(init=False)
    _gate: FusionGate = attrs.field(init=False)
    _streams: EnsembleStreams = attrs.field(init=False)
    _active: int = 0
    _idle: trio.Event = attrs.field(init=False, factory=trio.Event)
    _closing: bool = False
    _reshaped_inputs: tuple[TensorConfig, ...] = attrs.field(init=False)
    _constants: dict[str, np.ndarray] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        """Raises `ConfigError` where a constant or default declared with a file was not
        given its value (an ensemble made in Python has no folder to read it from)."""
        self.graph = EnsembleGraph.from_config(self.config)
        control = self.graph.control
        unread = [
            f"'{kind}.{name}'"
            for kind, declared in (("constant", control.constants), ("default", control.defaults))
            for name, d in declared.items()
            if d.value is None and name not in self.files
        ]
        if unread:
            raise ConfigError(
                f"ensemble '{self.config.name}': parameters {', '.join(unread)} name a file, "
                "and no value was read from it (give 'value' to an ensemble made in Python, "
                "or pass Model(constants=...))"
            )
        values = {
            name: self.files[name] if d.value is None else d.value
            for declared in (control.constants, control.defaults)
            for name, d in declared.items()
        }
        self._constants = {name: values[name] for name in control.constants}
        self.checker = TensorChecker(self.config)
        self.output_names = frozenset(self.graph.outputs)
        self._reshaped_inputs = tuple(t for t in self.config.input if t.reshape is not None)
        self.stats = StatsRecorder(self.config.name, self.version)
        self._plans = Plans(self.config.name, self.graph)
        self._scheduler = Scheduler(
            self.config,
            self.graph,
            self.router,
            self.observer,
            defaults={name: values[name] for name in control.defaults},
        )
        self._idle.set()
        everything = self._plans.plan(frozenset(self.graph.outputs))
        order = tuple(self.graph.steps[i] for i in self._plans.order(everything))
        self._gate = FusionGate(
            self.config,
            self.router,
            self._scheduler,
            order,
            observed=self.observer is not None,
            step_outputs=everything.step_outputs,
            constants=self._constants,
        )
        self._streams = EnsembleStreams(self._scheduler)

    @property
    def _steps(self) -> list[Step]:
        """The step actors' state (tests look at their slots)."""
        return self._scheduler.steps

    @property
    def _fusion(self) -> Fusion | ListedFusion | None:
        """The fused call last built for the composing models (tests and benchmarks look)."""
        return self._gate.fusion

    def keep_counting(self, recorder: StatsRecorder) -> None:
        """Count from now on in ``recorder`` (a reload hands the old version's on)."""
        self.stats = recorder

    def statistics(self) -> ModelStatistics:
        """A snapshot of the ensemble's own statistics."""
        return self.stats.snapshot()

    def step_statistics(self) -> tuple[StepStatistics, ...]:
        """The live queue depth, in-flight count and blocked time of every step."""
        return self._scheduler.step_statistics()

    def custom_metrics(self) -> list[CustomMetricFamily]:
        """An ensemble's own code makes no metric families (its models' do)."""
        return []

    async def passes_own_check(self) -> bool:
        """An ensemble has no code of its own to ask: loaded is ready."""
        await trio.lowlevel.checkpoint()
        return True

    # -- lifetime --------------------------------------------------------------------------

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the step actors until `close` has drained every run."""
        async with trio.open_nursery() as nursery:
            for step in self._scheduler.steps:
                await nursery.start(self._scheduler.serve_step, step)
            self._gate.nursery = nursery  # fused calls compile new signatures in its tasks
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
            self._scheduler.close_channels()

    async def close(self) -> None:
        """`begin_close`, then wait until every running request has been answered."""
        self.begin_close()
        await self._idle.wait()

    # -- what the registry asks of every runner --------------------------------------------

    def ready_now(self, inputs: Tensors) -> bool:
        """Ensembles always go through their step actors."""
        return False

    def infer_now(self, request: InferRequest) -> InferResponse:
        """Not available for ensembles (`ready_now` is always False)."""
        raise trio.WouldBlock

    # -- requests --------------------------------------------------------------------------

    async def infer(self, request: InferRequest) -> InferResponse:
        """Run the pipeline for ``request`` (inputs already checked).

        Raises:
            InferenceError: a step failed (first error wins); a `StepRefusedError` when a
                step's model refused its request (a required input that an earlier step
                left out, say). Outputs a composing model left out are left out of the
                response, as in Triton.
            ServerClosedError: the ensemble is being unloaded or the server is stopping.
        """
        if self._closing:
            raise ServerClosedError(f"ensemble '{self.config.name}' is being unloaded")
        self._active += 1  # an unload waits for this request, fused or not
        if self._active == 1:
            self._idle = trio.Event()
        try:
            if self._gate.may_fuse:
                outputs = await self._gate.fused(request)
                if outputs is not None:
                    return self._response(request, self.output_names, outputs)
            epoch = self._gate.open_epoch()
            try:
                return await self._scheduled(request)
            finally:
                self._gate.close_epoch(epoch)
        finally:
            self._active -= 1
            if self._active == 0:
                self._idle.set()
                if self._closing:
                    self._scheduler.close_channels()

    async def _scheduled(self, request: InferRequest) -> InferResponse:
        """`infer` through the step actors."""
        requested, plan, tensors = self._begin(request, admitted=True)
        produced = await self._scheduler.run(request, plan, tensors)
        # The answer came from the step actors; a deadline that passed meanwhile has been
        # seen by now: a late result is cancelled, not returned.
        await trio.lowlevel.checkpoint_if_cancelled()
        return self._response(request, requested, produced)

    async def responses(self, request: InferRequest) -> AsyncGenerator[InferResponse, None]:
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
        order = self._plans.order(plan)
        # Not counted as an active run: a stream lasts as long as its caller reads, and an
        # unload must not wait for that; its steps then fail with ServerClosedError.
        iterations = self._streams.iterate(request, plan, order, tensors)
        async with contextlib.aclosing(iterations) as runs:
            async for produced in runs:
                yield self._response(request, requested, produced)

    def _begin(
        self, request: InferRequest, *, admitted: bool = False
    ) -> tuple[frozenset[str], Plan, dict[str, Any]]:
        """What `infer` and `stream` start from: the outputs wanted, the plan of steps for
        them, and the ensemble's input tensors (reshaped as the ensemble sees them).

        Raises:
            ServerClosedError: the ensemble is being unloaded.
        """
        if self._closing and not admitted:  # admitted: counted before the unload began
            raise ServerClosedError(f"ensemble '{self.config.name}' is being unloaded")
        requested = request.requested_outputs or frozenset(self.graph.outputs)
        plan = self._plans.plan(requested)
        # Missing counts cover the tensors steps produce; the ensemble inputs are all there
        # from the start (an omitted optional one is simply not passed on).
        tensors = {**self._constants, **request.inputs} if self._constants else dict(request.inputs)
        mbs = self.config.max_batch_size
        for tensor in self._reshaped_inputs:  # the ensemble sees an input's reshape
            if tensor.name in tensors:
                tensors[tensor.name] = apply_reshape(tensor, tensors[tensor.name], mbs)
        return requested, plan, tensors

    def _response(
        self, request: InferRequest, requested: frozenset[str], tensors: Tensors
    ) -> InferResponse:
        mbs = self.config.max_batch_size
        outputs = {t: tensors[t] for t in requested if t in tensors}
        if len(outputs) < len(requested) and _log.isEnabledFor(logging.DEBUG):
            for name in sorted(requested - outputs.keys()):  # Triton's verbose line
                _log.debug("Composing models did not output tensor %s", name)
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
            request_id=request.options.request_id,
            outputs=outputs,
            parameters=self.response_parameters(request),
        )

    def response_parameters(self, request: InferRequest) -> dict[str, ParameterValue]:
        """The parameters of a response to ``request``: a sequence's request says which, as a
        step would (a cache hit gets them here too, never from the stored entry)."""
        return request.sequence_parameters()
