"""Fusion: a whole ensemble of short jitted models as one compiled call.

How this works. When every step of an ensemble is a jitted, stateless, unbatched model whose
instance runs inline, nothing between the steps needs the scheduler: no queue, no other
consumer of the intermediate tensors, no thread. `Fusion` then traces the steps' own
``execute`` functions, wired as the ensemble wires them, into one ``jax.jit`` function, and
a request runs as one call of it instead of one call (and one trip through the registry)
per step: XLA compiles the whole graph, and the intermediate tensors never leave it.

What stays the same for the client: the outputs, their checks (each step's outputs are
checked against its model's config once per input signature, from the abstract shapes
JAX computes), timeouts and cancellation (the call is as uninterruptible as an inline step,
and a late result is cancelled), and the statistics (each composing model counts the
request, its execution and an equal share of the call's time). Anything unusual takes the
scheduler's path instead, which behaves exactly as before: a subset of outputs requested,
an omitted optional input, an observer or tracing configured, a composing model reloaded
(the fusion is rebuilt), busy or running in a thread, a new input signature (compiled in a
worker thread meanwhile), a call that raised (the scheduler reruns it and names the step
that failed), or calls that turn slow (above the inline threshold three times in a row).
``parameters { key: "fusion" value: { string_value: "off" } }`` on the ensemble turns it off.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import jax
import numpy as np
import trio

from ..protocols import ModelConfig, StepPlan, Tensors
from ..protocols._tensors import expected_shape
from ._runner import THREAD_ABOVE_NS, ModelRunner

_log = logging.getLogger("orchestrion")

Signature = tuple[tuple[str, tuple[int, ...], str], ...]


def fusable(runner: object, max_batch_size: int) -> bool:
    """Whether ``runner`` can be traced into an ensemble's fused call."""
    if not isinstance(runner, ModelRunner):
        return False
    model, config = runner.model, runner.model.config
    return (
        model.jit
        and not runner._stateful
        and not runner._is_async
        and not config.decoupled
        and _batching_fusable(runner)
        and not runner._takes_request
        and runner._plain_arguments
        and runner.observer is None
        and runner.tracing is None
        and config.max_batch_size == max_batch_size
        and all(i.device == jax.devices()[0] for i in runner.instances)
    )


def _batching_fusable(runner: ModelRunner) -> bool:
    """No dynamic batching, or one that gathering requests into the fused call honours:
    no queue delay, no priorities, no queue policy (timeouts, a queue size)."""
    batching = runner.model.config.dynamic_batching
    if runner._batching is None or batching is None:
        return runner._batching is None
    return (
        batching.max_queue_delay_microseconds == 0
        and batching.priority_levels == 0
        and batching.default_queue_policy is None
        and not batching.priority_queue_policy
    )


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


def _abstract_problem(config: ModelConfig, outputs: Mapping[str, Any]) -> str | None:
    """Why the abstract outputs (shapes and dtypes) of one step break its model's config."""
    if not isinstance(outputs, Mapping):
        return "execute does not return a dict"
    for name, value in outputs.items():
        tensor = config.output_named(name)
        if tensor is None or tensor.reshape is not None:
            return f"output {name!r} is not a plain declared output"
        if np.dtype(value.dtype) != tensor.data_type.numpy_dtype:
            return f"output {name!r} has data type {value.dtype}"
        want = expected_shape(tensor, config.max_batch_size)
        shape = tuple(value.shape)
        if len(shape) != len(want) or any(
            w not in (-1, g) for w, g in zip(want, shape, strict=True)
        ):
            return f"output {name!r} has shape {list(shape)}"
    return None


