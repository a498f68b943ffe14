"""A loaded model version at run time: its instances, each an actor, and its request queue.

How this works: `ModelRunner.serve` prepares every instance in a worker thread (``initialize``,
placement on the instance's device, ``jax.jit`` compilation and a warm-up call when the input
shapes are fixed), then starts one actor per instance, all receiving from one shared channel,
and reports ready. `ModelRunner.infer` puts a work item on that channel and waits for its
answer. Each instance runs one execution at a time.

Inline or thread: a tiny jitted call costs about 7 µs and a hop to a worker thread 50–100 µs,
so short executions run inline on the event loop; long ones would stall every other request,
so they run in a worker thread (JAX and most numeric code release the GIL). The choice is
measured, per instance: the median of five timed calls at load decides the start, then three
executions in a row above 500 µs move the instance to a thread, three below 100 µs bring it
back (one slow call, a garbage collection say, changes nothing). A first call for input shapes
``execute`` is not compiled for always runs in a thread: compiling can take a second.
``parameters { key: "execution" value: { string_value: "inline" | "thread" | "auto" } }``
fixes the choice per model.
"""

from __future__ import annotations

import inspect
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import jax
import numpy as np
import trio

from ..protocols import (
    InferenceError,
    InferRequest,
    InferResponse,
    InstanceKind,
    ModelLoadError,
    ModelStatistics,
    Observer,
    ServerClosedError,
    TensorChecker,
    Tensors,
    apply_reshape,
)
from ..telemetry import RequestTracing
from ._definition import Model, takes_request
from ._stats import StatsRecorder

THREAD_ABOVE_NS = 500_000
INLINE_BELOW_NS = 100_000
SWITCH_AFTER = 3
"""Consecutive executions on the other side of a threshold before an instance switches."""


@attrs.define(eq=False, slots=True)
class _Work:
    """One request waiting for (or being run by) an instance."""

    request: InferRequest
    enqueued_ns: int
    done: trio.Event = attrs.Factory(trio.Event)
    outputs: Tensors | None = None
    error: BaseException | None = None
    abandoned: bool = False
    scope: trio.CancelScope | None = None

    def abandon(self) -> None:
        """The requester went away: skip the work, or cancel it if it is running async."""
        self.abandoned = True
        if self.scope is not None:
            self.scope.cancel()


@attrs.define(eq=False)
class _Instance:
    index: int
    device: Any
    params: Any
    inline: bool
    streak: int = 0
    """Consecutive executions that argue for switching between inline and thread."""
    busy: bool = False
    compiled: set[tuple[tuple[int, ...] | None, ...]] = attrs.field(factory=set)
    """Input shape signatures ``execute`` is compiled for on this instance's device."""


def _devices(model: Model) -> list[Any]:
    """One device per instance, following ``instance_group`` (checked by `check_model`)."""
    groups = model.config.instance_group
    if not groups:
        return [jax.devices()[0]]
    devices: list[Any] = []
    for group in groups:
        if group.kind is InstanceKind.KIND_GPU:
            gpus = jax.devices("gpu")
            ids = group.gpus or tuple(range(len(gpus)))
            devices.extend(gpus[ids[i % len(ids)]] for i in range(group.count))
        elif group.kind is InstanceKind.KIND_CPU:
            devices.extend([jax.devices("cpu")[0]] * group.count)
        else:
            devices.extend([jax.devices()[0]] * group.count)
    return devices


