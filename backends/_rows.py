"""The rows of a batch: requests' inputs joined along the batch dimension and padded, a
batched execution's outputs cut back into each request's rows; on a JAX accelerator, on its
device.

How this works: rows of device arrays (a jitted step's outputs inside an ensemble) are
joined, cut and padded on their accelerator with operations whose sizes are static (an
index or a fill value given as a Python number would itself be copied to the device). On a
machine with no accelerator a JAX array already is host memory: it is cut as a numpy view
of the same buffer (no copy), which costs well under a microsecond where a JAX operation
costs ten. The runtime (the batcher, sequences, fusion) calls these and imports no JAX.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..protocols import (
    InferRequest,
    ParameterizedOutputs,
    Tensors,
    is_device_array,
    parameters_of,
)

ON_ACCELERATOR = any(d.platform != "cpu" for d in jax.devices())
"""The process has a JAX accelerator: device arrays' rows are handled on the device."""


def on_device(array: Any) -> bool:
    """Whether ``array``'s rows are cut and joined on its device (see above)."""
    return ON_ACCELERATOR and is_device_array(array)


def rows_view(array: Any) -> Any:
    """``array`` ready to be cut: itself on an accelerator, else a numpy view (no copy)."""
    return array if type(array) is np.ndarray or on_device(array) else np.asarray(array)


def concatenate(parts: Sequence[Any]) -> Any:
    """``parts`` joined on the batch dimension: on the device where one is an accelerator's
    array (no trip to the host), else with numpy."""
    if any(on_device(p) for p in parts):
        return jnp.concatenate(parts)
    return np.concatenate([rows_view(p) for p in parts])


def take_rows(array: Any, start: int, stop: int) -> Any:
    """Rows ``start:stop`` (a view of a host array; a slice on an accelerator's array)."""
    if on_device(array):
        return jax.lax.slice_in_dim(array, start, stop, axis=0)
    return rows_view(array)[start:stop]


def repeat_last_row(array: Any, count: int) -> Any:
    """``count`` copies of the array's last row (on its device for an accelerator's array)."""
    if on_device(array):
        last = jax.lax.slice_in_dim(array, array.shape[0] - 1, array.shape[0], axis=0)
        return jnp.broadcast_to(last, (count, *array.shape[1:]))
    return np.repeat(rows_view(array)[-1:], count, axis=0)


def join_inputs(requests: Sequence[InferRequest], padded: int) -> dict[str, Any]:
    """The batched inputs: each input concatenated along the batch dimension, then padded
    with zero rows (for a jitted model, up to a compiled size)."""
    joined: dict[str, Any] = {}
    for name in requests[0].inputs:
        parts = [r.inputs[name] for r in requests]
        array: Any = concatenate(parts) if len(parts) > 1 else parts[0]
        missing = padded - array.shape[0]
        if missing > 0:
            filler: Any
            if on_device(array):  # zeros uploaded explicitly: no data goes to the host
                zeros = np.zeros((missing, *array.shape[1:]), dtype=array.dtype)
                filler = jax.device_put(zeros, next(iter(array.devices())))
            else:
                filler = np.zeros((missing, *array.shape[1:]), dtype=array.dtype)
                if array.dtype.kind == "O":
                    filler[...] = b""
            array = concatenate([array, filler])
        joined[name] = array
    return joined


def split_outputs(outputs: Tensors, rows: Sequence[int]) -> list[dict[str, Any]]:
    """Each request's rows of the batched outputs.

    Raises:
        ValueError: an output does not have one row per input row.
    """
    needed = sum(rows)
    for name, array in outputs.items():
        if array.ndim == 0 or array.shape[0] < needed:
            raise ValueError(
                f"output '{name}' has shape {list(array.shape)}: a batching model must return "
                f"one row per input row ({needed} or more)"
            )
    views = {name: rows_view(array) for name, array in outputs.items()}  # once per batch
    parts: list[dict[str, Any]] = []
    start = 0
    for count in rows:
        parts.append({name: take_rows(a, start, start + count) for name, a in views.items()})
        start += count
    own = parameters_of(outputs)
    if own and len(parts) == 1:  # one request's own response: its parameters are its own
        return [ParameterizedOutputs(parts[0], own)]
    return parts
