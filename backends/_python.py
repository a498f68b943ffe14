"""The plain-Python backend: ``execute`` called as it is (``JIT = False``).

How this works: for work JAX cannot trace (decoding bytes, strings, I/O, calling other
libraries), ``execute`` is a plain function, an ``async def`` (it runs on the event loop and
may await), or, for a decoupled model, a generator or async generator (each ``yield`` one
response). Its array arguments are read-only views: an array can be shared with a sibling
step or be the caller's own, so writing into it would corrupt someone else's data. A
stateful model's new state is copied when it holds numpy arrays, which may be the very
arrays returned as outputs. Nothing is compiled, so a first call never has to wait.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from ._base import Capabilities, LoadedInstance
from ._function import FunctionBackend, function_of, host_outputs, on_host, placement_problems

if TYPE_CHECKING:
    from ..protocols import Model


def _copied(state: Any) -> Any:
    return jax.tree_util.tree_map(
        lambda leaf: np.array(leaf, copy=True) if isinstance(leaf, np.ndarray) else leaf, state
    )


class PythonBackend(FunctionBackend):
    """``execute`` as plain Python: sync, async, or a (async) generator for streams."""

    def __init__(self, model: Model) -> None:
        execute = function_of(model).execute
        super().__init__(model, execute)
        config = model.config
        self.capabilities = Capabilities(
            is_async=inspect.iscoroutinefunction(execute),
            streaming=config.decoupled,
            stateful=self._stateful,
            # A model taking `request` sees one request's metadata: it is not batched.
            batching=(
                config.dynamic_batching is not None
                and config.max_batch_size > 0
                and not self._takes_request
                and not config.decoupled
            ),
            thread_safe=True,
            compiles=False,
            takes_request=self._takes_request,
            traceable=False,
        )

    def _view(self, value: Any) -> Any:
        if not isinstance(value, np.ndarray):  # a jitted step's output, still on its device
            value = on_host(value)
        value = value.view()
        value.flags.writeable = False
        return value

    def execute(
        self, instance: LoadedInstance, arguments: Mapping[str, Any]
    ) -> tuple[Mapping[str, Any], Any]:
        """One call; array-likes among its outputs become numpy arrays."""
        outputs, new_state = self.split_state(self.call(instance, arguments))
        return host_outputs(outputs), self._keep(new_state)

    async def execute_async(
        self, instance: LoadedInstance, arguments: Mapping[str, Any]
    ) -> tuple[Mapping[str, Any], Any]:
        """One awaited call of an ``async def execute``."""
        outputs, new_state = self.split_state(await self.call(instance, arguments))
        return outputs, self._keep(new_state)

    def _keep(self, new_state: Any) -> Any:
        return _copied(new_state) if self._stateful else None

    def open_stream(
        self, instance: LoadedInstance, arguments: Mapping[str, Any]
    ) -> Iterator[Any] | AsyncIterator[Any]:
        """The generator ``execute`` returns for one request."""
        generator: Iterator[Any] | AsyncIterator[Any] = self.call(instance, arguments)
        return generator


def python_problems(model: Model, where: str, in_config: str) -> list[str]:
    """Why ``model``'s code cannot run as plain Python (empty: it can)."""
    return placement_problems(model, in_config)