@attrs.define(eq=False)
class ModelRunner:
    """One loaded version of a Python/JAX model: instances and their shared queue."""

    model: Model
    observer: Observer | None
    """Receives runtime events; None when nobody listens (the hot path skips the calls)."""
    tracing: RequestTracing | None = None
    """Records a ``compute`` span per execution under the request's span."""
    stats: StatsRecorder = attrs.field(init=False)
    _fn: Callable[..., Any] = attrs.field(init=False)
    _is_async: bool = attrs.field(init=False)
    _mode: str = attrs.field(init=False)
    _send: trio.MemorySendChannel[_Work] = attrs.field(init=False)
    _receive: trio.MemoryReceiveChannel[_Work] = attrs.field(init=False)
    instances: list[_Instance] = attrs.field(init=False, factory=list)
    _queued: int = attrs.field(init=False, default=0)
    checker: TensorChecker = attrs.field(init=False)
    output_names: frozenset[str] = attrs.field(init=False)
    _input_names: tuple[str, ...] = attrs.field(init=False)
    _variable_shapes: bool = attrs.field(init=False)
    _plain_arguments: bool = attrs.field(init=False)
    _takes_request: bool = attrs.field(init=False)
    _with_params: bool = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        assert self.model.execute is not None
        self.stats = StatsRecorder(self.model.name, self.model.version)
        self._is_async = inspect.iscoroutinefunction(self.model.execute)
        self._fn = jax.jit(self.model.execute) if self.model.jit else self.model.execute
        # Checked against EXECUTION_MODES by check_model before any runner is made.
        self._mode = self.model.config.parameters.get("execution", "auto")
        self._send, self._receive = trio.open_memory_channel(math.inf)
        self.checker = TensorChecker(self.model.config)
        self.output_names = frozenset(t.name for t in self.model.config.output)
        self._input_names = tuple(t.name for t in self.model.config.input)
        config = self.model.config
        self._variable_shapes = self.model.jit and (
            config.max_batch_size > 1 or any(-1 in t.dims or t.optional for t in config.input)
        )
        self._with_params = self.model.initialize is not None
        self._takes_request = takes_request(self.model)
        self._plain_arguments = (
            self.model.jit
            and not self._takes_request
            and all(t.reshape is None for t in self.model.config.input)
        )

    @property
    def config(self) -> Any:
        """The model's config."""
        return self.model.config

    @property
    def version(self) -> int:
        """The version this runner serves."""
        return self.model.version

    def statistics(self) -> ModelStatistics:
        """A snapshot of this version's statistics."""
        return self.stats.snapshot()

    # -- loading ---------------------------------------------------------------------------

    def _prepare_instances(self) -> list[_Instance]:
        """Initialise, place and compile every instance (runs in a worker thread)."""
        model = self.model
        instances = []
        for index, device in enumerate(_devices(model)):
            params = None
            if model.initialize is not None:
                try:
                    params = model.initialize(model.config)
                    if model.jit:
                        params = jax.device_put(params, device)
                except Exception as exc:
                    raise ModelLoadError(
                        f"{model.source} (model '{model.name}'): initialize failed: "
                        f"{type(exc).__name__}: {exc}"
                    ) from exc
            # Unmeasured work might block for long: start in a thread (a needless hop costs
            # ~100 µs, a needless stall of the event loop has no bound) unless timed fast.
            instance = _Instance(
                index=index, device=device, params=params, inline=self._mode == "inline"
            )
            self._warm_up(instance)
            instances.append(instance)
        return instances

    def signature(self, inputs: Tensors) -> tuple[tuple[int, ...] | None, ...]:
        """The input shapes as jit sees them (one compilation per signature)."""
        return tuple(inputs[n].shape if n in inputs else None for n in self._input_names)

    def _warm_up(self, instance: _Instance) -> None:
        """Compile ``execute`` for the declared shapes before the model reports ready.

        With ``max_batch_size > 0``, batch sizes 1 and ``max_batch_size`` are compiled; any
        other shape compiles on first use, in a worker thread (see `ready_now`).
        """
        config = self.model.config
        if not self.model.jit or any(-1 in t.dims for t in config.input):
            return  # shapes unknown until requests arrive: compiled on first use
        batches = sorted({1, config.max_batch_size}) if config.max_batch_size > 0 else [0]
        try:
            for batch in reversed(batches):
                lead = (batch,) if batch else ()
                inputs = {
                    t.name: np.zeros(lead + t.dims, dtype=t.data_type.numpy_dtype)
                    for t in config.input
                    if not t.optional
                }
                args = self._arguments(InferRequest(model_name=config.name, inputs=inputs))
                self._call(instance, args)  # compiles
                instance.compiled.add(self.signature(inputs))
            timings = []
            for _ in range(5):  # the smallest batch, compiled: time it
                start = time.perf_counter_ns()
                raw = self._call(instance, args)
                if isinstance(raw, Mapping):
                    raw = {k: np.asarray(v) for k, v in raw.items()}
                timings.append(time.perf_counter_ns() - start)
            typical = sorted(timings)[len(timings) // 2]
        except Exception as exc:
            shapes = ", ".join(f"{k}: {list(v.shape)}" for k, v in inputs.items())
            raise ModelLoadError(
                f"{self.model.source} (model '{self.model.name}'): compiling execute at load "
                f"for the declared shapes ({shapes}; a leading batch dimension of 1 and of "
                f"max_batch_size) failed: {type(exc).__name__}: {exc}"
            ) from exc
        if self._mode == "auto":
            instance.inline = typical <= THREAD_ABOVE_NS

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the instances until `close` is called and the queue is drained."""
        instances = await trio.to_thread.run_sync(self._prepare_instances)
        self.instances = instances
        async with trio.open_nursery() as nursery:
            async with self._receive:
                for instance in instances:
                    await nursery.start(self._serve_instance, instance, self._receive.clone())
            task_status.started()

    def close(self) -> None:
        """Stop accepting work; instances finish what is queued, then end."""
        self._send.close()

    # -- running ---------------------------------------------------------------------------

    def _call(self, instance: _Instance, inputs: Mapping[str, Any]) -> Any:
        if self._with_params:
            return self._fn(instance.params, **inputs)
        return self._fn(**inputs)

    def _arguments(self, request: InferRequest) -> Mapping[str, Any]:
        """The keyword arguments of ``execute`` for ``request``.

        Plain-Python models get read-only views: an array can be shared with a sibling step
        or be the caller's own, so writing into it would corrupt someone else's data.
        """
        inputs = request.inputs
        if self._plain_arguments:
            return inputs
        config = self.model.config
        args: dict[str, Any] = {}
        for tensor in config.input:
            value = inputs.get(tensor.name)
            if value is None:
                continue
            value = apply_reshape(tensor, value, config.max_batch_size)
            if not self.model.jit and isinstance(value, np.ndarray):
                value = value.view()
                value.flags.writeable = False
            args[tensor.name] = value
        if self._takes_request:
            # The request the model sees holds the same read-only views as its arguments.
            args["request"] = request.derive(
                model_name=request.model_name,
                model_version=request.model_version,
                inputs=dict(args),
                requested_outputs=request.requested_outputs,
            )
        return args

    def _execute_sync(
        self, instance: _Instance, request: InferRequest
    ) -> tuple[Tensors, int, int, int]:
        t0 = time.perf_counter_ns()
        t1 = t0
        try:
            args = self._arguments(request)
            t1 = time.perf_counter_ns()
            raw = self._call(instance, args)
            if type(raw) is dict or isinstance(raw, Mapping):
                # np.asarray waits for JAX's asynchronous dispatch to finish.
                raw = {k: np.asarray(v) for k, v in raw.items()}
        except Exception as exc:
            raise self._error(exc) from exc
        t2 = time.perf_counter_ns()
        outputs = self._checked(raw)
        t3 = time.perf_counter_ns()
        return outputs, t1 - t0, t2 - t1, t3 - t2

    async def _execute_async(
        self, instance: _Instance, request: InferRequest
    ) -> tuple[Tensors, int, int, int]:
        t0 = time.perf_counter_ns()
        t1 = t0
        try:
            args = self._arguments(request)
            t1 = time.perf_counter_ns()
            raw = await self._call(instance, args)
        except Exception as exc:
            raise self._error(exc) from exc
        t2 = time.perf_counter_ns()
        outputs = self._checked(raw)
        t3 = time.perf_counter_ns()
        return outputs, t1 - t0, t2 - t1, t3 - t2

    def _error(self, exc: Exception) -> InferenceError:
        return InferenceError(
            f"model '{self.model.name}' (version {self.model.version}) failed: "
            f"{type(exc).__name__}: {exc}",
            model_name=self.model.name,
        )

    def _checked(self, raw: Any) -> Tensors:
        try:
            return self.checker.outputs(raw)
        except Exception as exc:  # whatever converting the model's result raised
            raise InferenceError(
                f"model '{self.model.name}' (version {self.model.version}) returned a bad "
                f"result: {exc}",
                model_name=self.model.name,
            ) from exc

    def _learn(self, instance: _Instance, duration_ns: int) -> None:
        """Move the instance between inline and thread on sustained evidence only: a garbage
        collection or a busy machine can make one call of a tiny model take milliseconds."""
        if self._mode != "auto":
            return
        crossing = (
            duration_ns > THREAD_ABOVE_NS if instance.inline else duration_ns < INLINE_BELOW_NS
        )
        instance.streak = instance.streak + 1 if crossing else 0
        if instance.streak >= SWITCH_AFTER:
            instance.inline = not instance.inline
            instance.streak = 0

    def _record(
        self,
        instance: _Instance,
        queue_ns: int,
        result: tuple[Tensors, int, int, int] | None,
        elapsed: int,
        batch: int,
        learn: bool = True,
        request: InferRequest | None = None,
        started: int = 0,
    ) -> None:
        if learn and not self._is_async:
            # The execution itself, not the trip to a worker thread and back.
            self._learn(instance, sum(result[1:]) if result is not None else elapsed)
        if result is not None:
            self.stats.execution_finished(queue_ns, *result[1:])
        else:
            self.stats.execution_finished(queue_ns, 0, elapsed, 0)
        if self.observer is not None:
            self.observer.execution_finished(
                self.model.name, self.model.version, batch, queue_ns, elapsed
            )
        if self.tracing is not None and request is not None and self.tracing.traced(request):
            attributes = {"orchestrion.batch_size": batch, "orchestrion.queue_us": queue_ns // 1000}
            self.tracing.record(
                "compute", request, started, started + elapsed, attributes, result is None
            )

    async def _serve_instance(
        self,
        instance: _Instance,
        receive: trio.MemoryReceiveChannel[_Work],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        async with receive:
            task_status.started()
            try:
                async for work in receive:
                    self._queued -= 1
                    if not work.abandoned:
                        await self._run_work(instance, work)
            finally:
                # Stopped from outside (the server's nursery was cancelled): answer what is
                # still queued, so that no caller waits forever.
                while True:
                    try:
                        work = receive.receive_nowait()
                    except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                        break
                    self._queued -= 1
                    work.error = ServerClosedError("the server is shutting down")
                    work.done.set()

    async def _run_work(self, instance: _Instance, work: _Work) -> None:
        instance.busy = True
        started = time.perf_counter_ns()
        result: tuple[Tensors, int, int, int] | None = None
        compiling = False
        if self.model.jit:
            signature = self.signature(work.request.inputs)
            compiling = signature not in instance.compiled
        try:
            with trio.CancelScope() as work.scope:
                if self._is_async:
                    result = await self._execute_async(instance, work.request)
                elif instance.inline and not compiling:
                    result = self._execute_sync(instance, work.request)
                else:
                    result = await trio.to_thread.run_sync(
                        self._execute_sync, instance, work.request
                    )
        except InferenceError as exc:
            work.error = exc
        except Exception as exc:  # a bug of ours must fail this request, not the server
            work.error = self._error(exc)
            work.error.__cause__ = exc
        except BaseException:
            work.error = ServerClosedError("the server is shutting down")
            work.done.set()
            raise
        finally:
            work.scope = None
            instance.busy = False
        if compiling and result is not None:
            instance.compiled.add(signature)
        if result is not None:
            work.outputs = result[0]
        batch = batch_size(self.model.config.max_batch_size, work.request.inputs)
        elapsed = time.perf_counter_ns() - started
        # A compilation says nothing about how long executions take.
        queue_ns = started - work.enqueued_ns
        self._record(
            instance, queue_ns, result, elapsed, batch, not compiling, work.request, started
        )
        work.done.set()

    def ready_now(self, inputs: Tensors) -> bool:
        """Whether `infer_now` can run these inputs at once: nobody is queued ahead and an
        inline instance is idle, with ``execute`` already compiled for these shapes (a
        compilation can take a second: it never runs on the event loop)."""
        if self._is_async or self._queued:
            return False
        return self._idle_instance(inputs) is not None

    def _idle_instance(self, inputs: Tensors) -> _Instance | None:
        # Fixed shapes were compiled at load: only variable ones need their signature.
        signature = self.signature(inputs) if self._variable_shapes else None
        for instance in self.instances:
            compiled = signature is None or signature in instance.compiled
            if instance.inline and not instance.busy and compiled:
                return instance
        return None

    def infer_now(self, request: InferRequest) -> InferResponse:
        """Run ``request`` in the caller's task on an idle inline instance.

        Only valid right after `ready_now` returned True. Running short synchronous work
        where it already is saves the two task switches of a trip through the queue.

        Raises:
            InferenceError: ``execute`` raised or returned a bad result.
        """
        instance = self._idle_instance(request.inputs)
        assert instance is not None, "infer_now without ready_now"
        instance.busy = True
        started = time.perf_counter_ns()
        result: tuple[Tensors, int, int, int] | None = None
        try:
            result = self._execute_sync(instance, request)
        finally:
            instance.busy = False
            batch = batch_size(self.model.config.max_batch_size, request.inputs)
            elapsed = time.perf_counter_ns() - started
            self._record(instance, 0, result, elapsed, batch, True, request, started)
        return self._response(request, result[0])

    async def infer(self, request: InferRequest) -> InferResponse:
        """Run ``request`` (inputs already checked) on the next free instance.

        Raises:
            InferenceError: ``execute`` raised or returned a bad result.
            ServerClosedError: the model is being unloaded.
        """
        work = _Work(request=request, enqueued_ns=time.perf_counter_ns())
        try:
            self._send.send_nowait(work)
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            raise ServerClosedError(f"model '{self.model.name}' is being unloaded") from None
        self._queued += 1
        try:
            await work.done.wait()
        except BaseException:
            work.abandon()
            raise
        if work.error is not None:
            raise work.error
        return self._response(request, work.outputs or {})

    def _response(self, request: InferRequest, outputs: Tensors) -> InferResponse:
        wanted = request.requested_outputs
        if wanted is not None and any(k not in wanted for k in outputs):
            outputs = {k: v for k, v in outputs.items() if k in wanted}
        return InferResponse(
            model_name=self.model.name,
            model_version=self.model.version,
            request_id=request.request_id,
            outputs=outputs,
        )


def batch_size(max_batch_size: int, inputs: Tensors) -> int:
    """The number of inferences in a request: its batch size, or 1 without batching."""
    if max_batch_size <= 0 or not inputs:
        return 1
    return int(next(iter(inputs.values())).shape[0])
