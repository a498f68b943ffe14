"""Fusion: an ensemble of short jitted models, called step after step without the scheduler.

How this works. When every step of an ensemble is a jitted, stateless model whose instance
runs inline, nothing between the steps needs the scheduler: no queue, no other consumer of
the intermediate tensors, no thread. `Fusion` then runs a request as a plain loop over the
steps, in the order the ensemble wires them: each step's own compiled function (the one the
scheduler would call, with the same instance's weights), its outputs checked against its
config, then the next step. A request costs one admission and one response instead of one
trip through the registry, the step actors and the model's instance per step.

Modes (``parameters { key: "fusion" value: { string_value: ... } }`` on the ensemble):

- ``"on"`` (the default): the steps' own executables, one after another. The numbers are
  the scheduler's, bit for bit; a step needs its input shapes compiled already (a new
  shape takes the scheduler's path, which compiles it in a worker thread).
- ``"xla"``: the steps' ``execute`` functions traced into one ``jax.jit`` function: one
  dispatch per request, and XLA optimises across steps, so results may differ from the
  step-by-step ones in the last bits (an FP16 intermediate can be kept at a higher
  precision). Each step's abstract inputs and outputs are checked against its config once
  per input signature; a new signature is compiled in a task of the ensemble's own while
  its requests take the scheduler's path.
- ``"off"``: the scheduler for every request.

What stays the same for the client: the outputs, the errors (a request whose step fails or
returns outputs that break its config is run again by the scheduler, which reports it,
naming the step), timeouts and cancellation (a fused request is as uninterruptible as an
inline step, and a late result is cancelled), and the statistics (each composing model
counts its requests and executions). Anything unusual takes the scheduler's path instead:
a subset of the outputs requested, an omitted optional input, a required input that a step
left out of its answer (the scheduler reports it), an observer or tracing configured, a
composing model reloaded (the fusion is rebuilt), busy, queued or in a worker thread, or
calls that turn slow (above the inline threshold three times in a row). An optional input
a step left out is simply not passed on, as on the scheduler's path.

When every step batches dynamically (no queue delay, priorities or queue policy), the
requests that arrive in one scheduling pass are gathered into one fused call (`gather`).
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import numpy as np
import trio

from ..backends import TracedCall, concatenate, repeat_last_row, rows_view, take_rows
from ..protocols import FusionMode, ModelConfig, StepPlan, Tensors, expected_shape
from ._batch_queue import OnePass, gathered_batches
from ._executor import Executor
from ._instances import THREAD_ABOVE_NS, Instance
from ._watchdog import LoopHolder, loop_holder

_log = logging.getLogger("orchestrion")

Signature = tuple[tuple[str, tuple[int, ...], str], ...]


class SignatureState(enum.StrEnum):
    """Where a fusion (mode "xla") stands with one input signature."""

    NEW = "new"
    COMPILING = "compiling"
    READY = "ready"
    REFUSED = "refused"
    """It cannot be fused (a step's outputs break its config, or tracing failed)."""


def _bucket(rows: int, max_batch: int) -> int:
    """The batch size a fused call of ``rows`` rows is padded to: the next power of two (at
    most ``max_batch``), so that few sizes are ever compiled."""
    size = 1
    while size < rows:
        size *= 2
    return min(size, max_batch)


@attrs.define(eq=False, slots=True)
class _Waiting:
    """A request waiting to be gathered into a batched fused call."""

    inputs: Tensors
    rows: int
    done: trio.Event = attrs.Factory(trio.Event)
    outputs: dict[str, np.ndarray[Any, Any]] | None = None
    """Its rows of the outputs; None once done: it takes the scheduler's path."""
    abandoned: bool = False
    """Its caller went away (cancelled) before the batch was taken."""


def _abstract_problem(config: ModelConfig, tensors: Mapping[str, Any], kind: str) -> str | None:
    """Why the abstract ``kind`` tensors (shapes and dtypes) of one step break its model's
    config ("input": also every required input present)."""
    if not isinstance(tensors, Mapping):
        return "execute does not return a dict"
    declared = config.input if kind == "input" else config.output
    if kind == "input":
        for tensor in declared:
            if tensor.name not in tensors and not tensor.optional:
                return f"input {tensor.name!r} is missing"
    for name, value in tensors.items():
        found = next((t for t in declared if t.name == name), None)
        if found is None or found.reshape is not None:
            return f"{kind} {name!r} is not a plain declared {kind}"
        if np.dtype(value.dtype) != found.data_type.numpy_dtype:
            return f"{kind} {name!r} has data type {value.dtype}"
        want = expected_shape(found, config.max_batch_size)
        shape = tuple(value.shape)
        if len(shape) != len(want) or any(
            w not in (-1, g) for w, g in zip(want, shape, strict=True)
        ):
            return f"{kind} {name!r} has shape {list(shape)}"
        if config.max_batch_size > 0 and not 1 <= shape[0] <= config.max_batch_size:
            return f"{kind} {name!r} has a batch of {shape[0]}"
    return None


@attrs.define(eq=False)
class FusedSteps:
    """What every fused call of an ensemble has: its steps in order, their composing models'
    executors (each step runs and is counted by its own), the ensemble's outputs (`Fusion`
    for jitted steps, `ListedFusion` for python-backend ones)."""

    name: str
    order: tuple[StepPlan, ...]
    steps: tuple[Executor, ...]
    """Each step's composing model, as its executor, in ``order``."""
    outputs: tuple[str, ...]

    def current(self, steps: Sequence[Executor | None]) -> bool:
        """Whether this fusion was built for exactly these executors (no model reloaded)."""
        return len(steps) == len(self.steps) and all(
            a is b for a, b in zip(steps, self.steps, strict=True)
        )

    def idle(self) -> bool:
        """Whether every composing model has an idle inline instance and nothing queued."""
        for step in self.steps:  # noqa: SIM110 (no generator: it runs per fused request)
            if not step.idle():
                return False
        return True


@attrs.define(eq=False)
class Fusion(FusedSteps):
    """The fused call of one ensemble of jitted steps, for one set of composing models."""

    mode: FusionMode = FusionMode.ON
    """"on": the steps' own executables one after another; "xla": one traced function."""
    _call: TracedCall | None = attrs.field(init=False, default=None)
    """Mode "xla": the steps traced into one jitted function."""
    _params: tuple[Any, ...] = attrs.field(init=False)
    _traceables: tuple[Callable[..., Mapping[str, Any]], ...] = attrs.field(init=False)
    """Mode "xla": each step's ``fn(params, **inputs)``, traced into `_call`."""
    _holder: LoopHolder = attrs.field(init=False, factory=loop_holder)
    """What the event loop's watchdog reads to name what holds the loop."""
    _ready: set[Signature] = attrs.field(init=False, factory=set)
    """Signatures checked and compiled."""
    _refused: set[Signature] = attrs.field(init=False, factory=set)
    """Signatures that cannot be fused (a step's outputs break its config, or tracing
    failed): the scheduler runs them."""
    _compiling: set[Signature] = attrs.field(init=False, factory=set)
    _required: tuple[frozenset[str], ...] = attrs.field(init=False)
    """Each step's required inputs: a step whose required input a producer left out takes
    the scheduler's path, which reports the error."""
    _slow_streak: int = 0
    slow: bool = False
    """The fused call took longer than an inline step may, three times in a row."""

    max_batch: int = 0
    """The ensemble's max_batch_size (0: no batch dimension)."""
    max_requests: int = 0
    """The ensemble's max_inflight_requests: the most requests one gathered call may hold
    (0: no limit), as the steps' slots would let through."""
    gathers: bool = attrs.field(init=False, default=False)
    """Every step batches dynamically: concurrent requests are gathered into one call."""
    _pass: OnePass[_Waiting] = attrs.field(init=False, factory=OnePass)

    _pads: tuple[int, ...] = attrs.field(init=False, default=())
    """Batch sizes every step has compiled (mode "on" pads a gathered batch to one)."""
    _announced: bool = attrs.field(init=False, default=False)
    _trusted: dict[tuple[Any, ...], frozenset[Any]] = attrs.field(init=False, factory=dict)
    """Mode "on": for input shapes run before, the instances whose compiled shapes and
    outputs were checked for them."""

    def __attrs_post_init__(self) -> None:
        self.gathers = self.max_batch > 0 and all(step.batches for step in self.steps)
        if self.gathers:
            sizes = [set(step.padded_sizes or (self.max_batch,)) for step in self.steps]
            self._pads = tuple(sorted(set.intersection(*sizes)))
        self._params = tuple(step.params for step in self.steps)
        self._required = tuple(
            frozenset(t.name for t in step.config.input if not t.optional) for step in self.steps
        )
        self._traceables = tuple(step.traceable() for step in self.steps)
        if self.mode is FusionMode.XLA:
            self._call = TracedCall(self._steps)

    def holds_loop_as(self, where: str) -> str:
        """How the watchdog names this ensemble while its one compiled call runs."""
        return (
            f"ensemble '{self.name}' running fused (one compiled call of its steps), at "
            f"{where}; every request waits until it returns"
        )

    def _steps(self, params: tuple[Any, ...], inputs: Mapping[str, Any]) -> list[Any]:
        """Trace the steps in order (mode "xla"): each step's (arguments, outputs), then
        the ensemble's outputs. As on the scheduler's path, a tensor a producer left out is
        not passed on (a required one makes `_check_and_compile` refuse the signature)."""
        board = dict(inputs)
        produced: list[Any] = []
        for plan, execute, own in zip(self.order, self._traceables, params, strict=True):
            args = {name: board[tensor] for name, tensor in plan.inputs if tensor in board}
            result = dict(execute(own, **args))
            produced.append((args, result))
            for name, tensor in plan.outputs:
                if name in result:
                    board[tensor] = result[name]
        produced.append({name: board[name] for name in self.outputs if name in board})
        return produced

    @staticmethod
    def signature(inputs: Tensors) -> Signature:
        """The input names, shapes and dtypes a compilation is for."""
        return tuple(sorted((n, v.shape, v.dtype.str) for n, v in inputs.items()))

    def state(self, signature: Signature) -> SignatureState:
        """Where this fusion stands with ``signature`` (mode "xla")."""
        if signature in self._ready:
            return SignatureState.READY
        if signature in self._refused:
            return SignatureState.REFUSED
        if signature in self._compiling:
            return SignatureState.COMPILING
        return SignatureState.NEW

    def compiling(self, signature: Signature, preparing: bool = True) -> None:
        """Mark ``signature`` as being prepared (before `prepare` is started), or, with
        ``preparing=False``, as new again (`prepare` could not be started)."""
        if preparing:
            self._compiling.add(signature)
        else:
            self._compiling.discard(signature)

    async def prepare(self, signature: Signature, inputs: Tensors) -> None:
        """Check every step's abstract inputs and outputs for these inputs and compile, in a
        worker thread; the signature is then ready, or refused. A gathering fusion compiles
        every batch size it pads to (powers of two up to max_batch) for these per-row shapes
        at once, so that later batches never wait for a compilation. Requests do not wait
        for this: the ensemble runs it in a task of its own while they take the scheduler's
        path."""
        self._compiling.add(signature)
        try:
            ok = await trio.to_thread.run_sync(self._check_and_compile, dict(inputs))
            if ok and self.gathers:
                for size in sorted(
                    {_bucket(n, self.max_batch) for n in range(1, self.max_batch + 1)}
                ):
                    resized = {n: np.repeat(v[:1], size, axis=0) for n, v in inputs.items()}
                    other = self.signature(resized)
                    if other != signature and self.state(other) is SignatureState.NEW:
                        ready = await trio.to_thread.run_sync(self._check_and_compile, resized)
                        (self._ready if ready else self._refused).add(other)
        finally:
            self._compiling.discard(signature)
        if ok and not self._ready:
            steps = ", ".join(f"'{step.model.name}'" for step in self.steps)
            _log.info(
                "ensemble '%s' runs fused: its steps (%s) as one compiled call",
                self.name,
                steps,
            )
        elif not ok:
            _log.debug("ensemble '%s': not fused for inputs %s", self.name, signature)
        (self._ready if ok else self._refused).add(signature)

    def _check_and_compile(self, inputs: dict[str, Any]) -> bool:
        rows = next(iter(inputs.values())).shape[0] if self.max_batch else None
        assert self._call is not None
        try:
            *steps, _ = self._call.abstract(self._params, inputs)
            for step, (args, outputs) in zip(self.steps, steps, strict=True):
                config = step.config
                if _abstract_problem(config, args, "input") is not None:
                    return False  # the scheduler refuses the step's request, and says why
                if _abstract_problem(config, outputs, "output") is not None:
                    return False
                if rows is not None and any(o.shape[0] != rows for o in outputs.values()):
                    return False  # a batching model returns one row per input row
            self._call(self._params, inputs)
        except Exception:  # whatever tracing raised: the scheduler runs (and reports) it
            return False
        return True

    def run(
        self,
        inputs: Tensors,
        rows: Sequence[int],
        compile_later: Callable[[Signature, Tensors], None],
    ) -> dict[str, np.ndarray[Any, Any]] | None:
        """The ensemble's outputs for ``inputs``, or None: the scheduler runs the requests
        (a step raised, broke its config, or has not compiled these shapes; mode "xla": the
        signature is not ready, and ``compile_later`` starts preparing a new one). ``rows``:
        the rows of each request in ``inputs`` (one request: its batch size)."""
        if self.mode is FusionMode.ON:
            return self._run_steps(inputs, rows)
        signature = self.signature(inputs)
        state = self.state(signature)
        if state is SignatureState.NEW:
            compile_later(signature, inputs)
        return self._run_graph(signature, inputs, rows) if state is SignatureState.READY else None

    def _run_graph(
        self, signature: Signature, inputs: Tensors, rows: Sequence[int]
    ) -> dict[str, Any] | None:
        assert self._call is not None
        started = time.perf_counter_ns()
        holder = self._holder
        outer, holder.runs = holder.runs, self
        try:
            # Waited for, not copied: the outputs stay where the fused call computed them.
            outputs: dict[str, Any] = dict(self._call(self._params, inputs))
        except Exception:
            self._refused.add(signature)
            self._ready.discard(signature)
            return None
        finally:
            holder.runs = outer
        elapsed = time.perf_counter_ns() - started
        share = elapsed // len(self.steps)
        for step in self.steps:
            step.count_fused(None, share, rows)
        if elapsed > THREAD_ABOVE_NS:
            self._slow_streak += 1
            self.slow = self._slow_streak >= 3
        else:
            self._slow_streak = 0
        return outputs

    def _run_steps(
        self, inputs: Tensors, rows: Sequence[int]
    ) -> dict[str, np.ndarray[Any, Any]] | None:
        # Shapes decide everything a step checks (jitted functions: the output shapes and
        # types follow from the input shapes), so the checks run once per input shapes and
        # instances; later requests of the same shapes skip them.
        key = tuple((name, v.shape) for name, v in inputs.items())
        trusted = self._trusted.get(key)
        holder = self._holder
        board = dict(inputs)
        done: list[tuple[Executor, Instance, int]] = []
        untrusted = trusted is None
        for plan, step, required in zip(self.order, self.steps, self._required, strict=True):
            args = {}  # a loop, not a comprehension: one Python call fewer per step
            for name, tensor in plan.inputs:
                if tensor in board:
                    args[name] = board[tensor]
            if len(args) != len(plan.inputs) and not required <= args.keys():
                return None  # a producer left a required input out: the scheduler says so
            instance = step.free_inline()
            if instance is None:
                return None
            checking = trusted is None or instance not in trusted
            untrusted = untrusted or checking
            started = time.perf_counter_ns()
            outputs = step.run_fused(instance, args, checking, holder)
            if outputs is None:
                return None
            done.append((step, instance, time.perf_counter_ns() - started))
            for name, tensor in plan.outputs:
                value = outputs.get(name)
                if value is not None:
                    board[tensor] = value
        if untrusted:
            ran = frozenset(instance for _, instance, _ in done)
            self._trusted[key] = ran if trusted is None else trusted | ran
        for step, instance, elapsed in done:
            step.count_fused(instance, elapsed, rows)
        if not self._announced:
            self._announced = True
            steps = ", ".join(f"'{step.model.name}'" for step in self.steps)
            _log.info("ensemble '%s' runs fused: its steps (%s) in turn", self.name, steps)
        return {name: board[name] for name in self.outputs if name in board}

    async def gather(
        self,
        inputs: Tensors,
        rows: int,
        usable: Callable[[], bool],
        compile_later: Callable[[Signature, Tensors], None],
    ) -> dict[str, np.ndarray[Any, Any]] | None:
        """This request's rows of a fused call shared with the requests that arrive in the
        same scheduling pass (as a batcher with no queue delay would gather them); None: take
        the scheduler's path.

        The first request to arrive collects: it lets the others of this pass arrive (one
        checkpoint, shielded so that the ones waiting on it are never left behind), runs
        their batches, at most ``max_batch`` rows each, and hands each its rows. ``usable``
        says, at that moment, whether fusing is still right (nothing queued, not closing, no
        step reloaded); ``compile_later`` starts preparing a new signature (its requests take
        the scheduler's path meanwhile). A request cancelled while it waits drops out.
        """
        me = _Waiting(inputs, rows)

        def run(live: list[_Waiting]) -> None:
            if usable():
                for batch in self._batches(live):
                    self._run_batch(batch, compile_later)

        await self._pass.join(me, run)
        return me.outputs

    def _batches(self, taken: list[_Waiting]) -> list[list[_Waiting]]:
        return gathered_batches(taken, self.max_batch, self.max_requests)

    def _run_batch(
        self, batch: list[_Waiting], compile_later: Callable[[Signature, Tensors], None]
    ) -> None:
        rows = [w.rows for w in batch]
        total = sum(rows)
        if self.mode is FusionMode.ON:  # a size every step compiled at load, or none
            size = next((s for s in self._pads if s >= total), total)
        else:
            size = _bucket(total, self.max_batch)
        pad = size - total
        inputs = {}
        for name in batch[0].inputs:
            parts: list[Any] = [w.inputs[name] for w in batch]
            if pad:  # copies of the last row: computed, then dropped
                parts.append(repeat_last_row(parts[-1], pad))
            inputs[name] = parts[0] if len(parts) == 1 else concatenate(parts)
        outputs = self.run(inputs, rows, compile_later)
        if outputs is None:
            return
        views = {n: rows_view(v) for n, v in outputs.items()}  # once per batch
        offset = 0
        for waiting, count in zip(batch, rows, strict=True):
            waiting.outputs = {n: take_rows(v, offset, offset + count) for n, v in views.items()}
            offset += count
