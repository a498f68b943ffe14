"""Tensors on the KServe v2 wire, for both front ends: data type names, shapes, raw bytes.

How this works: a tensor travels as its ``datatype`` name (``"FP32"``), its shape, and either
its raw little-endian bytes (HTTP's binary extension, gRPC's ``raw_*_contents``; BYTES elements
as 4-byte length prefixes) or its values one by one (HTTP's JSON ``data``, gRPC's typed
``contents``). Every shape is checked before any array is made, so a hostile one fails as an
`InvalidRequestError` instead of a numpy error or a huge allocation. Numeric tensors decoded
from bytes are read-only views of the message, not copies.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from ._bytes_wire import decode_bytes, encode_bytes
from ._dtypes import DataType
from ._errors import InvalidRequestError

MAX_DIM = 2**40
"""The largest dim accepted on the wire (numpy's own limit is 2**63 - 1 elements)."""
MAX_DIMS = 32
"""numpy's (and so orchestrion's) most dims per array."""


def data_type(name: object, tensor: str) -> DataType:
    """A tensor's wire ``datatype`` (``"FP32"``).

    Raises:
        InvalidRequestError: not a KServe v2 data type.
    """
    try:
        return DataType(name)
    except ValueError:
        raise InvalidRequestError(
            f"invalid datatype '{name!s:.40}' for tensor '{tensor}'"
        ) from None


def element_count(shape: Sequence[object], tensor: str, itemsize: int = 0) -> int:
    """Elements in a tensor of ``shape``, checking every dim (and, given the data type's
    ``itemsize``, that its byte size fits in 64 bits, as Triton checks).

    Raises:
        InvalidRequestError: a dim that is not a non-negative integer, too many dims, a
            count or byte size past 64 bits (Triton's words), or a dim too large for an
            array (even an empty one).
    """
    if len(shape) > MAX_DIMS:
        raise InvalidRequestError(
            f"invalid shape for tensor '{tensor}': {len(shape)} dims (at most {MAX_DIMS})"
        )
    for dim in shape:
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 0:
            raise InvalidRequestError(
                f"invalid shape {list(shape)!s:.80} for tensor '{tensor}': dims must be "
                "non-negative integers"
            )
    dims: Sequence[int] = shape  # type: ignore[assignment]  # checked just above
    count = math.prod(dims)
    if count > _INT64_MAX:
        raise InvalidRequestError(
            f"invalid shape for input '{tensor}': shape {list(dims)!s:.80} causes total element "
            f"count to exceed maximum size of {_INT64_MAX}"
        )
    if itemsize > 1 and count * itemsize > _INT64_MAX:
        raise InvalidRequestError(
            f"byte size overflow for input '{tensor}': element count ({count}) * data type size "
            f"({itemsize}) exceeds maximum allowed size ({_INT64_MAX})"
        )
    span = 1
    for dim in dims:
        if dim > MAX_DIM:
            raise InvalidRequestError(
                f"invalid shape {list(dims)!s:.80} for tensor '{tensor}': dim {dim} is too large"
            )
        span *= max(dim, 1)
    if span > MAX_DIM:  # numpy refuses such a shape even with a zero dim ("too big")
        raise InvalidRequestError(
            f"invalid shape {list(dims)!s:.80} for tensor '{tensor}': too large (the non-zero "
            f"dims multiply to more than {MAX_DIM})"
        )
    return count


_INT64_MAX = 2**63 - 1


def tensor_from_bytes(
    buffer: bytes | memoryview, dtype: DataType, shape: Sequence[int], tensor: str
) -> np.ndarray[Any, Any]:
    """A tensor from its raw bytes (no copy for numeric types; the array is read-only).

    Raises:
        InvalidRequestError: the byte size does not match the shape, or a BYTES element's
            length prefix runs past the end.
    """
    count = element_count(shape, tensor)
    if dtype is DataType.BYTES:
        return decode_bytes(buffer, count, tensor).reshape(tuple(shape))
    expected = count * dtype.numpy_dtype.itemsize
    if len(buffer) != expected:
        raise InvalidRequestError(
            f"unexpected total byte size {len(buffer)} for input '{tensor}', expecting {expected}"
        )
    array = np.frombuffer(buffer, dtype=dtype.numpy_dtype).reshape(tuple(shape))
    if dtype is DataType.BOOL and count and array.view(np.uint8).max() > 1:
        raise InvalidRequestError(f"input '{tensor}': BOOL elements must be bytes 0 or 1")
    return array


def tensor_to_bytes(array: np.ndarray[Any, Any]) -> bytes | memoryview:
    """An output tensor's raw bytes (BYTES: 4-byte little-endian length prefixes)."""
    if array.dtype.kind in "OSU":
        return encode_bytes(array)
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8).data


def numeric_array(
    values: Sequence[Any], dtype: DataType, shape: Sequence[int], name: str
) -> np.ndarray[Any, Any]:
    """Numbers given one by one (JSON data, gRPC typed contents) as a tensor of ``dtype``.

    Raises:
        InvalidRequestError: a value does not fit in the data type.
    """
    try:
        with np.errstate(over="raise", invalid="raise"):
            array = np.array(values, dtype=dtype.numpy_dtype)
    except (OverflowError, FloatingPointError, ValueError):
        raise InvalidRequestError(
            f"input '{name}': a value does not fit in {dtype.value}"
        ) from None
    return array.reshape(tuple(shape))
