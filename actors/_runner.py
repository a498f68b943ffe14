"""A loaded model version at run time: its instances, each an actor, and its request queue.

How this works: `ModelRunner.serve` loads every instance through the model's backend in a
worker thread (``orchestrion.backends``: ``initialize``, placement on the instance's device,
compilation and a warm-up call when the input shapes are fixed), then starts one actor per
instance, all receiving from one shared channel, and reports ready. `ModelRunner.infer` puts
a work item on that channel and waits for its answer. Each instance runs one execution at a
time, inline on the event loop or in a worker thread (``_instances.py`` decides and says
why). The parts with a concept of their own live beside it: the dynamic batcher
(``_batcher.py``, which then reads the channel instead of the instances), a stateful model's
sequences (``_sequences.py``) and a decoupled model's streams (``_streams.py``).

Fast paths skip the channel when nothing would be gained by it, and `ModelRunner.infer`
alone chooses: a request runs in the caller's task on an idle inline instance when nothing
is queued ahead (`ready_now` says when, `infer_now` runs it; an ensemble's step actors ask
the same), and `run_alone` lets a lone request of a batching model skip the batcher at
light load. A cached model's misses take the same paths.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import AsyncGenerator, Mapping, Sequence
from typing import ClassVar

import attrs
import trio

from ..backends import Backend, Capabilities, ServerCalls, backend_for, split_outputs
from ..protocols import (
    CustomMetricFamily,
    InferRequest,
    InferResponse,
    Model,
    ModelConfig,
    ModelStatistics,
    Observer,
    ParameterValue,
    ServerClosedError,
    StepStatistics,
    TensorChecker,
    Tensors,
    error_of,
    model_facing,
    parameters_of,
    sent_final,
)
from ..telemetry import RequestTracing
from ._batch_queue import BatchQueue, batch_size, rows_of
from ._batcher import Batcher
from ._executor import Executor
from ._instances import Instance, Instances, Timings, Work
from ._sequence_batcher import SequenceBatcher
from ._sequences import Sequences
from ._stats import StatsRecorder
from ._streams import Streams


@attrs.define(eq=False)
class ModelRunner:
    """One loaded version of a model: its backend, instances and their shared queue."""

    is_ensemble: ClassVar[bool] = False

    model: Model
    observer: Observer | None
    """Receives runtime events; None when nobody listens (the hot path skips the calls)."""
    tracing: RequestTracing | None = None
    """Records a ``compute`` span per execution under the request's span."""
    calls: ServerCalls | None = None
    """What the model's code may call on the server (BLS); None: nothing."""
    executor: Executor = attrs.field(init=False)
    """Runs and counts the executions (the batcher, sequences and streams share it)."""
    backend: Backend = attrs.field(init=False)
    """How the model's code runs (`orchestrion.backends`; the executor's)."""
    pool: Instances = attrs.field(init=False)
    """The model's instances (the executor's)."""
    stats: StatsRecorder = attrs.field(init=False)
    """This version's statistics (the executor's; `keep_counting` hands another on)."""
    output_names: frozenset[str] = attrs.field(init=False)
    checker: TensorChecker = attrs.field(init=False)
    batcher: Batcher | None = attrs.field(init=False, default=None)
    """The dynamic batcher of a model that batches (None: one request per execution)."""
    sequences: Sequences | None = attrs.field(init=False, default=None)
    """A stateful model's sequences, its state passed through ``execute`` (None: not
    stateful, or stateful as Triton's backends are: `sequence_batcher`)."""
    sequence_batcher: SequenceBatcher | None = attrs.field(init=False, default=None)
    """The sequence batcher of a model whose controls and state are tensors (Triton's)."""
    streams: Streams = attrs.field(init=False)
    _send: trio.MemorySendChannel[Work] = attrs.field(init=False)
    _receive: trio.MemoryReceiveChannel[Work] = attrs.field(init=False)
    _sweeper: trio.CancelScope | None = attrs.field(init=False, default=None)
    _alone_candidates: int = attrs.field(init=False, default=0)
    """Requests in `run_alone`'s checkpoint now (more than one: they batch instead)."""
    _inline_now: bool = attrs.field(init=False, default=False)
    """Its requests may run at once in the caller's task (see `ready_now`): stateless, not
    a stream, not batching, code that neither awaits nor waits through a portal."""

    def __attrs_post_init__(self) -> None:
        config = self.model.config
        stats = StatsRecorder(self.model.name, self.model.version)
        backend = backend_for(self.model, self.calls)
        self.checker = TensorChecker(config)
        # Outputs are checked as the model gives them: its state outputs among them.
        facing, shapes = model_facing(config), not backend.capabilities.output_shapes_as_given
        outputs = self.checker if facing is config and shapes else TensorChecker(facing, shapes)
        pool = Instances(backend, self.model.name, self.model.version, outputs)
        self.executor = Executor(
            self.model, backend, pool, stats, self.observer, self.tracing, self.checker
        )
        self.backend, self.pool, self.stats = backend, pool, stats
        self.output_names = self.executor.output_names
        self._send, self._receive = trio.open_memory_channel(math.inf)
        self.streams = Streams(self.executor)
        if self.capabilities.sequence_tensors:
            self.sequence_batcher = SequenceBatcher.of(
                self.executor, dict(self.model.initial_states)
            )
        elif self.capabilities.stateful:
            self.sequences = Sequences.of(config, self.backend.initial_state, self._submit)
        if self.executor.batches:
            self.batcher = Batcher(self.executor, BatchQueue(config), self.backend.padded_sizes)
        capabilities = self.capabilities
        self._inline_now = (
            not capabilities.stateful
            and not capabilities.streaming
            and self.pool.inline_now_allowed
            and self.batcher is None
        )

    @property
    def config(self) -> ModelConfig:
        """The model's config."""
        return self.model.config

    @property
    def queued(self) -> int:
        """Requests waiting for an instance, not yet running (the executor's count)."""
        return self.executor.queued

    def keep_counting(self, recorder: StatsRecorder) -> None:
        """Count from now on in ``recorder`` (a reload hands the old version's on)."""
        self.stats = self.executor.stats = recorder

    @property
    def version(self) -> int:
        """The version this runner serves."""
        return self.model.version

    @property
    def capabilities(self) -> Capabilities:
        """What the model's code can do (its backend's)."""
        return self.backend.capabilities

    @property
    def instances(self) -> list[Instance]:
        """The model's instances (empty until `serve` has loaded them)."""
        return self.pool.all

    @property
    def revision(self) -> str:
        """The fingerprint of the code and config this runner runs (`Model.revision`)."""
        return self.model.revision

    @property
    def labels(self) -> Mapping[str, Sequence[str]]:
        """Class labels per output (`Model.labels`)."""
        return self.model.labels

    def statistics(self) -> ModelStatistics:
        """A snapshot of this version's statistics."""
        return self.stats.snapshot()

    # -- lifetime --------------------------------------------------------------------------

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the instances until `close` is called and the queue is drained."""
        from ._load_lock import passing_holds
        from ._watchdog import loop_holder

        self.pool.holder = loop_holder()  # the loop this runner's inline work holds
        try:
            await trio.to_thread.run_sync(passing_holds(self.pool.load))  # see _load_lock
        except BaseException:
            self.backend.close()  # what a load that failed (or was cancelled) acquired
            raise
        self.streams.size(len(self.instances))
        try:
            # The backend's own tasks (`Backend.run`) outlive the instances' last execution.
            async with trio.open_nursery() as backend_nursery:
                await backend_nursery.start(self.backend.run)
                try:
                    await self._serve_instances(task_status)
                finally:
                    backend_nursery.cancel_scope.cancel()
        finally:
            self.backend.close()

    async def _serve_instances(self, task_status: trio.TaskStatus[None]) -> None:
        """Run the instances (or the batcher) and the sequences' sweeper until closed."""
        async with trio.open_nursery() as nursery:
            if self.sequence_batcher is not None:
                self._receive.close()  # its requests go to slots, not through the channel
                await nursery.start(self.sequence_batcher.serve, self.instances)
            elif self.batcher is not None:
                await nursery.start(self.batcher.serve, self._receive, self.instances)
            else:
                async with self._receive:
                    for instance in self.instances:
                        receive = self._receive.clone()
                        await nursery.start(self._serve_instance, instance, receive)
            if self.sequences is not None:
                self._sweeper = trio.CancelScope()
                nursery.start_soon(self._run_sweeper, self.sequences, self._sweeper)
            task_status.started()

    @staticmethod
    async def _run_sweeper(sequences: Sequences, scope: trio.CancelScope) -> None:
        with scope:
            await sequences.sweep()

    def begin_close(self) -> None:
        """Stop accepting work; instances finish what is queued, then end. Streams still
        open end with `ServerClosedError` (one lasts while its caller reads: maybe never)."""
        self.executor.closing = True
        self._send.close()  # open streams end with ServerClosedError at their next step
        if self.sequence_batcher is not None:
            self.sequence_batcher.close()
        if self._sweeper is not None:
            self._sweeper.cancel()

    async def close(self) -> None:
        """`begin_close`; nothing to wait for here (its instances end as its queue drains,
        in `serve`)."""
        self.begin_close()
        await trio.lowlevel.checkpoint()

    @property
    def drained(self) -> bool:
        """A model's runner never keeps other models in use while it closes (only an
        ensemble's runs do)."""
        return True

    def step_statistics(self) -> tuple[StepStatistics, ...]:
        """A model has no steps."""
        return ()

    def custom_metrics(self) -> list[CustomMetricFamily]:
        """The metric families the model's code made."""
        return self.backend.custom_metrics()

    async def passes_own_check(self) -> bool:
        """The model's code's own readiness check (`Backend.ready`: a python-backend
        model's ``is_ready()``)."""
        return await self.backend.ready()

    # -- running ---------------------------------------------------------------------------

    async def _serve_instance(
        self,
        instance: Instance,
        receive: trio.MemoryReceiveChannel[Work],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        async with receive:
            task_status.started()
            try:
                async for work in receive:
                    self.executor.queued -= 1
                    if not work.abandoned:
                        await self.executor.run_work(instance, work)
            finally:
                # Stopped from outside: answer what is still queued (no caller waits forever).
                while True:
                    try:
                        work = receive.receive_nowait()
                    except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                        break
                    self.executor.queued -= 1
                    work.error = ServerClosedError("the server is shutting down")
                    work.done.set()

    # -- fast paths ------------------------------------------------------------------------

    def ready_now(self, inputs: Tensors) -> bool:
        """Whether `infer_now` can run these inputs at once: nobody is queued ahead and an
        inline instance is idle, with ``execute`` already compiled for these shapes (a
        compilation can take a second: it never runs on the event loop)."""
        if not self._inline_now or self.executor.queued:
            return False
        return self.pool.idle_inline(inputs) is not None

    def may_run_alone(self, inputs: Tensors) -> bool:
        """Whether a request for this batching model may skip the batcher: no queue delay
        (the batcher would not wait for company), no ``preserve_ordering`` (the batcher
        keeps that order), nothing queued, the load light (the last batch held one
        request) and an inline instance free and compiled for these shapes. `run_alone`
        then decides."""
        batching = self.model.config.dynamic_batching
        batcher = self.batcher
        if batching is None or batcher is None or not self.pool.inline_now_allowed:
            return False
        if batching.max_queue_delay_microseconds or batching.preserve_ordering:
            return False
        if self.executor.queued or len(batcher.queue) or batcher.last_batch > 1:
            return False
        return self.pool.idle_inline(inputs) is not None

    async def run_alone(self, request: InferRequest) -> InferResponse | None:
        """Run ``request`` in the caller's task if, after one checkpoint (which lets every
        request of the same scheduling pass arrive), no other request wants the model:
        the batcher would then run it alone and at once anyway; this skips its hops (about
        45 µs per request here). None: the request must go through the batcher.

        Raises:
            InferenceError: ``execute`` raised or returned a bad result.
        """
        self._alone_candidates += 1
        try:
            await trio.lowlevel.checkpoint()
            alone = self._alone_candidates == 1 and self.may_run_alone(request.inputs)
        finally:
            self._alone_candidates -= 1
        return self.infer_now(request) if alone else None

    def infer_now(self, request: InferRequest, instance: Instance | None = None) -> InferResponse:
        """Run ``request`` in the caller's task on an idle inline instance (``instance``,
        or the one `ready_now` found).

        Only valid right after `ready_now` (or `may_run_alone`) returned True. Running short
        synchronous work where it already is saves the two task switches of a trip through
        the queue.

        Raises:
            InferenceError: ``execute`` raised or returned a bad result.
        """
        if instance is None:
            instance = self.pool.idle_inline(request.inputs)
            assert instance is not None, "infer_now without ready_now"
        instance.busy = True
        started = time.perf_counter_ns()
        result: tuple[Tensors, Timings] | None = None
        try:
            result = self.pool.run_inline(instance, request, None)
        finally:
            instance.busy = False
            batch = batch_size(self.model.config.max_batch_size, request.inputs)
            elapsed = time.perf_counter_ns() - started
            timings = result[1] if result is not None else None
            self.executor.record(instance, 0, timings, elapsed, batch, True, [request], started)
        outputs = result[0]
        if self.batcher is not None and not self.capabilities.request_lists:
            # As the batcher does: the request's own rows, and one row per input row.
            try:
                outputs = split_outputs(outputs, [rows_of(request)])[0]
            except ValueError as exc:
                raise self.pool.bad_batch(exc) from None
        return self._response(request, outputs)

    # -- the queue -------------------------------------------------------------------------

    async def infer(self, request: InferRequest) -> InferResponse:
        """Run ``request`` (inputs already checked) the quickest way that keeps the model's
        order: at once in this task on an idle inline instance when nothing is queued
        ahead; for a batching model at light load, alone past its batcher (`run_alone`);
        else through the model's queue, on the next free instance.

        Raises:
            InferenceError: ``execute`` raised or returned a bad result.
            ServerClosedError: the model is being unloaded.
        """
        if self._inline_now and not self.executor.queued:
            instance = self.pool.idle_inline(request.inputs)
            if instance is not None:
                await trio.lowlevel.checkpoint_if_cancelled()
                response = self.infer_now(request, instance)
                await trio.lowlevel.checkpoint()  # a result past a deadline is cancelled
                return response
        elif self.may_run_alone(request.inputs):
            alone = await self.run_alone(request)
            if alone is not None:
                await trio.lowlevel.checkpoint()  # a result past a deadline is cancelled
                return alone
        response = await self._queued(request)
        # The answer came from another task; a deadline that passed meanwhile has been
        # seen by now: a late result is cancelled, not returned.
        await trio.lowlevel.checkpoint_if_cancelled()
        return response

    async def _queued(self, request: InferRequest) -> InferResponse:
        """`infer` through the model's queue (its batcher, its sequences)."""
        if self.sequence_batcher is not None:
            work = await self.sequence_batcher.run(request)
        elif self.sequences is not None:
            work = await self.sequences.run(request)
        else:
            work = Work(request=request, enqueued_ns=time.perf_counter_ns())
            await self._submit(work)
        return self._response(request, work.outputs or {})

    async def _submit(self, work: Work) -> None:
        """Queue ``work`` and wait until it is done.

        Raises:
            InferenceError: ``execute`` raised or returned a bad result.
            ServerClosedError: the model is being unloaded.
            QueueFullError: a batching model's queue is full.
        """
        queue = self.batcher.queue if self.batcher is not None else None
        if queue is not None:
            queue.admit(work)
        try:
            self._send.send_nowait(work)
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            if queue is not None:
                queue.withdraw(work)
            raise ServerClosedError(f"model '{self.model.name}' is being unloaded") from None
        self.executor.queued += 1
        try:
            await work.done.wait()
        except BaseException:
            work.abandon()
            if queue is not None:
                queue.withdraw(work)  # frees its max_queue_size place at once
            raise
        if work.error is not None:
            raise work.error

    async def responses(self, request: InferRequest) -> AsyncGenerator[InferResponse, None]:
        """Each response a decoupled model yields for ``request``, as they come (see
        ``_streams.py``).

        Raises:
            InferenceError: ``execute`` raised (after the responses it yielded before).
            ServerClosedError: the model is being unloaded (also mid-stream).
        """
        async with contextlib.aclosing(self.streams.stream(request)) as outputs:
            async for produced in outputs:
                yield self._response(request, produced)

    def _response(self, request: InferRequest, outputs: Tensors) -> InferResponse:
        parameters = self.response_parameters(request, parameters_of(outputs))
        final, wanted = sent_final(outputs), request.requested_outputs
        error = error_of(outputs)  # an error response the stream goes on after (no outputs)
        if wanted is not None and any(k not in wanted for k in outputs):
            outputs = {k: v for k, v in outputs.items() if k in wanted}
        return InferResponse(
            model_name=self.model.name,
            model_version=self.model.version,
            request_id=request.options.request_id,
            outputs=outputs,
            parameters=parameters,
            final=final,
            error=error,
        )

    def response_parameters(
        self, request: InferRequest, own: Mapping[str, ParameterValue] | None = None
    ) -> dict[str, ParameterValue]:
        """The parameters of a response to ``request``: those the model set (``own``), and
        a stateful model's say which sequence it answered (a cache hit gets them here,
        never from the entry)."""
        merged = dict(own) if own else {}
        if self.sequences is not None or self.sequence_batcher is not None:
            merged.update(request.sequence_parameters())
        return merged
