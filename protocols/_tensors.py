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

from ._bytes_wire import element_bytes
from ._config import ModelConfig, TensorConfig
from ._dtypes import DataType
from ._errors import InvalidRequestError
from ._messages import Tensors

_DEVICE_TYPES: set[type] = set()
_OTHER_TYPES: set[type] = {np.ndarray}


def is_device_array(value: Any) -> bool:
    """Whether ``value`` is an array an accelerator library holds (a JAX array on a device):
    no numpy array, but a numpy ``dtype``, a ``shape`` and ``__array__``. Such a tensor
    travels between models as it is; checks read only its dtype and shape, never its data,
    so an ensemble's intermediates can stay on their device. (Decided once per type: it
    runs for every tensor.)"""
    kind = type(value)
    if kind in _DEVICE_TYPES:
        return True
    if kind in _OTHER_TYPES:
        return False
    found = (
        not isinstance(value, np.ndarray | np.generic)  # numpy's own arrays and scalars
        and isinstance(getattr(value, "dtype", None), np.dtype)
        and hasattr(value, "shape")
        and hasattr(value, "__array__")
    )
    (_DEVICE_TYPES if found else _OTHER_TYPES).add(kind)
    return found


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
    flat = array.reshape(-1)
    out = np.empty(flat.size, dtype=object)
    for at in range(0, flat.size, _SLICE):  # in slices: each call into C is short
        items = flat[at : at + _SLICE].tolist()
        if set(map(type, items)) != _ONLY_BYTES:
            items = [element_bytes(item) for item in items]
        out[at : at + len(items)] = items
    return out.reshape(array.shape)


def check_inputs(  # noqa: C901 (per request: see docs/architecture.md)
    config: ModelConfig,
    inputs: Mapping[str, Any],
    *,
    model: str | None = None,
    counted: bool = True,
) -> dict[str, np.ndarray[Any, Any]]:
    """Validate and normalise request inputs against ``config``; ``counted``: a missing
    input is also said in Triton's words (``expected ... inputs but got ...``), for a
    client (an ensemble's step names the tensor instead).

    Returns:
        the inputs as numpy arrays (BYTES as ``object`` arrays of ``bytes``).

    Raises:
        InvalidRequestError: a missing required input, an unknown input, a wrong data type,
            a wrong shape or a batch size out of range; the message names model and input.
    """
    label = f"model '{model or config.name}'"
    problems: list[str] = [p for p in [_unknown_inputs_problem(config, inputs)] if p]
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
        keep = isinstance(value, np.ndarray) or is_device_array(value)
        array = value if keep else np.asarray(value)
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
        if tensor.reshape is not None:
            try:
                apply_reshape(tensor, array, config.max_batch_size)
            except ValueError:
                problems.append(
                    f"input '{tensor.name}' with shape {list(array.shape)} cannot take its "
                    f"reshape {list(tensor.reshape.shape)}"
                )
                continue
        if config.max_batch_size > 0:
            batch_sizes.add(array.shape[0])
        out[tensor.name] = array
    if len(batch_sizes) > 1:
        problems.append(f"inputs disagree on the batch size: {sorted(batch_sizes)}")
    if counted and any(not t.optional and inputs.get(t.name) is None for t in config.input):
        problems.append(_input_count_problem(config, inputs, model or config.name))
    if problems:
        raise InvalidRequestError(f"{label}: " + "; ".join(problems))
    return out


def _unknown_inputs_problem(config: ModelConfig, inputs: Mapping[str, Any]) -> str:
    """The inputs the model does not have, named ("": none)."""
    unknown = sorted(set(inputs) - {t.name for t in config.input})
    if not unknown:
        return ""
    names = ", ".join(f"'{n}'" for n in unknown)
    return f"unexpected inputs {names} (inputs: {', '.join(t.name for t in config.input)})"


def _input_count_problem(config: ModelConfig, inputs: Mapping[str, Any], model: str) -> str:
    """Triton's words for a request without all its required inputs (its clients and QA
    match them)."""
    required = sum(1 for t in config.input if not t.optional)
    total = len(config.input)
    wanted = (
        f"{required} inputs"
        if required == total
        else f"number of inputs between {required} and {total}"
    )
    given = sum(1 for value in inputs.values() if value is not None)
    return f"expected {wanted} but got {given} inputs for model '{model}'"


COSTLY_ELEMENTS = 1 << 16
"""BYTES elements beyond which checking a request's inputs is work for a worker thread."""
_SLICE = 1 << 16
"""Elements looked at per call into C (a short hold of the GIL each)."""
_ONLY_BYTES = {bytes}


