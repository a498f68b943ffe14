"""A loaded model version at run time: its instances, each an actor, and its request queue.

How this works: `ModelRunner.serve` prepares every instance in a worker thread (``initialize``,
placement on the instance's device, ``jax.jit`` compilation and a warm-up call when the input
shapes are fixed), then starts one actor per instance, all receiving from one shared channel,
and reports ready. `ModelRunner.infer` puts a work item on that channel and waits for its
answer. Each instance runs one execution at a time.

Inline or thread: a tiny jitted call costs about 7 µs and a hop to a worker thread 50–100 µs,
so short executions run inline on the event loop; long ones would stall every other request,
so they run in a worker thread (JAX and most numeric code release the GIL). The choice is
measured, per instance: the median of five timed calls at load decides the start; after that,
each window of eight executions is judged by its fastest: if even that one took over 500 µs the
instance moves to a thread, under 100 µs it comes back inline. Slow calls that are not the
model's own doing (a garbage collection, or waiting for the GIL while a front end's thread
holds it, which under load can make several calls in a row take milliseconds) change nothing
as long as one call of the window ran at the model's real speed. A first call for input shapes
``execute`` is not compiled for always runs in a thread: compiling can take a second.
``parameters { key: "execution" value: { string_value: "inline" | "thread" | "auto" } }``
fixes the choice per model.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import time
from collections.abc import AsyncGenerator, Callable, Mapping
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
    InvalidRequestError,
    ModelLoadError,
    ModelStatistics,
    Observer,
    ParameterValue,
    ServerClosedError,
    TensorChecker,
    Tensors,
    apply_reshape,
)
from ..telemetry import RequestTracing
from ._batcher import BatchQueue, join_inputs, padded_sizes, rows_of, split_outputs
from ._definition import Model, takes_request
from ._stats import StatsRecorder

_END = object()
"""What ``next`` returns when a decoupled model's generator is exhausted."""
THREAD_ABOVE_NS = 500_000
INLINE_BELOW_NS = 100_000
SWITCH_WINDOW = 8
"""Executions an instance is judged over: it switches when the fastest of them is on the
other side of a threshold."""


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
    counted: bool = False
    """Counted as waiting in a batching model's queue (see `BatchQueue.admit`)."""
    level: int = 1
    """Its priority level in a batching model's queue."""
    state: Any = None
    """A stateful model's sequence state going in; ``new_state`` is what execute returned."""
    new_state: Any = None

    def abandon(self) -> None:
        """The requester went away: skip the work, or cancel it if it is running async."""
        self.abandoned = True
        if self.scope is not None:
            self.scope.cancel()


@attrs.define(eq=False)
class _Sequence:
    """One active sequence of a stateful model: its state, and the lock that keeps its
    requests in order."""

    state: Any
    lock: trio.Lock = attrs.Factory(trio.Lock)
    last_used: float = attrs.Factory(trio.current_time)
    active: bool = False
    """Started (by a successful sequence_start) and not ended or released."""
    released: str | None = None
    """Why it is no longer active: "ended" or "idle"."""


@attrs.define(eq=False, slots=True)
class _Batch:
    """Requests that run as one execution, and the batch's place in arrival order."""

    sequence: int
    works: list[_Work]


