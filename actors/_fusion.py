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
        and runner._batching is None
        and not runner._takes_request
        and runner._plain_arguments
        and runner.observer is None
        and runner.tracing is None
        and config.max_batch_size == max_batch_size
        and all(i.device == jax.devices()[0] for i in runner.instances)
    )


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

    def __attrs_post_init__(self) -> None:
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
        thread; the signature is then ready, or refused."""
        self._compiling.add(signature)
        try:
            ok = await trio.to_thread.run_sync(self._check_and_compile, dict(inputs))
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
        try:
            abstract = jax.eval_shape(self._steps, self._params, inputs)
            for runner, outputs in zip(self.runners, abstract, strict=False):
                if _abstract_problem(runner.model.config, outputs) is not None:
                    return False
            jax.block_until_ready(self._call(self._params, inputs))  # type: ignore[no-untyped-call]
        except Exception:  # whatever tracing raised: the scheduler runs (and reports) it
            return False
        return True

    def run(self, inputs: Tensors, batch: int) -> dict[str, np.ndarray[Any, Any]] | None:
        """The ensemble's outputs for ``inputs`` (a ready signature), or None when the call
        raised (the scheduler then runs the request and reports the failing step)."""
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
            runner.stats.request_finished(None, share, batch)
            runner.stats.execution_finished(0, 0, share, 0)
        if elapsed > THREAD_ABOVE_NS:
            self._slow_streak += 1
            self.slow = self._slow_streak >= 3
        else:
            self._slow_streak = 0
        return outputs

    def idle(self) -> bool:
        """Whether every composing model has an idle inline instance and nothing queued."""
        for runner in self.runners:
            if runner._queued or not any(i.inline and not i.busy for i in runner.instances):
                return False
        return True