def _all_bytes(array: np.ndarray[Any, Any]) -> bool:
    # Exactly bytes: np.bytes_ is a subclass and must be converted like the other kinds.
    flat = array.reshape(-1)
    return all(
        set(map(type, flat[at : at + _SLICE].tolist())) == _ONLY_BYTES
        for at in range(0, flat.size, _SLICE)
    )


def _type_name(array: np.ndarray[Any, Any]) -> str:
    try:
        return DataType.from_numpy(array.dtype).value
    except ValueError:
        return str(array.dtype)


def check_outputs(
    config: ModelConfig, outputs: Mapping[str, Any], *, shapes: bool = True
) -> Tensors:
    """Validate a model's ``execute`` result against its declared outputs (their shapes
    too, unless ``shapes`` is False).

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
            array = value if is_device_array(value) else np.asarray(value)
            if array.dtype != tensor.data_type.numpy_dtype:
                raise ValueError(
                    f"output '{name}' has data type {_type_name(array)}, "
                    f"expected {tensor.data_type.value}"
                )
        try:
            array = undo_reshape(tensor, array, config.max_batch_size)
        except ValueError as exc:
            if shapes:
                raise ValueError(f"output '{name}' cannot take its declared dims: {exc}") from exc
        error = _shape_error(tensor, array, config.max_batch_size) if shapes else None
        if error:
            raise ValueError(f"output '{name}' {error}")
        result[name] = array
    return result


def stored_outputs_problem(
    config: ModelConfig,
    outputs: Mapping[str, Any],
    batch: int,
    wanted: frozenset[str] | None,
) -> str | None:
    """Why ``outputs`` read from a cache cannot answer a request of ``batch`` inferences that
    asked for ``wanted`` (None: every output); None when they can.

    A cache shared with other writers (Redis) can hold anything under a key: the names, data
    types, shapes and batch size of a stored response are checked before it is served.
    """
    for name, value in outputs.items():
        tensor = config.output_named(name)
        if tensor is None:
            return f"it holds an output {name!r:.60} that the model does not have"
        if wanted is not None and name not in wanted:
            return f"it holds output '{name}', which the request did not ask for"
        if not isinstance(value, np.ndarray):
            return f"output '{name}' is not an array"
        if tensor.data_type is DataType.BYTES:
            if value.dtype != object:
                return f"output '{name}' has data type {_type_name(value)}, expected BYTES"
        elif value.dtype != tensor.data_type.numpy_dtype:
            return (
                f"output '{name}' has data type {_type_name(value)}, expected "
                f"{tensor.data_type.value}"
            )
        error = _shape_error(tensor, value, config.max_batch_size)
        if error:
            return f"output '{name}' {error}"
        if config.max_batch_size > 0 and value.shape[0] != batch:
            return f"output '{name}' has a batch of {value.shape[0]}, the request {batch}"
    return None


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


def match_batching(
    array: np.ndarray[Any, Any], dims: tuple[int, ...], max_batch_size: int
) -> np.ndarray[Any, Any]:
    """Add or remove a leading batch of 1 where only one side of an ensemble tensor batches.

    Triton lets a non-batching ``[16]`` tensor feed a batching model whose dims are ``[16]``
    (it becomes ``[1,16]``), and the other way round for a batch of exactly 1.
    """
    rank = len(dims) + (1 if max_batch_size > 0 else 0)
    if array.ndim == rank - 1 and max_batch_size > 0:
        return array[np.newaxis]
    if array.ndim == rank + 1 and max_batch_size == 0 and array.shape[0] == 1:
        return array.reshape(array.shape[1:])  # a device array stays on its device
    return array


class _Slow(Exception):
    """The fast path cannot decide: take the careful path (which explains any error)."""


class _Pattern:
    """A declared full shape, compiled for quick matching."""

    __slots__ = ("exact", "max_batch", "rank", "tail", "want")

    def __init__(self, want: tuple[int, ...], max_batch: int) -> None:
        self.want = want
        self.rank = len(want)
        self.max_batch = max_batch
        self.tail = want[1:] if max_batch > 0 else want
        self.exact = -1 not in self.tail

    def matches(self, shape: tuple[int, ...]) -> bool:
        if len(shape) != self.rank:
            return False
        if self.max_batch > 0:
            if not 1 <= shape[0] <= self.max_batch:
                return False
            tail = shape[1:]
        else:
            tail = shape
        if self.exact:
            return tail == self.tail
        return all(w in (-1, g) for w, g in zip(self.tail, tail, strict=True))


class TensorChecker:
    """`check_inputs` and `check_outputs` for one config, with a fast path.

    Requests that are right (the common case) are accepted after a few comparisons per
    tensor; anything unusual (BYTES, a reshape, a list instead of an array, any mismatch)
    goes through the careful functions, which normalise or explain.
    """

    def __init__(self, config: ModelConfig, output_shapes: bool = True) -> None:
        """Check tensors against ``config`` (outputs' shapes too unless ``output_shapes``
        is False: a backend whose outputs pass on in the shapes its code gives)."""
        self.config = config
        self.output_shapes = output_shapes
        mbs = config.max_batch_size
        self._max_batch = mbs
        self._inputs = tuple(
            (t.name, t.data_type.numpy_dtype, _Pattern(expected_shape(t, mbs), mbs), t.optional)
            for t in config.input
        )
        self._inputs_simple = all(
            t.data_type is not DataType.BYTES and t.reshape is None for t in config.input
        )
        self._bytes_inputs = tuple(t.name for t in config.input if t.data_type is DataType.BYTES)
        self._outputs = {
            t.name: (t.data_type.numpy_dtype, _Pattern(expected_shape(t, mbs), mbs))
            for t in config.output
            if t.data_type is not DataType.BYTES and t.reshape is None
        }

    def costly(self, inputs: Mapping[str, Any]) -> bool:
        """Whether checking ``inputs`` looks at many elements one by one (BYTES tensors of
        more than `COSTLY_ELEMENTS` elements in all, or BYTES given as lists): long enough
        to be done off the event loop."""
        if self._inputs_simple:
            return False
        elements = 0
        for name in self._bytes_inputs:
            value = inputs.get(name)
            if value is None:
                continue
            if type(value) is not np.ndarray:
                return True  # a list or other sequence: converted element by element
            elements += value.size
        return elements > COSTLY_ELEMENTS

    def inputs(self, inputs: Mapping[str, Any], *, adapt_batching: bool = False) -> Tensors:
        """Like `check_inputs`; returns ``inputs`` itself when it needed no conversion.

        Args:
            inputs: the request's tensors.
            adapt_batching: add or remove a leading batch of 1 where the rank is off by one
                (for tensors inside an ensemble, see `match_batching`).
        """
        if not self._inputs_simple:
            return self._careful(inputs, adapt_batching)
        out: dict[str, np.ndarray[Any, Any]] = {}
        batch = -1
        try:
            for name, dtype, want, optional in self._inputs:
                value = inputs.get(name)
                if value is None:
                    if optional:
                        continue
                    raise _Slow
                if type(value) is not np.ndarray and not is_device_array(value):
                    raise _Slow
                if value.dtype != dtype:
                    raise _Slow
                shape = value.shape
                if not want.matches(shape):
                    raise _Slow
                if self._max_batch:
                    if batch not in (-1, shape[0]):
                        raise _Slow
                    batch = shape[0]
                out[name] = value
            if len(out) != len(inputs):
                raise _Slow
        except _Slow:
            return self._careful(inputs, adapt_batching)
        # Everything checked and nothing converted: hand back the caller's own dict.
        return inputs if type(inputs) is dict else out

    def _careful(self, inputs: Mapping[str, Any], adapt_batching: bool) -> Tensors:
        if adapt_batching:
            mbs = self.config.max_batch_size
            dims = {t.name: t.dims for t in self.config.input}
            inputs = {
                name: match_batching(value, dims[name], mbs)
                if name in dims and (isinstance(value, np.ndarray) or is_device_array(value))
                else value
                for name, value in inputs.items()
            }
        return check_inputs(self.config, inputs, counted=not adapt_batching)

    def outputs(self, outputs: Any) -> Tensors:
        """Like `check_outputs`; raises ValueError for a bad result."""
        shapes = self.output_shapes
        if type(outputs) is not dict:
            return check_outputs(self.config, outputs, shapes=shapes)
        try:
            for name, value in outputs.items():
                spec = self._outputs.get(name)
                if spec is None:
                    raise _Slow
                if type(value) is not np.ndarray and not is_device_array(value):
                    raise _Slow
                if value.dtype != spec[0]:
                    raise _Slow
                if shapes and not spec[1].matches(value.shape):
                    raise _Slow
        except _Slow:
            return check_outputs(self.config, outputs, shapes=shapes)
        return outputs
