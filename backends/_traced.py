"""Several models' traceable ``execute`` functions as one compiled JAX call (an ensemble's
``fusion: xla``), behind the backends' seam so that the runtime (``orchestrion.actors``)
imports no JAX: `TracedCall` compiles a function of all the steps, gives the abstract
values it would produce for given inputs (checked before anything runs) and runs it,
waiting until its outputs are computed (they stay on the device that computed them)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax


class TracedCall:
    """``steps(params, inputs)`` compiled with ``jax.jit``: ``steps`` returns a list whose
    last item is the call's result, the items before it what each step took and gave (which
    `abstract` shows, and the compiled call drops)."""

    def __init__(self, steps: Callable[[Any, Mapping[str, Any]], list[Any]]) -> None:
        self._steps = steps
        self._call = jax.jit(lambda params, inputs: steps(params, inputs)[-1])

    def abstract(self, params: Any, inputs: Mapping[str, Any]) -> list[Any]:
        """What ``steps`` would return for ``inputs``, as shapes and dtypes (traced, not run).

        Raises:
            Exception: whatever tracing raised.
        """
        return jax.eval_shape(self._steps, params, inputs)  # type: ignore[no-any-return]

    def __call__(self, params: Any, inputs: Mapping[str, Any]) -> Any:
        """Run the compiled call (compiling it first for new shapes) and wait for its
        result, which stays where it was computed."""
        return jax.block_until_ready(self._call(params, inputs))  # type: ignore[no-untyped-call]


def on_default_device(devices: list[Any]) -> bool:
    """Whether every one of ``devices`` is JAX's default device (where a traced call runs)."""
    default = jax.devices()[0]
    return all(device == default for device in devices)
