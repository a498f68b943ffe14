"""A model's instances, and where each execution runs: inline on the event loop or in a
worker thread.

How this works: a tiny jitted call costs about 7 µs and a hop to a worker thread 50–100 µs,
so short executions run inline on the event loop; long ones would stall every other request,
so they run in a worker thread (JAX and most numeric code release the GIL). The choice is
measured, per instance: the backend's warm-up (the median of five timed calls at load)
decides the start; after that, each window of `SWITCH_WINDOW` executions is judged by its
fastest: if even that one took over `THREAD_ABOVE_NS` the instance moves to a thread, under
`INLINE_BELOW_NS` it comes back inline. Slow calls that are not the model's own doing (a
garbage collection, or waiting for the GIL while a front end's thread holds it, which under
load can make several calls in a row take milliseconds) change nothing as long as one call
of the window ran at the model's real speed. A first call for input shapes the instance has
not compiled always runs in a thread: compiling can take a second. Code that awaits runs on
the event loop. ``parameters { key: "execution" value: { string_value: "inline" | "thread" |
"auto" } }`` fixes the choice per model (`ExecutionMode`).

`Instances` runs one execution on an instance (`run_sync`, `run_async`), times its parts
and names the model in every error, and tells the event loop's watchdog which model holds
the loop while one runs inline.
"""

from __future__ import annotations

import time
from collections.abc import Hashable
from typing import Any

import attrs
import greenback
import trio

from ..backends import Backend, LoadedInstance
from ..protocols import (
    ExecutionMode,
    InferenceError,
    InferRequest,
    TensorChecker,
    Tensors,
    carried,
    execution_mode,
)
from ._watchdog import THREAD_HINT, LoopHolder, loop_holder

THREAD_ABOVE_NS = 500_000
"""An instance whose fastest execution of a window took longer moves to a worker thread."""
INLINE_BELOW_NS = 100_000
"""An instance in a thread whose fastest execution of a window took less comes back inline."""
SWITCH_WINDOW = 8
"""Executions an instance is judged over: it switches when the fastest of them is on the
other side of a threshold."""


Timings = tuple[int, int, int]
"""Nanoseconds spent preparing the arguments, computing, and checking the outputs."""


@attrs.define(eq=False, slots=True)
class Work:
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
class Instance:
    """One instance at run time: what its backend loaded, and where it runs now."""

    loaded: LoadedInstance
    inline: bool
    """Runs on the event loop (else in a worker thread)."""
    mode: ExecutionMode = ExecutionMode.AUTO
    window: int = 0
    """Executions timed in the current window (`SWITCH_WINDOW`)."""
    fastest_ns: int = 0
    """The fastest of them."""
    busy: bool = False

    @property
    def index(self) -> int:
        """Its place in ``instance_group`` order."""
        return self.loaded.index

    @property
    def device(self) -> Any:
        """Where it computes."""
        return self.loaded.device

    @property
    def compiled(self) -> set[Hashable]:
        """Input signatures this instance has compiled (`Backend.signature`)."""
        return self.loaded.compiled

    def compiled_for(self, signature: Hashable | None) -> bool:
        """Whether an execution for ``signature`` runs without compiling first."""
        return self.loaded.compiled_for(signature)

    def free_inline(self, signature: Hashable | None) -> bool:
        """Whether it can run an execution for ``signature`` inline right now."""
        return self.inline and not self.busy and self.loaded.compiled_for(signature)

    def learn(self, duration_ns: int) -> None:
        """Move the instance between inline and thread when the fastest execution of a
        window says so: a garbage collection, a busy machine or a wait for the GIL can make
        calls of a tiny model take milliseconds, several in a row, but not every one."""
        if self.mode is not ExecutionMode.AUTO:
            return
        fastest = duration_ns if self.window == 0 else min(self.fastest_ns, duration_ns)
        self.window += 1
        if self.window < SWITCH_WINDOW:
            self.fastest_ns = fastest
            return
        self.window = 0
        if self.inline and fastest > THREAD_ABOVE_NS:
            self.inline = False
        elif not self.inline and fastest < INLINE_BELOW_NS:
            self.inline = True


def _timed(fn: Any, *args: Any) -> tuple[Any, int, int]:
    """``fn(*args)``, and when it started and ended (``perf_counter_ns``)."""
    t0 = time.perf_counter_ns()
    result = fn(*args)
    return result, t0, time.perf_counter_ns()


