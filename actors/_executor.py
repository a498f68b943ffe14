"""A model version's executions: its instances, each execution run inline, in a worker
thread or awaited, and counted in one place (statistics, the observer, the requests'
traces, what the instance learns of its speed).

The parts that decide what runs and when (the runner's queue in ``_runner.py``, the dynamic
batcher, a stateful model's sequence batcher, a decoupled model's streams, an ensemble's
fused call) receive the `Executor` and call it; none of them calls back into the runner.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import trio

from ..backends import Backend, Capabilities
from ..protocols import (
    InferenceError,
    InferRequest,
    Model,
    ModelConfig,
    Observer,
    ServerClosedError,
    TensorChecker,
    Tensors,
)
from ..telemetry import RequestTracing
from ._batch_queue import batch_size
from ._instances import Instance, Instances, Timings, Work
from ._stats import StatsRecorder
from ._watchdog import LoopHolder


@attrs.define(eq=False)
class Executor:
    """Runs and counts one model version's executions on its instances."""

    model: Model
    backend: Backend
    """How the model's code runs (`orchestrion.backends`)."""
    pool: Instances
    """The model's instances, and one execution on one of them."""
    stats: StatsRecorder
    observer: Observer | None
    """Receives runtime events; None when nobody listens (the hot path skips the calls)."""
    tracing: RequestTracing | None
    """Records a ``compute`` span per execution under the request's span."""
    checker: TensorChecker
    """Checks tensors against the model's config (a fused call checks its outputs)."""
    output_names: frozenset[str] = attrs.field(init=False)
    queued: int = 0
    """Requests waiting for an instance (on the runner's channel, in a batching queue or a
    sequence batcher's), not yet running."""
    closing: bool = False
    """The version is being unloaded: no new work is taken."""

    def __attrs_post_init__(self) -> None:
        self.output_names = frozenset(t.name for t in self.model.config.output)

    @property
    def config(self) -> ModelConfig:
        """The model's config."""
        return self.model.config

    @property
    def capabilities(self) -> Capabilities:
        """What the model's code can do (its backend's)."""
        return self.backend.capabilities

    @property
    def instances(self) -> list[Instance]:
        """The model's instances (empty until they are loaded)."""
        return self.pool.all

    @property
    def batches(self) -> bool:
        """Its requests are batched dynamically (the runner gives it a `Batcher`)."""
        return self.capabilities.batching and self.model.config.dynamic_batching is not None

    def record(
        self,
        instance: Instance,
        queue_ns: int,
        timings: Timings | None,
        elapsed: int,
        batch: int,
        learn: bool = True,
        requests: list[InferRequest] | None = None,
        started: int = 0,
    ) -> None:
        """Count one execution (``timings`` None: it failed) in the statistics, the
        observer and the requests' traces; let the instance learn from its duration."""
        if learn and not self.capabilities.is_async:
            # The execution itself, not the trip to a worker thread and back.
            instance.learn(sum(timings) if timings is not None else elapsed)
        count = len(requests) if requests else 1
        if timings is not None:
            self.stats.execution_finished(queue_ns, *timings, requests=count, batch_size=batch)
        else:
            self.stats.execution_finished(queue_ns, 0, elapsed, 0, count, batch)
        if self.observer is not None:
            self.observer.execution_finished(
                self.model.name, self.model.version, batch, queue_ns, elapsed
            )
        if self.tracing is not None and requests:
            for request in requests:
                if self.tracing.traced(request):
                    attributes = {"orchestrion.batch_size": batch}
                    self.tracing.record(
                        "compute", request, started, started + elapsed, attributes, timings is None
                    )

    async def run_work(
        self,
        instance: Instance,
        work: Work,
        inferences: int | None = None,
        members: list[Work] | None = None,
    ) -> None:
        """Run one work item (a request, or a batch's joined requests: ``members``) on
        ``instance``: inline, in a worker thread or awaited, as the instance runs now."""
        instance.busy = True
        started = time.perf_counter_ns()
        result: tuple[Tensors, Timings] | None = None
        signature = self.backend.signature(work.request.inputs)
        compiling = not instance.compiled_for(signature)
        pool = self.pool
        try:
            with trio.CancelScope() as work.scope:
                if self.capabilities.is_async:
                    result = await pool.run_async(instance, work.request, work)
                elif instance.inline and not compiling:
                    await pool.portal()
                    result = pool.run_inline(instance, work.request, work)
                else:
                    result = await trio.to_thread.run_sync(
                        pool.run_sync, instance, work.request, work
                    )
        except InferenceError as exc:
            work.error = exc
        except Exception as exc:  # a bug of ours must fail this request, not the server
            work.error = pool.error(exc)
            work.error.__cause__ = exc
        except BaseException:
            work.error = ServerClosedError("the server is shutting down")
            work.done.set()
            raise
        finally:
            work.scope = None
            instance.busy = False
        if compiling and result is not None:
            instance.loaded.compiled.add(signature)
        if result is not None:
            work.outputs = result[0]
        batch = inferences or batch_size(self.model.config.max_batch_size, work.request.inputs)
        elapsed = time.perf_counter_ns() - started
        if members is None:
            queue_ns = started - work.enqueued_ns
            requests = [work.request]
        else:  # a batch: each request's own wait, and a compute span under each request
            queue_ns = sum(started - m.enqueued_ns for m in members)
            requests = [m.request for m in members]
        timings = result[1] if result is not None else None
        # A compilation says nothing about how long executions take.
        self.record(instance, queue_ns, timings, elapsed, batch, not compiling, requests, started)
        work.done.set()

    async def run_listed(self, instance: Instance, works: list[Work]) -> None:
        """Run a batch's requests as one execution of a backend that answers each request
        itself (`Capabilities.request_lists`): each work gets its outputs or its own error."""
        instance.busy = True
        started = time.perf_counter_ns()
        requests = [w.request for w in works]
        timings: Timings | None = None
        outcomes: list[Tensors | InferenceError]
        try:
            outcomes, timings = await self.pool.run_listed(instance, requests)
        except InferenceError as exc:
            outcomes = [exc] * len(works)
        except BaseException:
            for work in works:
                work.error = ServerClosedError("the server is shutting down")
            raise
        finally:
            instance.busy = False
        for work, outcome in zip(works, outcomes, strict=True):
            if isinstance(outcome, InferenceError):
                work.error = outcome
            else:
                work.outputs = outcome
        max_batch = self.model.config.max_batch_size
        batch = sum(batch_size(max_batch, r.inputs) for r in requests)
        queue_ns = sum(started - w.enqueued_ns for w in works)
        elapsed = time.perf_counter_ns() - started
        # Its own time (timed in its thread) decides inline or thread: short comes inline.
        self.record(instance, queue_ns, timings, elapsed, batch, True, requests, started)

    # -- an ensemble's fused call: one step at a time, inline, counted here -----------------

    def idle(self) -> bool:
        """Nothing queued (on the channel, in a batcher's queue), and some instance can run
        inline now."""
        if self.queued:
            return False
        for instance in self.pool.all:  # noqa: SIM110 (no generator: it runs per request)
            if instance.inline and not instance.busy:
                return True
        return False

    def free_inline(self) -> Instance | None:
        """An instance that runs inline and is free now; None: none is."""
        instances = self.pool.all
        if len(instances) == 1:  # the common case, without a generator per step
            instance = instances[0]
            return instance if instance.inline and not instance.busy else None
        return next((i for i in instances if i.inline and not i.busy), None)

    def run_fused(
        self, instance: Instance, args: Tensors, checking: bool, holder: LoopHolder
    ) -> Mapping[str, Any] | None:
        """One execution of ``args`` on ``instance``, inline now, for a fused call (the
        watchdog's ``holder`` names this model meanwhile); ``checking``: its outputs are
        checked against the config, and a batching model's give a row per input row. None:
        it cannot run fused (its shapes are not compiled yet, it raised, or its outputs
        break the config), and the scheduler runs the request again, which reports it."""
        backend = self.backend
        if checking and not instance.compiled_for(backend.signature(args)):
            return None  # the scheduler compiles new shapes, in a worker thread
        outer, holder.runs = holder.runs, self.pool
        try:
            outputs: Mapping[str, Any] = backend.execute(instance.loaded, args)[0]
            if type(outputs) is not dict and not isinstance(outputs, Mapping):
                return None
            if checking:
                outputs = self.checker.outputs(outputs)
        except Exception:  # the scheduler runs it again, and reports it
            return None
        finally:
            holder.runs = outer
        if checking and self.batches:  # as its batcher: a row per row
            batch = next(iter(args.values())).shape[0]
            if any(v.ndim == 0 or v.shape[0] != batch for v in outputs.values()):
                return None
        return outputs

    def count_fused(self, instance: Instance | None, elapsed: int, rows: Sequence[int]) -> None:
        """Count one fused execution of this step: ``rows`` holds each request's rows, run
        in ``elapsed`` ns; ``instance`` learns from it (None: its share of one compiled call
        of every step, which says nothing of its own speed)."""
        if instance is not None:
            instance.learn(elapsed)
        self.stats.executed_together(elapsed, rows)

    def request_finished(self, error: BaseException | None, elapsed: int, rows: int) -> None:
        """Count one request this model answered (``error``: refused or failed) outside its
        queue (an ensemble's fused call)."""
        self.stats.request_finished(error, elapsed, rows)

    def run_listed_now(
        self, instance: Instance, requests: list[InferRequest]
    ) -> tuple[list[Tensors | InferenceError], int]:
        """One execution of ``requests`` on ``instance``, inline now, by a backend that
        answers each request itself (`Capabilities.request_lists`), counted: each
        request's outputs or its own error, and the time it took."""
        max_batch = self.model.config.max_batch_size
        rows = sum(batch_size(max_batch, r.inputs) for r in requests)
        instance.busy = True
        started = time.perf_counter_ns()
        timings = None
        outcomes: list[Tensors | InferenceError]
        try:
            outcomes, timings = self.pool.run_listed_inline(instance, requests)
        except InferenceError as exc:
            outcomes = [exc] * len(requests)
        finally:
            instance.busy = False
        elapsed = time.perf_counter_ns() - started
        self.record(instance, 0, timings, elapsed, rows, True, requests, started)
        return outcomes, elapsed

    @property
    def runs_listed_inline(self) -> bool:
        """Its backend takes lists of requests and may run them inline in any task (Triton's
        python backend, without BLS calls waiting through a portal)."""
        capabilities = self.capabilities
        return (
            capabilities.takes_request
            and capabilities.may_run_inline
            and not capabilities.waits_through_portal
            and hasattr(self.backend, "execute_requests")
        )

    def traceable(self) -> Callable[..., Mapping[str, Any]]:
        """``fn(params, **inputs)``: the model's code as JAX can trace it (a fused call of
        every step in one compiled function)."""
        return self.backend.traceable()

    @property
    def padded_sizes(self) -> tuple[int, ...]:
        """The batch sizes it compiles and pads to (empty: any)."""
        return self.backend.padded_sizes

    @property
    def params(self) -> Any:
        """Its first instance's parameters (what ``initialize`` returned, placed)."""
        return self.pool.all[0].loaded.params
