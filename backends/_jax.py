"""The JAX backend: ``execute`` compiled with ``jax.jit``, each instance on its device.

How this works: at load, every instance's ``initialize`` result is placed on its device and
``execute`` is compiled for the declared input shapes (batch sizes 1 and ``max_batch_size``,
or every size a batching model pads to), then timed: the median of five calls tells the
runner whether the model is short enough to run inline on the event loop. Shapes that are
not declared (``-1`` dimensions, optional inputs, other batch sizes) compile on first use,
which the runner moves to a worker thread. Outputs stay device arrays (waited for, not
copied): an ensemble's next jitted step takes them where they are, and the runtime copies a
tensor to the host only where it must (the client's response, the cache, a plain-Python
step). A model with a 64-bit input or output (INT64, UINT64, FP64)
is traced, compiled and run with JAX's 64-bit types switched on for its own calls only
(``jax.enable_x64``, which is scoped to the calling thread), so its token ids stay exact
while every other model in the process keeps JAX's 32-bit default. Such a model is not fused
into an ensemble's one traced function (that function is traced once, for all its steps).
"""

from __future__ import annotations

import contextlib
import inspect
import time
from collections.abc import Callable, Hashable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from ..protocols import (
    DataType,
    InferRequest,
    ModelConfig,
    ModelLoadError,
    Tensors,
    bytes_tensors,
)
from ._base import Capabilities, LoadedInstance
from ._function import FunctionBackend, function_of, placement_problems, takes_request

if TYPE_CHECKING:
    from ..protocols import Model

_WIDE = (DataType.INT64, DataType.UINT64, DataType.FP64)


_DEFAULT_DEVICE = jax.devices()[0]


def _moved(arguments: Mapping[str, Any], device: Any) -> Mapping[str, Any]:
    """``arguments`` with device arrays that live elsewhere moved to ``device`` (an
    explicit device-to-device copy; host arrays are left for jit to copy)."""
    moved = dict(arguments)
    for name, value in arguments.items():
        if isinstance(value, jax.Array) and value.devices() != {device}:
            moved[name] = jax.device_put(value, device)
    return moved


def wide_tensors(config: ModelConfig) -> list[str]:
    """The model's 64-bit inputs and outputs (computed with JAX's 64-bit types on)."""
    return [t.name for t in (*config.input, *config.output) if t.data_type in _WIDE]


@contextlib.contextmanager
def _x64() -> Iterator[None]:
    with jax.enable_x64(True):
        yield


def padded_sizes(config: ModelConfig) -> tuple[int, ...]:
    """The batch sizes a jitted batching model is compiled for (ascending): powers of two up
    to ``max_batch_size``, the preferred sizes and ``max_batch_size`` itself."""
    top = config.max_batch_size
    sizes = {top}
    size = 1
    while size < top:
        sizes.add(size)
        size *= 2
    batching = config.dynamic_batching
    if batching is not None:
        sizes.update(s for s in batching.preferred_batch_size if s <= top)
    return tuple(sorted(sizes))