def starts_inline(mode: ExecutionMode, loaded: LoadedInstance) -> bool:
    """Where an instance starts: unmeasured work might block for long, so it starts in a
    thread (a needless hop costs ~100 µs, a needless stall of the event loop has no bound)
    unless its warm-up was timed fast."""
    if mode is ExecutionMode.AUTO:
        return loaded.typical_ns is not None and loaded.typical_ns <= THREAD_ABOVE_NS
    return mode is ExecutionMode.INLINE


@attrs.define(eq=False)
class Instances:
    """A model's instances, and one execution on one of them."""

    backend: Backend
    name: str
    version: int
    checker: TensorChecker
    all: list[Instance] = attrs.field(factory=list)
    holder: LoopHolder = attrs.field(factory=loop_holder)
    """What the event loop's watchdog reads to name the model holding the loop."""

    def load(self) -> None:
        """Load every instance through the backend (runs in a worker thread)."""
        config = self.backend.config
        mode = execution_mode(config)
        if "execution" not in config.parameters and not self.backend.capabilities.may_run_inline:
            mode = ExecutionMode.THREAD
        self.all = [
            Instance(loaded, starts_inline(mode, loaded), mode) for loaded in self.backend.load()
        ]

    def idle_inline(self, inputs: Tensors) -> Instance | None:
        """An instance that can run ``inputs`` inline right now (compiled for their shapes),
        or None."""
        # Fixed shapes were compiled at load: only variable ones need their signature.
        backend = self.backend
        signature = backend.signature(inputs) if backend.variable_shapes else None
        for instance in self.all:
            if instance.free_inline(signature):
                return instance
        return None

    @property
    def inline_now_allowed(self) -> bool:
        """Whether an execution may run inline in whatever task asks, synchronously (the
        fast paths): not for code that awaits, nor for code whose BLS calls wait through a
        greenback portal (only a task that holds one may run it: `portal`)."""
        capabilities = self.backend.capabilities
        return not capabilities.is_async and not capabilities.waits_through_portal

    async def portal(self) -> None:
        """Before an inline execution in this task: a greenback portal for it to wait on
        the server through, where its code needs one (once per task; cheap after)."""
        if self.backend.capabilities.waits_through_portal:
            await greenback.ensure_portal()

    def run_sync(self, instance: Instance, request: InferRequest, work: Work | None) -> Any:
        """Run one execution to the end, here: its checked outputs and `Timings`.

        Raises:
            InferenceError: ``execute`` raised or returned a bad result (the model named).
        """
        t0 = time.perf_counter_ns()
        t1 = t0
        loaded = instance.loaded
        loaded.waited_ns = 0
        try:
            args = self.backend.arguments(request, self._state(work), loaded)
            t1 = time.perf_counter_ns()
            raw, new_state = self.backend.execute(loaded, args)
        except Exception as exc:
            raise self.error(exc) from exc
        # Time waited on the server through a portal is not its own: the loop ran on.
        return self._finish(raw, new_state, work, t0, t1, loaded.waited_ns)

    def run_inline(self, instance: Instance, request: InferRequest, work: Work | None) -> Any:
        """`run_sync` on the event loop, the watchdog told which model holds it meanwhile."""
        holder = self.holder
        outer, holder.runs = holder.runs, self
        try:
            return self.run_sync(instance, request, work)
        finally:
            holder.runs = outer

    def holds_loop_as(self, where: str) -> str:
        """How the watchdog names this model while it runs inline, at ``where``."""
        return (
            f"model '{self.name}' (version {self.version}) running inline, at {where}; "
            f"every request waits until it returns. {THREAD_HINT}"
        )

    async def run_async(self, instance: Instance, request: InferRequest, work: Work | None) -> Any:
        """`run_sync` for code that awaits (on the event loop)."""
        t0 = time.perf_counter_ns()
        t1 = t0
        try:
            args = self.backend.arguments(request, self._state(work), instance.loaded)
            t1 = time.perf_counter_ns()
            raw, new_state = await self.backend.execute_async(instance.loaded, args)
        except Exception as exc:
            raise self.error(exc) from exc
        return self._finish(raw, new_state, work, t0, t1)

    async def run_listed(
        self, instance: Instance, requests: list[InferRequest]
    ) -> tuple[list[Tensors | InferenceError], Timings]:
        """One execution of a list of requests (`Capabilities.request_lists`): each
        request's checked outputs or its own error, and the `Timings`.

        Raises:
            InferenceError: the execution as a whole failed (the model named).
        """
        backend = self.backend
        if instance.inline and not backend.capabilities.is_async:
            await self.portal()
            return self.run_listed_inline(instance, requests)
        try:
            if backend.capabilities.is_async:
                t0 = time.perf_counter_ns()
                raw = await backend.execute_requests_async(instance.loaded, requests)
                t1 = time.perf_counter_ns()
            else:
                # Timed in the thread: the hop to it and back is not the model's time, and
                # counting it would keep a fast model from ever coming back inline.
                instance.loaded.waited_ns = 0
                raw, t0, t1 = await trio.to_thread.run_sync(
                    _timed, backend.execute_requests, instance.loaded, requests
                )
                t1 -= instance.loaded.waited_ns  # nor is waiting on the server (BLS)
        except Exception as exc:
            raise self.error(exc) from exc
        return self._outcomes(raw, t0, t1)

    def run_listed_inline(
        self, instance: Instance, requests: list[InferRequest]
    ) -> tuple[list[Tensors | InferenceError], Timings]:
        """`run_listed` here, on the event loop (the watchdog told which model holds it).

        Raises:
            InferenceError: the execution as a whole failed (the model named).
        """
        holder = self.holder
        outer, holder.runs = holder.runs, self
        loaded = instance.loaded
        loaded.waited_ns = 0
        try:
            raw, t0, t1 = _timed(self.backend.execute_requests, loaded, requests)
        except Exception as exc:
            raise self.error(exc) from exc
        finally:
            holder.runs = outer
        return self._outcomes(raw, t0, t1 - loaded.waited_ns)  # its own time only

    def _outcomes(
        self, raw: list[Any], t0: int, t1: int
    ) -> tuple[list[Tensors | InferenceError], Timings]:
        """Each request's checked outputs, or its error, from ``execute_requests`` (run
        from ``t0`` to ``t1``), and the `Timings`."""
        checking = time.perf_counter_ns()
        outcomes: list[Tensors | InferenceError] = []
        for item in raw:
            if isinstance(item, InferenceError):
                outcomes.append(item)
            elif isinstance(item, Exception):
                outcomes.append(self.error(item))
            else:
                try:
                    outcomes.append(self.checked(item))
                except InferenceError as exc:
                    outcomes.append(exc)
        return outcomes, (0, t1 - t0, time.perf_counter_ns() - checking)

    def _finish(
        self, raw: Any, new_state: Any, work: Work | None, t0: int, t1: int, waited: int = 0
    ) -> Any:
        """Keep the new state, check the outputs: the outputs and the `Timings` (the
        execution's ``waited`` on the server left out of its compute time)."""
        if work is not None:
            work.new_state = new_state
        t2 = time.perf_counter_ns()
        outputs = self.checked(raw)
        return outputs, (t1 - t0, t2 - t1 - waited, time.perf_counter_ns() - t2)

    def _state(self, work: Work | None) -> Any:
        if not self.backend.capabilities.stateful:
            return None
        return work.state if work is not None else self.backend.initial_state()

    def error(self, exc: BaseException) -> InferenceError:
        """``exc``, raised by the model's code, as this model's `InferenceError` (one the
        backend made, in its own words, is kept)."""
        if isinstance(exc, InferenceError):
            return exc
        return InferenceError(
            f"model '{self.name}' (version {self.version}) failed: {type(exc).__name__}: {exc}",
            model_name=self.name,
        )

    def checked(self, raw: Any) -> Tensors:
        """The model's result as checked outputs.

        Raises:
            InferenceError: it breaks the config (names, types, shapes).
        """
        try:
            outputs = self.checker.outputs(raw)
        except Exception as exc:  # whatever converting the model's result raised
            raise InferenceError(
                f"model '{self.name}' (version {self.version}) returned a bad result: {exc}",
                model_name=self.name,
            ) from exc
        return carried(raw, outputs)  # the response parameters the model set travel along

    def bad_batch(self, exc: Exception) -> InferenceError:
        """A batched result that cannot be split into its requests' rows."""
        return InferenceError(
            f"model '{self.name}' (version {self.version}) returned a bad batched result: {exc}",
            model_name=self.name,
        )