@attrs.define(eq=False)
class _Instance:
    index: int
    device: Any
    params: Any
    inline: bool
    window: int = 0
    """Executions timed in the current window (`SWITCH_WINDOW`)."""
    fastest_ns: int = 0
    """The fastest of them."""
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
    _batching: BatchQueue | None = attrs.field(init=False, default=None)
    """The queue of a model with dynamic batching (None: one request per execution)."""
    _sizes: tuple[int, ...] = attrs.field(init=False, default=())
    """Batch sizes a jitted batching model pads to (all compiled at load)."""
    _compute: trio.Semaphore = attrs.field(init=False, factory=lambda: trio.Semaphore(1))
    """A decoupled model's compute slots (one per instance), held per generator step."""
    _next_instance: int = attrs.field(init=False, default=0)
    _stateful: bool = attrs.field(init=False, default=False)
    _sequences: dict[int | str, _Sequence] = attrs.field(init=False, factory=dict)
    """A stateful model's active sequences, by correlation id."""
    _idle_s: float = attrs.field(init=False, default=1.0)
    _sweeper: trio.CancelScope | None = attrs.field(init=False, default=None)
    _formed: int = attrs.field(init=False, default=0)
    _last_batch: int = attrs.field(init=False, default=0)
    _alone_candidates: int = attrs.field(init=False, default=0)
    """Requests in `run_alone`'s checkpoint now (more than one: they batch instead)."""
    """Requests in the last batch the batcher formed (the fast path is for light load)."""
    """Batches formed so far (their sequence numbers)."""
    _released: int = attrs.field(init=False, default=0)
    """preserve_ordering: the next batch whose requests may be answered."""
    _held: dict[int, list[_Work]] = attrs.field(init=False, factory=dict)
    """preserve_ordering: answered batches waiting for an earlier one, by sequence number."""
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
        if config.sequence_batching is not None:
            self._stateful = True
            idle_us = config.sequence_batching.max_sequence_idle_microseconds
            self._idle_s = (idle_us or 1_000_000) / 1e6  # Triton's default: 1 s
        # A model taking `request` sees one request's metadata: it is not batched.
        batchable = not self._takes_request and not config.decoupled
        if config.dynamic_batching and config.max_batch_size > 0 and batchable:
            self._batching = BatchQueue(config)
            self._sizes = padded_sizes(config) if self.model.jit else ()
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
        if self._sizes:  # a batching model pads to these sizes: none compiles under load
            batches = list(self._sizes)
        try:
            for batch in reversed(batches):
                lead = (batch,) if batch else ()
                inputs = {
                    t.name: np.zeros(lead + t.dims, dtype=t.data_type.numpy_dtype)
                    for t in config.input
                    if not t.optional
                }
                request = InferRequest(model_name=config.name, inputs=inputs)
                args = self._arguments(request, None, instance.device)
                self._call(instance, args)  # compiles
                instance.compiled.add(self.signature(inputs))
            timings = []
            for _ in range(5):  # the smallest batch, compiled: time it
                start = time.perf_counter_ns()
                raw = self._stateful_result(self._call(instance, args), None)
                jax.block_until_ready(raw)  # type: ignore[no-untyped-call]
                if isinstance(raw, Mapping):
                    raw = {k: np.asarray(v) for k, v in raw.items()}
                timings.append(time.perf_counter_ns() - start)
            typical = sorted(timings)[len(timings) // 2]
        except Exception as exc:
            lead = (max(batches),) if max(batches) else ()
            shapes = ", ".join(f"{t.name}: {list(lead + t.dims)}" for t in config.input)
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
        self._compute = trio.Semaphore(len(instances))
        async with trio.open_nursery() as nursery:
            if self._batching is not None:
                # The batcher owns the model's queue and hands whole batches to instances.
                batch_send, batch_receive = trio.open_memory_channel[_Batch](0)
                # A batch forms only when an instance is free for it, so the queue (and its
                # priorities) decides what runs next, not a batch formed earlier.
                idle = trio.Semaphore(len(instances))
                async with batch_receive:
                    for instance in instances:
                        await nursery.start(
                            self._serve_batches, instance, batch_receive.clone(), idle
                        )
                await nursery.start(self._serve_batcher, self._receive, batch_send, idle)
            else:
                async with self._receive:
                    for instance in instances:
                        await nursery.start(self._serve_instance, instance, self._receive.clone())
            if self._stateful:
                self._sweeper = trio.CancelScope()
                nursery.start_soon(self._run_sweeper, self._sweeper)
            task_status.started()

    async def _run_sweeper(self, scope: trio.CancelScope) -> None:
        with scope:
            await self._sweep_idle()

    def close(self) -> None:
        """Stop accepting work; instances finish what is queued, then end.

        Streams still open end with `ServerClosedError`: a stream lasts as long as its
        caller keeps reading, which may be never.
        """
        self._send.close()  # open streams end with ServerClosedError at their next step
        if self._sweeper is not None:
            self._sweeper.cancel()

    # -- running ---------------------------------------------------------------------------

    def _call(self, instance: _Instance, inputs: Mapping[str, Any]) -> Any:
        if self._with_params:
            return self._fn(instance.params, **inputs)
        return self._fn(**inputs)

    def _arguments(
        self, request: InferRequest, work: _Work | None = None, device: Any = None
    ) -> Mapping[str, Any]:
        """The keyword arguments of ``execute`` for ``request``.

        Plain-Python models get read-only views: an array can be shared with a sibling step
        or be the caller's own, so writing into it would corrupt someone else's data.
        """
        inputs = request.inputs
        if self._stateful:
            state = work.state if work is not None else self._initial_state()
            if self.model.jit and device is not None:
                state = jax.device_put(state, device)  # where this instance computes
            return {**self._plain_or_checked(request), "state": state}
        if self._plain_arguments:
            return inputs
        return self._plain_or_checked(request)

    def _plain_or_checked(self, request: InferRequest) -> dict[str, Any]:
        inputs = request.inputs
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
        self, instance: _Instance, request: InferRequest, work: _Work | None = None
    ) -> tuple[Tensors, int, int, int]:
        t0 = time.perf_counter_ns()
        t1 = t0
        try:
            args = self._arguments(request, work, instance.device)
            t1 = time.perf_counter_ns()
            raw = self._stateful_result(self._call(instance, args), work)
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
        self, instance: _Instance, request: InferRequest, work: _Work | None = None
    ) -> tuple[Tensors, int, int, int]:
        t0 = time.perf_counter_ns()
        t1 = t0
        try:
            args = self._arguments(request, work, instance.device)
            t1 = time.perf_counter_ns()
            raw = self._stateful_result(await self._call(instance, args), work)
        except Exception as exc:
            raise self._error(exc) from exc
        t2 = time.perf_counter_ns()
        outputs = self._checked(raw)
        t3 = time.perf_counter_ns()
        return outputs, t1 - t0, t2 - t1, t3 - t2

    def _stateful_result(self, raw: Any, work: _Work | None) -> Any:
        """A stateful model returns ``(outputs, new_state)``: keep the state, pass on the
        outputs."""
        if not self._stateful:
            return raw
        if not (isinstance(raw, tuple) and len(raw) == 2):
            raise TypeError(
                "a stateful model's execute must return (outputs, new_state), got "
                f"{type(raw).__name__}"
            )
        outputs, new_state = raw
        if not self.model.jit:  # numpy state may be the very arrays returned as outputs
            new_state = jax.tree_util.tree_map(
                lambda leaf: np.array(leaf, copy=True) if isinstance(leaf, np.ndarray) else leaf,
                new_state,
            )
        if work is not None:
            work.new_state = new_state
        return outputs

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
        """Move the instance between inline and thread when the fastest execution of a
        window says so: a garbage collection, a busy machine or a wait for the GIL can make
        calls of a tiny model take milliseconds, several in a row, but not every one."""
        if self._mode != "auto":
            return
        fastest = duration_ns if instance.window == 0 else min(instance.fastest_ns, duration_ns)
        instance.window += 1
        if instance.window < SWITCH_WINDOW:
            instance.fastest_ns = fastest
            return
        instance.window = 0
        if instance.inline and fastest > THREAD_ABOVE_NS:
            instance.inline = False
        elif not instance.inline and fastest < INLINE_BELOW_NS:
            instance.inline = True

    def _record(
        self,
        instance: _Instance,
        queue_ns: int,
        result: tuple[Tensors, int, int, int] | None,
        elapsed: int,
        batch: int,
        learn: bool = True,
        requests: list[InferRequest] | None = None,
        started: int = 0,
    ) -> None:
        if learn and not self._is_async:
            # The execution itself, not the trip to a worker thread and back.
            self._learn(instance, sum(result[1:]) if result is not None else elapsed)
        count = len(requests) if requests else 1
        if result is not None:
            self.stats.execution_finished(queue_ns, *result[1:], requests=count)
        else:
            self.stats.execution_finished(queue_ns, 0, elapsed, 0, requests=count)
        if self.observer is not None:
            self.observer.execution_finished(
                self.model.name, self.model.version, batch, queue_ns, elapsed
            )
        if self.tracing is not None and requests:
            for request in requests:
                if self.tracing.traced(request):
                    attributes = {"orchestrion.batch_size": batch}
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

    async def _run_work(
        self,
        instance: _Instance,
        work: _Work,
        inferences: int | None = None,
        members: list[_Work] | None = None,
    ) -> None:
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
                    result = await self._execute_async(instance, work.request, work)
                elif instance.inline and not compiling:
                    result = self._execute_sync(instance, work.request, work)
                else:
                    result = await trio.to_thread.run_sync(
                        self._execute_sync, instance, work.request, work
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
        batch = inferences or batch_size(self.model.config.max_batch_size, work.request.inputs)
        elapsed = time.perf_counter_ns() - started
        # A compilation says nothing about how long executions take.
        if members is None:
            queue_ns = started - work.enqueued_ns
            requests = [work.request]
        else:  # a batch: each request's own wait, and a compute span under each request
            queue_ns = sum(started - m.enqueued_ns for m in members)
            requests = [m.request for m in members]
        self._record(instance, queue_ns, result, elapsed, batch, not compiling, requests, started)
        work.done.set()

    # -- dynamic batching -----------------------------------------------------------------

    async def _serve_batcher(
        self,
        receive: trio.MemoryReceiveChannel[_Work],
        send: trio.MemorySendChannel[_Batch],
        idle: trio.Semaphore,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Gather queued requests into batches and hand each to the next free instance."""
        queue = self._batching
        assert queue is not None
        batching = self.model.config.dynamic_batching
        assert batching is not None
        delay = batching.max_queue_delay_microseconds / 1e6
        ended = False
        async with receive, send:
            task_status.started()
            try:
                while not ended or len(queue):
                    if not len(queue):
                        try:
                            queue.push(await receive.receive())
                        except trio.EndOfChannel:
                            break
                    await idle.acquire()  # released by the instance when the batch is done
                    ended = self._drain_into(receive, queue) or ended  # priorities see all
                    # The delay counts from the oldest request's arrival, not from now.
                    oldest = queue.oldest_arrival()
                    deadline = (oldest if oldest is not None else trio.current_time()) + delay
                    while not ended and not queue.full():
                        try:
                            queue.push(receive.receive_nowait())
                            continue
                        except trio.WouldBlock:
                            pass
                        except trio.EndOfChannel:
                            ended = True
                            break
                        if trio.current_time() >= deadline:
                            break
                        with trio.move_on_at(deadline):
                            try:
                                queue.push(await receive.receive())
                            except trio.EndOfChannel:
                                ended = True
                            continue
                        break
                    expired: list[_Work] = []
                    before = len(queue)
                    batch = queue.take(expired)
                    self._queued -= before - len(queue)  # batched, expired or abandoned
                    for work in expired:
                        work.done.set()
                    if not batch:
                        idle.release()
                    else:
                        self._formed += 1
                        self._last_batch = len(batch)
                        formed = _Batch(self._formed - 1, batch)
                        if self._runs_in_batcher():
                            # One inline instance, and it is free: run the batch here rather
                            # than hand it over, which would cost one more scheduling pass
                            # (about 10 µs per request; bench/vs_triton/inprocess.py).
                            queue.started(batch)
                            try:
                                await self._run_batch(self.instances[0], formed)
                            finally:
                                idle.release()
                            continue
                        # Waits for a free instance; arrivals meanwhile queue for the next.
                        try:
                            await send.send(formed)
                        except BaseException:
                            # Not started: back in the queue, answered with the rest below.
                            queue.push_back(batch)
                            self._queued += len(batch)
                            raise
                        queue.started(batch)
            finally:
                # Stopped from outside: answer what is still queued, in the channel too (no
                # caller waits forever).
                with contextlib.suppress(trio.ClosedResourceError):
                    self._drain_into(receive, queue)
                for work in queue.drain():
                    self._queued -= 1
                    work.error = ServerClosedError("the server is shutting down")
                    work.done.set()

    def _runs_in_batcher(self) -> bool:
        """Whether the batcher runs its batch itself: a single instance that runs inline
        (short synchronous work) and is free. Nothing else could run the batch sooner."""
        if self._is_async or len(self.instances) != 1:
            return False
        instance = self.instances[0]
        return instance.inline and not instance.busy

    @staticmethod
    def _drain_into(receive: trio.MemoryReceiveChannel[_Work], queue: BatchQueue) -> bool:
        """Move every request waiting in the channel into the queue; True if it ended."""
        while True:
            try:
                queue.push(receive.receive_nowait())
            except trio.WouldBlock:
                return False
            except trio.EndOfChannel:
                return True

    async def _serve_batches(
        self,
        instance: _Instance,
        receive: trio.MemoryReceiveChannel[_Batch],
        idle: trio.Semaphore,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        async with receive:
            task_status.started()
            try:
                async for batch in receive:
                    try:
                        await self._run_batch(instance, batch)
                    finally:
                        idle.release()
            finally:
                while True:
                    try:
                        batch = receive.receive_nowait()
                    except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                        break
                    for work in batch.works:
                        work.error = ServerClosedError("the server is shutting down")
                    self._answer(batch.sequence, batch.works)

    async def _run_batch(self, instance: _Instance, batch: _Batch) -> None:
        """Run a batch as one execution and give each request its rows of the outputs."""
        queue = self._batching
        assert queue is not None
        works = []
        for work in batch.works:
            if work.abandoned:
                continue
            if queue.overdue(work):  # it waited for this instance past its queue policy
                queue.expire(work, self.model.name)
                work.done.set()
                continue
            works.append(work)
        if not works:
            self._answer(batch.sequence, [])
            return
        rows = [rows_of(w.request) for w in works]
        total = sum(rows)
        padded = next((size for size in self._sizes if size >= total), total)
        first = works[0].request
        joined = first.derive(
            model_name=first.model_name,
            model_version=first.model_version,
            inputs=join_inputs([w.request for w in works], padded),
            requested_outputs=None,
        )
        combined = _Work(request=joined, enqueued_ns=min(w.enqueued_ns for w in works))
        try:
            await self._run_work(instance, combined, inferences=total, members=works)
        finally:
            self._deliver(works, rows, combined)
            self._answer(batch.sequence, works)

    def _answer(self, sequence: int, works: list[_Work]) -> None:
        """Wake the batch's requesters; with preserve_ordering, only once every earlier
        batch has been answered (a later batch that finished first waits)."""
        batching = self.model.config.dynamic_batching
        if batching is None or not batching.preserve_ordering:
            for work in works:
                work.done.set()
            return
        self._held[sequence] = works
        while self._released in self._held:
            for work in self._held.pop(self._released):
                work.done.set()
            self._released += 1

    def _deliver(self, works: list[_Work], rows: list[int], combined: _Work) -> None:
        parts: list[dict[str, Any]] | None = None
        error = combined.error
        if error is None and combined.outputs is not None:
            try:
                parts = split_outputs(combined.outputs, rows)
            except ValueError as exc:
                error = InferenceError(
                    f"model '{self.model.name}' (version {self.model.version}) returned a "
                    f"bad batched result: {exc}",
                    model_name=self.model.name,
                )
        for index, work in enumerate(works):
            if parts is not None:
                work.outputs = parts[index]
            else:
                work.error = error or ServerClosedError("the server is shutting down")

    def ready_now(self, inputs: Tensors) -> bool:
        """Whether `infer_now` can run these inputs at once: nobody is queued ahead and an
        inline instance is idle, with ``execute`` already compiled for these shapes (a
        compilation can take a second: it never runs on the event loop)."""
        if self._is_async or self._queued or self._batching is not None or self._stateful:
            return False
        if self.model.config.decoupled:
            return False
        return self._idle_instance(inputs) is not None

    def may_run_alone(self, inputs: Tensors) -> bool:
        """Whether a request for this batching model may skip the batcher: no queue delay
        (the batcher would not wait for company), no ``preserve_ordering`` (the batcher
        keeps that order), nothing queued, the load light (the last batch held one
        request) and an inline instance free and compiled for these shapes. `run_alone`
        then decides."""
        batching = self.model.config.dynamic_batching
        if batching is None or self._batching is None or self._is_async or self._stateful:
            return False
        if batching.max_queue_delay_microseconds or batching.preserve_ordering:
            return False
        if self._queued or len(self._batching) or self._last_batch > 1:
            return False
        if self.model.config.decoupled:
            return False
        return self._idle_instance(inputs) is not None

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
            self._record(instance, 0, result, elapsed, batch, True, [request], started)
        outputs = result[0]
        if self._batching is not None:
            # As the batcher does: the request's own rows, and one row per input row.
            try:
                outputs = split_outputs(outputs, [rows_of(request)])[0]
            except ValueError as exc:
                raise InferenceError(
                    f"model '{self.model.name}' (version {self.model.version}) returned a "
                    f"bad batched result: {exc}",
                    model_name=self.model.name,
                ) from None
        return self._response(request, outputs)

    async def infer(self, request: InferRequest) -> InferResponse:
        """Run ``request`` (inputs already checked) on the next free instance.

        Raises:
            InferenceError: ``execute`` raised or returned a bad result.
            ServerClosedError: the model is being unloaded.
        """
        if self._stateful:
            return await self._infer_in_sequence(request)
        work = _Work(request=request, enqueued_ns=time.perf_counter_ns())
        await self._submit(work)
        return self._response(request, work.outputs or {})

    async def _submit(self, work: _Work) -> None:
        """Queue ``work`` and wait until it is done.

        Raises:
            InferenceError: ``execute`` raised or returned a bad result.
            ServerClosedError: the model is being unloaded.
            QueueFullError: a batching model's queue is full.
        """
        if self._batching is not None:
            self._batching.admit(work)
        try:
            self._send.send_nowait(work)
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            if self._batching is not None:
                self._batching.withdraw(work)
            raise ServerClosedError(f"model '{self.model.name}' is being unloaded") from None
        self._queued += 1
        try:
            await work.done.wait()
        except BaseException:
            work.abandon()
            if self._batching is not None:
                self._batching.withdraw(work)  # frees its max_queue_size place at once
            raise
        if work.error is not None:
            raise work.error

    # -- decoupled models (streams) ---------------------------------------------------------

    async def stream(self, request: InferRequest) -> AsyncGenerator[Tensors, None]:
        """The outputs of each response a decoupled model yields for ``request``, as they
        come.

        The generator runs in the caller's task, one step at a time: it is suspended while
        the caller holds the previous response, so nothing is buffered. The model's
        instances are *compute slots* here: a generator holds one only while it computes
        its next response (a synchronous step runs in a worker thread), not while its
        caller is busy, so streams that feed each other (a decoupled model nested in
        another's iterations) cannot deadlock on instances.

        Raises:
            InferenceError: ``execute`` raised (after the responses it yielded before).
            ServerClosedError: the model is being unloaded (also mid-stream).
        """
        if self._send._closed:
            raise ServerClosedError(f"model '{self.model.name}' is being unloaded")
        instance = self.instances[self._next_instance % len(self.instances)]
        self._next_instance += 1
        started = time.perf_counter_ns()
        error: BaseException | None = None
        generator: Any = None
        try:
            async with self._compute:
                generator = self._call(instance, self._arguments(request, None, instance.device))
            try:
                while True:
                    if self._send._closed:
                        raise ServerClosedError(f"model '{self.model.name}' is being unloaded")
                    async with self._compute:
                        if inspect.isasyncgen(generator):
                            raw = await anext(generator, _END)
                        else:
                            raw = await trio.to_thread.run_sync(next, generator, _END)
                    if raw is _END:
                        return
                    yield self._checked(raw)
            finally:
                if inspect.isasyncgen(generator):
                    await generator.aclose()
                else:
                    generator.close()
        except (InferenceError, ServerClosedError) as exc:
            error = exc
            raise
        except Exception as exc:
            error = self._error(exc)
            raise error from exc
        finally:
            if generator is not None:  # it ran: one execution (a stream gave up before not)
                elapsed = time.perf_counter_ns() - started
                result: tuple[Tensors, int, int, int] | None = ({}, 0, elapsed, 0)
                if error is not None:
                    result = None  # its compute span is an error
                self._record(instance, 0, result, elapsed, 1, False, [request], started)

    # -- sequences (stateful models) -------------------------------------------------------

    def _initial_state(self) -> Any:
        make = self.model.initial_state
        return make(self.model.config) if make is not None else None

    async def _infer_in_sequence(self, request: InferRequest) -> InferResponse:
        """Run a request of a sequence with the sequence's state, one at a time, in order."""
        name = self.model.name
        key = request.sequence_id
        if key in (0, ""):
            raise InvalidRequestError(
                f"model '{name}' is stateful (sequence_batching): its requests need a "
                "sequence_id (correlation id); inside an ensemble, give it to the ensemble's "
                "request"
            )
        # One _Sequence (one lock) per id for as long as anyone uses it: a restart waits for
        # the id's running request like any other, and replaces the state only if it succeeds.
        sequence = self._sequences.get(key)
        if sequence is None:
            if not request.sequence_start:
                raise self._inactive(key, None)
            sequence = self._sequences[key] = _Sequence(state=None)
        async with sequence.lock:  # a sequence's requests run one at a time, in order
            if not request.sequence_start and not sequence.active:
                raise self._inactive(key, sequence.released)
            state = self._initial_state() if request.sequence_start else sequence.state
            work = _Work(request=request, enqueued_ns=time.perf_counter_ns(), state=state)
            try:
                await self._submit(work)
            except BaseException:
                if work.scope is not None:  # still running (a thread cannot be cancelled):
                    with trio.CancelScope(shield=True):  # keep the sequence's turn till done
                        await work.done.wait()
                raise
            else:  # a failed request leaves the state (and whether it is active) alone
                sequence.state = work.new_state
                sequence.active = True
                sequence.released = None
            finally:
                sequence.last_used = trio.current_time()
                if request.sequence_end:
                    sequence.active = False
                    sequence.released = "ended"
                unused = not sequence.active and not sequence.lock.statistics().tasks_waiting
                if unused and self._sequences.get(key) is sequence:
                    del self._sequences[key]
        return self._response(request, work.outputs or {})

    def _inactive(self, key: int | str, why: str | None) -> InvalidRequestError:
        name = self.model.name
        if why == "ended":
            return InvalidRequestError(
                f"model '{name}': sequence {key!r} has ended; start it again with "
                "sequence_start=True"
            )
        if why == "idle":
            return InvalidRequestError(
                f"model '{name}': sequence {key!r} was released after {self._idle_s:g} s idle "
                "(max_sequence_idle_microseconds); start it again with sequence_start=True"
            )
        return InvalidRequestError(
            f"model '{name}': sequence {key!r} is not active: start it with "
            "sequence_start=True (it may have ended, or been released after "
            f"{self._idle_s:g} s idle: max_sequence_idle_microseconds)"
        )

    async def _sweep_idle(self) -> None:
        """Release sequences idle longer than ``max_sequence_idle_microseconds``."""
        while True:
            await trio.sleep(max(self._idle_s / 4, 0.01))
            now = trio.current_time()
            for key, sequence in list(self._sequences.items()):
                if not sequence.lock.locked() and now - sequence.last_used > self._idle_s:
                    del self._sequences[key]
                    sequence.active = False
                    sequence.released = "idle"

    def _response(self, request: InferRequest, outputs: Tensors) -> InferResponse:
        wanted = request.requested_outputs
        if wanted is not None and any(k not in wanted for k in outputs):
            outputs = {k: v for k, v in outputs.items() if k in wanted}
        return InferResponse(
            model_name=self.model.name,
            model_version=self.model.version,
            request_id=request.request_id,
            outputs=outputs,
            parameters=self.response_parameters(request),
        )

    @property
    def revision(self) -> str:
        """The fingerprint of the code and config this runner runs (`Model.revision`)."""
        return self.model.revision

    def response_parameters(self, request: InferRequest) -> dict[str, ParameterValue]:
        """The parameters of a response to ``request``: a stateful model says which sequence
        it answered; others none (a cache hit gets them here, never from the entry)."""
        return request.sequence_parameters() if self._stateful else {}


def batch_size(max_batch_size: int, inputs: Tensors) -> int:
    """The number of inferences in a request: its batch size, or 1 without batching."""
    if max_batch_size <= 0 or not inputs:
        return 1
    return int(next(iter(inputs.values())).shape[0])