class JaxBackend(FunctionBackend):
    """``execute`` under ``jax.jit``, its instances placed on JAX devices."""

    def __init__(self, model: Model) -> None:
        super().__init__(model, jax.jit(function_of(model).execute))
        config = model.config
        batching = config.dynamic_batching is not None and config.max_batch_size > 0
        self._wide = bool(wide_tensors(config))
        """64-bit tensors: every call (trace, compile, run, placement) with x64 on."""
        self.capabilities = Capabilities(
            is_async=False,
            streaming=False,
            stateful=self._stateful,
            batching=batching,
            thread_safe=True,
            compiles=True,
            takes_request=False,
            traceable=all(t.reshape is None for t in config.output) and not self._wide,
        )
        self.padded_sizes = padded_sizes(config) if batching else ()
        self._names = tuple(t.name for t in config.input)
        self.variable_shapes = config.max_batch_size > 1 or any(
            -1 in t.dims or t.optional for t in config.input
        )
        self._plain = all(t.reshape is None for t in config.input)

    def _place(self, tree: Any, device: Any) -> Any:
        if self._wide:
            with _x64():
                return jax.device_put(tree, device)
        return jax.device_put(tree, device)

    def call(self, instance: LoadedInstance, arguments: Mapping[str, Any]) -> Any:
        """Call the compiled ``execute`` once (compiling it first for new shapes)."""
        if self._wide:
            with _x64():
                return super().call(instance, arguments)
        return super().call(instance, arguments)

    def signature(self, inputs: Tensors) -> Hashable | None:
        """The input shapes as jit sees them (one compilation each)."""
        return tuple(inputs[n].shape if n in inputs else None for n in self._names)

    def arguments(
        self, request: InferRequest, state: Any, instance: LoadedInstance
    ) -> Mapping[str, Any]:
        """The request's inputs as they are (jit copies host arrays to the device; a device
        array on another device is moved there), reshaped where the config says; a stateful
        model's state placed on the instance's device."""
        args: Mapping[str, Any]
        if self._stateful:
            args = {**self._inputs(request), "state": self._place(state, instance.device)}
        elif self._plain:
            args = request.inputs
        else:
            args = self._inputs(request)
        if instance.device is not _DEFAULT_DEVICE:
            args = _moved(args, instance.device)
        return args

    def execute(
        self, instance: LoadedInstance, arguments: Mapping[str, Any]
    ) -> tuple[Mapping[str, Any], Any]:
        """One compiled call, waited for; its outputs stay device arrays (the next jitted
        step takes them as they are; the runtime copies them to the host only where they
        leave: a response, the cache, a plain-Python step)."""
        if self._wide:
            with _x64():
                return self._execute(instance, arguments)
        return self._execute(instance, arguments)

    def _execute(
        self, instance: LoadedInstance, arguments: Mapping[str, Any]
    ) -> tuple[Mapping[str, Any], Any]:
        fn = self._fn
        raw = fn(instance.params, **arguments) if self._with_params else fn(**arguments)
        if self._stateful:
            raw, new_state = self.split_state(raw)
        else:
            new_state = None
        # Waiting here (no copy) keeps the execution's time and errors in this call: JAX
        # dispatches asynchronously. (Written out: jax.block_until_ready walks a pytree.)
        if type(raw) is dict:
            for value in raw.values():
                if type(value) is not np.ndarray:
                    wait = getattr(value, "block_until_ready", None)
                    if wait is not None:
                        wait()
            return raw, new_state
        return jax.block_until_ready(raw), new_state  # type: ignore[no-untyped-call]

    def traceable(self) -> Callable[..., Mapping[str, Any]]:
        """``fn(params, **inputs)``: ``execute`` itself, not its compiled form."""
        execute = self.code.execute
        if self._with_params:
            return execute

        def without_params(params: Any, **inputs: Any) -> Mapping[str, Any]:
            result: Mapping[str, Any] = execute(**inputs)
            return result

        return without_params

    def load(self) -> list[LoadedInstance]:
        """Initialise, place, compile and time every instance."""
        with _x64() if self._wide else contextlib.nullcontext():
            instances = super().load()
        for instance in instances:
            self._warm_up(instance)
        return instances

    def _warm_up(self, instance: LoadedInstance) -> None:
        """Compile ``execute`` for the declared shapes before the model reports ready.

        With ``max_batch_size > 0``, batch sizes 1 and ``max_batch_size`` are compiled (a
        batching model: every size it pads to); any other shape compiles on first use.
        """
        config = self.config
        if any(-1 in t.dims for t in config.input):
            return  # shapes unknown until requests arrive: compiled on first use
        batches = sorted({1, config.max_batch_size}) if config.max_batch_size > 0 else [0]
        if self.padded_sizes:  # a batching model pads to these sizes: none compiles under load
            batches = list(self.padded_sizes)
        try:
            for batch in reversed(batches):
                lead = (batch,) if batch else ()
                inputs = {
                    t.name: np.zeros(lead + t.dims, dtype=t.data_type.numpy_dtype)
                    for t in config.input
                    if not t.optional
                }
                request = InferRequest(model_name=config.name, inputs=inputs)
                args = self.arguments(request, self.initial_state(), instance)
                self.call(instance, args)  # compiles
                instance.compiled.add(self.signature(inputs))
            timings = []
            for _ in range(5):  # the smallest batch, compiled: time it
                start = time.perf_counter_ns()
                self.execute(instance, args)
                timings.append(time.perf_counter_ns() - start)
            instance.typical_ns = sorted(timings)[len(timings) // 2]
        except Exception as exc:
            lead = (max(batches),) if max(batches) else ()
            shapes = ", ".join(f"{t.name}: {list(lead + t.dims)}" for t in config.input)
            raise ModelLoadError(
                f"{self.model.source} (model '{self.model.name}'): compiling execute at load "
                f"for the declared shapes ({shapes}; a leading batch dimension of 1 and of "
                f"max_batch_size) failed: {type(exc).__name__}: {exc}"
            ) from exc


def jax_problems(model: Model, where: str, in_config: str) -> list[str]:
    """Why ``model``'s code cannot run under ``jax.jit`` (empty: it can)."""
    config = model.config
    execute = function_of(model).execute
    errors = placement_problems(model, in_config)
    generator = inspect.isgeneratorfunction(execute) or inspect.isasyncgenfunction(execute)
    if generator and config.decoupled:  # not decoupled: the contract's own error says why
        errors.append(
            f"{where}: jax.jit cannot compile a generator; set JIT = False (and call jitted "
            "functions inside execute)"
        )
    if inspect.iscoroutinefunction(execute):
        errors.append(f"{where}: an async execute cannot be jitted; set JIT = False")
    if bytes_tensors(config):
        errors.append(
            f"{where}: BYTES tensors ({', '.join(bytes_tensors(config))}) cannot pass through "
            "jax.jit; set JIT = False in the model (or jit=False)"
        )
    if takes_request(model):
        errors.append(
            f"{where}: only plain-Python models (JIT = False) can take the request's metadata "
            "as a 'request' parameter"
        )
    return errors