@attrs.define(eq=False)
class Fusion:
    """The fused call of one ensemble, for one set of composing runners."""

    name: str
    order: tuple[StepPlan, ...]
    runners: tuple[ModelRunner, ...]
    outputs: tuple[str, ...]
    _call: Callable[..., Any] = attrs.field(init=False)
    _params: tuple[Any, ...] = attrs.field(init=False)
    _ready: set[Signature] = attrs.field(init=False, factory=set)
    """Signatures checked and compiled."""
    _refused: set[Signature] = attrs.field(init=False, factory=set)
    """Signatures that cannot be fused (a step's outputs break its config, or tracing
    failed): the scheduler runs them."""
    _compiling: set[Signature] = attrs.field(init=False, factory=set)
    _slow_streak: int = 0
    slow: bool = False
    """The fused call took longer than an inline step may, three times in a row."""

    max_batch: int = 0
    """The ensemble's max_batch_size (0: no batch dimension)."""
    gathers: bool = attrs.field(init=False, default=False)
    """Every step batches dynamically: concurrent requests are gathered into one call."""
    _waiting: list[_Waiting] = attrs.field(init=False, factory=list)
    _collecting: bool = attrs.field(init=False, default=False)

    def __attrs_post_init__(self) -> None:
        self.gathers = self.max_batch > 0 and all(r._batching is not None for r in self.runners)
        self._params = tuple(
            r.instances[0].params if r._with_params else None for r in self.runners
        )
        self._call = jax.jit(self._traced)

    def current(self, runners: Sequence[object]) -> bool:
        """Whether this fusion was built for exactly these runners (none reloaded)."""
        return len(runners) == len(self.runners) and all(
            a is b for a, b in zip(runners, self.runners, strict=True)
        )

    def _steps(self, params: tuple[Any, ...], inputs: Mapping[str, Any]) -> list[Any]:
        board = dict(inputs)
        produced = []
        for plan, runner, own in zip(self.order, self.runners, params, strict=True):
            args = {name: board[tensor] for name, tensor in plan.inputs if tensor in board}
            execute = runner.model.execute
            assert execute is not None
            result = execute(own, **args) if runner._with_params else execute(**args)
            produced.append(result)
            for name, tensor in plan.outputs:
                if name in result:
                    board[tensor] = result[name]
        produced.append({name: board[name] for name in self.outputs if name in board})
        return produced

    def _traced(self, params: tuple[Any, ...], inputs: Mapping[str, Any]) -> Any:
        return self._steps(params, inputs)[-1]

    @staticmethod
    def signature(inputs: Tensors) -> Signature:
        """The input names, shapes and dtypes a compilation is for."""
        return tuple(sorted((n, v.shape, v.dtype.str) for n, v in inputs.items()))

    def state(self, signature: Signature) -> str:
        """ "ready", "refused", "compiling", or "new"."""
        if signature in self._ready:
            return "ready"
        if signature in self._refused:
            return "refused"
        return "compiling" if signature in self._compiling else "new"

    async def prepare(self, signature: Signature, inputs: Tensors) -> None:
        """Check every step's abstract outputs for these inputs and compile, in a worker
        thread; the signature is then ready, or refused. A gathering fusion compiles every
        batch size it pads to (powers of two up to max_batch) for these per-row shapes at
        once, so that later batches never wait for a compilation."""
        self._compiling.add(signature)
        try:
            ok = await trio.to_thread.run_sync(self._check_and_compile, dict(inputs))
            if ok and self.gathers:
                for size in sorted(
                    {_bucket(n, self.max_batch) for n in range(1, self.max_batch + 1)}
                ):
                    resized = {n: np.repeat(v[:1], size, axis=0) for n, v in inputs.items()}
                    other = self.signature(resized)
                    if other != signature and self.state(other) == "new":
                        ready = await trio.to_thread.run_sync(self._check_and_compile, resized)
                        (self._ready if ready else self._refused).add(other)
        finally:
            self._compiling.discard(signature)
        if ok and not self._ready:
            steps = ", ".join(f"'{r.model.name}'" for r in self.runners)
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
        try:
            abstract = jax.eval_shape(self._steps, self._params, inputs)
            for runner, outputs in zip(self.runners, abstract, strict=False):
                if _abstract_problem(runner.model.config, outputs) is not None:
                    return False
                if rows is not None and any(o.shape[0] != rows for o in outputs.values()):
                    return False  # a batching model returns one row per input row
            jax.block_until_ready(self._call(self._params, inputs))  # type: ignore[no-untyped-call]
        except Exception:  # whatever tracing raised: the scheduler runs (and reports) it
            return False
        return True

    def run(self, inputs: Tensors, rows: Sequence[int]) -> dict[str, np.ndarray[Any, Any]] | None:
        """The ensemble's outputs for ``inputs`` (a ready signature), or None when the call
        raised (the scheduler then runs the requests and reports the failing step).
        ``rows``: the rows of each request in ``inputs`` (one request: its batch size)."""
        started = time.perf_counter_ns()
        try:
            raw = self._call(self._params, inputs)
            outputs = {name: np.asarray(value) for name, value in raw.items()}
        except Exception:
            self._refused.add(self.signature(inputs))
            self._ready.discard(self.signature(inputs))
            return None
        elapsed = time.perf_counter_ns() - started
        share = elapsed // len(self.runners)
        for runner in self.runners:
            for count in rows:
                runner.stats.request_finished(None, share, count)
            runner.stats.execution_finished(0, 0, share, 0, requests=len(rows))
        if elapsed > THREAD_ABOVE_NS:
            self._slow_streak += 1
            self.slow = self._slow_streak >= 3
        else:
            self._slow_streak = 0
        return outputs

    def idle(self) -> bool:
        """Whether every composing model has an idle inline instance and nothing queued."""
        for runner in self.runners:
            if runner._queued or (runner._batching is not None and len(runner._batching)):
                return False
            if not any(i.inline and not i.busy for i in runner.instances):
                return False
        return True

    async def gather(
        self, inputs: Tensors, rows: int, usable: Callable[[], bool]
    ) -> dict[str, np.ndarray[Any, Any]] | None:
        """This request's rows of a fused call shared with the requests that arrive in the
        same scheduling pass (as a batcher with no queue delay would gather them); None: take
        the scheduler's path.

        The first request to arrive collects: it lets the others of this pass arrive (one
        checkpoint, shielded so that the ones waiting on it are never left behind), runs
        their batches, at most ``max_batch`` rows each, and hands each its rows. ``usable``
        says, at that moment, whether fusing is still right (nothing queued, not closing).
        """
        me = _Waiting(inputs, rows)
        self._waiting.append(me)
        if self._collecting:
            await me.done.wait()
            return me.outputs
        self._collecting = True
        try:
            with trio.CancelScope(shield=True):
                await trio.lowlevel.checkpoint()
        finally:
            self._collecting = False
        taken, self._waiting = self._waiting, []
        try:
            if usable():
                for batch in self._batches(taken):
                    await self._run_batch(batch)
        finally:
            for waiting in taken:  # the ones given no outputs take the scheduler's path
                waiting.done.set()
        return me.outputs

    def _batches(self, taken: list[_Waiting]) -> list[list[_Waiting]]:
        """Requests that agree on names, dtypes and per-row shapes, at most max_batch rows."""
        groups: dict[tuple[Any, ...], list[list[_Waiting]]] = {}
        for waiting in taken:
            key = tuple(sorted((n, v.dtype.str, v.shape[1:]) for n, v in waiting.inputs.items()))
            chunks = groups.setdefault(key, [[]])
            if sum(w.rows for w in chunks[-1]) + waiting.rows > self.max_batch:
                chunks.append([])
            chunks[-1].append(waiting)
        return [chunk for chunks in groups.values() for chunk in chunks]

    async def _run_batch(self, batch: list[_Waiting]) -> None:
        rows = [w.rows for w in batch]
        total = sum(rows)
        pad = _bucket(total, self.max_batch) - total
        inputs = {}
        for name in batch[0].inputs:
            parts = [w.inputs[name] for w in batch]
            if pad:  # copies of the last row: computed, then dropped
                parts.append(np.repeat(parts[-1][-1:], pad, axis=0))
            inputs[name] = parts[0] if len(parts) == 1 else np.concatenate(parts)
        signature = self.signature(inputs)
        state = self.state(signature)
        if state == "new":
            await self.prepare(signature, inputs)
            state = self.state(signature)
        if state != "ready":
            return
        outputs = self.run(inputs, rows)
        if outputs is None:
            return
        offset = 0
        for waiting, count in zip(batch, rows, strict=True):
            waiting.outputs = {n: v[offset : offset + count] for n, v in outputs.items()}
            offset += count
