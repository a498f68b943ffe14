"""Checking tensors against a model's declared inputs and outputs.

Requests are checked strictly, as Triton does: the exact data type, the declared rank, every
fixed dimension, and the batch dimension against ``max_batch_size``. A failure is the caller's
fault (`InvalidRequestError`) for inputs and the model's (`ValueError`, turned into an
`InferenceError` by the runner) for outputs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ._config import ModelConfig, TensorConfig
from ._dtypes import DataType
from ._errors import InvalidRequestError
from ._messages import Tensors


def expected_shape(tensor: TensorConfig, max_batch_size: int) -> tuple[int, ...]:
    """The full shape of ``tensor`` as seen by clients, -1 for any size (batch included)."""
    return ((-1,) if max_batch_size > 0 else ()) + tensor.dims


def _shape_error(
    tensor: TensorConfig, array: np.ndarray[Any, Any], max_batch_size: int
) -> str | None:
    shape = expected_shape(tensor, max_batch_size)
    if len(array.shape) != len(shape) or any(
        want not in (-1, got) for want, got in zip(shape, array.shape, strict=True)
    ):
        return f"has shape {list(array.shape)}, expected [{','.join(str(d) for d in shape)}]"
    if max_batch_size > 0:
        batch = array.shape[0]
        if not 1 <= batch <= max_batch_size:
            return f"has batch size {batch}, expected 1 to {max_batch_size}"
    return None


def as_bytes_array(value: Any) -> np.ndarray[Any, Any]:
    """An ``object`` array of ``bytes`` (str elements are UTF-8 encoded).

    Raises:
        TypeError: an element is neither bytes nor str.
    """
    array = np.asarray(value, dtype=object)
    out = np.empty(array.shape, dtype=object)
    for index, item in np.ndenumerate(array):
        if isinstance(item, str):
            item = item.encode()
        elif isinstance(item, np.bytes_ | bytearray | memoryview):
            item = bytes(item)
        if not isinstance(item, bytes):
            raise TypeError(f"BYTES elements must be bytes or str, got {type(item).__name__}")
        out[index] = item
    return out


def check_inputs(
    config: ModelConfig, inputs: Mapping[str, Any], *, model: str | None = None
) -> dict[str, np.ndarray[Any, Any]]:
    """Validate and normalise request inputs against ``config``.

    Returns:
        the inputs as numpy arrays (BYTES as ``object`` arrays of ``bytes``).

    Raises:
        InvalidRequestError: a missing required input, an unknown input, a wrong data type,
            a wrong shape or a batch size out of range; the message names model and input.
    """
    label = f"model '{model or config.name}'"
    problems: list[str] = []
    unknown = sorted(set(inputs) - {t.name for t in config.input})
    if unknown:
        problems.append(
            "unexpected inputs "
            + ", ".join(f"'{n}'" for n in unknown)
            + f" (inputs: {', '.join(t.name for t in config.input)})"
        )
    out: dict[str, np.ndarray[Any, Any]] = {}
    batch_sizes: set[int] = set()
    for tensor in config.input:
        value = inputs.get(tensor.name)
        if value is None:
            if not tensor.optional:
                problems.append(f"missing required input '{tensor.name}'")
            continue
        if tensor.data_type is DataType.BYTES and not isinstance(value, np.ndarray):
            try:
                value = as_bytes_array(value)
            except TypeError as exc:
                problems.append(f"input '{tensor.name}': {exc}")
                continue
        array = value if isinstance(value, np.ndarray) else np.asarray(value)
        if tensor.data_type is DataType.BYTES:
            if array.dtype.kind not in "OSU":
                problems.append(
                    f"input '{tensor.name}' has data type {_type_name(array)}, expected BYTES"
                )
                continue
            try:
                if array.dtype.kind != "O" or not _all_bytes(array):
                    array = as_bytes_array(array)
            except TypeError as exc:
                problems.append(f"input '{tensor.name}': {exc}")
                continue
        elif array.dtype != tensor.data_type.numpy_dtype:
            problems.append(
                f"input '{tensor.name}' has data type {_type_name(array)}, "
                f"expected {tensor.data_type.value}"
            )
            continue
        error = _shape_error(tensor, array, config.max_batch_size)
        if error:
            problems.append(f"input '{tensor.name}' {error}")
            continue
        if config.max_batch_size > 0:
            batch_sizes.add(array.shape[0])
        out[tensor.name] = array
    if len(batch_sizes) > 1:
        problems.append(f"inputs disagree on the batch size: {sorted(batch_sizes)}")
    if problems:
        raise InvalidRequestError(f"{label}: " + "; ".join(problems))
    return out


def _all_bytes(array: np.ndarray[Any, Any]) -> bool:
    # Exactly bytes: np.bytes_ is a subclass and must be converted like the other kinds.
    return all(type(x) is bytes for x in array.flat)


def _type_name(array: np.ndarray[Any, Any]) -> str:
    try:
        return DataType.from_numpy(array.dtype).value
    except ValueError:
        return str(array.dtype)


def check_outputs(config: ModelConfig, outputs: Mapping[str, Any]) -> Tensors:
    """Validate a model's ``execute`` result against its declared outputs.

    Missing outputs are allowed (the response leaves them out).

    Raises:
        ValueError: not a mapping, an undeclared output name, a wrong data type or shape.
    """
    if not isinstance(outputs, Mapping):
        raise ValueError(f"execute must return a dict of outputs, got {type(outputs).__name__}")
    result: dict[str, np.ndarray[Any, Any]] = {}
    for name, value in outputs.items():
        tensor = config.output_named(name)
        if tensor is None:
            raise ValueError(
                f"execute returned unknown output '{name}' "
                f"(outputs: {', '.join(t.name for t in config.output)})"
            )
        if tensor.data_type is DataType.BYTES:
            array = as_bytes_array(value)
        else:
            array = np.asarray(value)
            if array.dtype != tensor.data_type.numpy_dtype:
                raise ValueError(
                    f"output '{name}' has data type {_type_name(array)}, "
                    f"expected {tensor.data_type.value}"
                )
        try:
            array = undo_reshape(tensor, array, config.max_batch_size)
        except ValueError as exc:
            raise ValueError(f"output '{name}' cannot take its declared dims: {exc}") from exc
        error = _shape_error(tensor, array, config.max_batch_size)
        if error:
            raise ValueError(f"output '{name}' {error}")
        result[name] = array
    return result


def apply_reshape(
    tensor: TensorConfig, array: np.ndarray[Any, Any], max_batch_size: int
) -> np.ndarray[Any, Any]:
    """The array as the model sees it when ``tensor`` has a ``reshape``."""
    if tensor.reshape is None:
        return array
    lead = array.shape[:1] if max_batch_size > 0 else ()
    return array.reshape(lead + tensor.reshape.shape)


def undo_reshape(
    tensor: TensorConfig, array: np.ndarray[Any, Any], max_batch_size: int
) -> np.ndarray[Any, Any]:
    """A model output with ``reshape`` back in the declared ``dims``."""
    if tensor.reshape is None:
        return array
    lead = array.shape[:1] if max_batch_size > 0 else ()
    return array.reshape(lead + tensor.dims)
