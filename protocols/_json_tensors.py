"""Tensors from an HTTP infer request's JSON ``data``: flat or nested row-major, as Triton
accepts it, checked element by element and made piece by piece.

How this works: `json_tensor` walks the data (a list, or a `_json_slices.Runs` of a large
array) in pieces of at most `_SLICE` scalars, checks each piece's element types in one call
(``set(map(type, piece))``) and converts it with numpy, so that no call into C holds the GIL
for long however large the tensor; the pieces are joined once they are all counted, so the
request's shape never sizes an allocation by itself.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from . import _json_slices as json_slices
from ._dtypes import DataType
from ._errors import InvalidRequestError
from ._kserve_tensors import element_count, numeric_array

MAX_JSON_DEPTH = 100
"""How deeply a tensor's JSON ``data`` may nest (Triton's limit)."""
NESTING = f"JSON nesting depth exceeds maximum allowed limit ({MAX_JSON_DEPTH})"

JSON_NUMBERS = frozenset(
    {DataType.BF16, DataType.FP16}
)  # not representable in JSON (Triton: binary data only)


def json_tensor(data: object, dtype: DataType, shape: list[Any], name: str) -> np.ndarray[Any, Any]:
    """A tensor from its JSON ``data`` (flat or nested row-major, as Triton accepts it),
    made piece by piece: each call into C (a type scan, numpy's conversion of a piece) is
    short, so a large tensor does not hold the GIL, and the other threads, while it is made.
    A `json_slices.Runs` is used up (each run freed once converted)."""
    count = element_count(shape, name)
    if dtype in JSON_NUMBERS:
        raise InvalidRequestError(
            f"input '{name}': {dtype.value} tensors can only be sent as binary data"
        )
    if not isinstance(data, list):
        raise InvalidRequestError(f"input '{name}': 'data' must be an array")
    allowed = _JSON_TYPES.get(dtype.numpy_dtype.kind, _NUMBERS)
    # The pieces are converted as they come and joined once all are counted: the shape
    # alone (a client's word) must never size an allocation.
    parts: list[np.ndarray[Any, Any]] = []
    seen = 0
    for piece in _pieces(data, name):
        at, seen = seen, seen + len(piece)
        if seen > count:
            parts.clear()  # too many: counted to the end, for the message below
            continue
        kinds = set(map(type, piece))
        if not kinds <= allowed:
            raise InvalidRequestError(_element_problem(name, dtype, kinds))
        if dtype is DataType.BYTES:
            part = np.empty(len(piece), dtype=object)
            part[:] = _encoded(piece, name, at)
        else:
            part = numeric_array(piece, dtype, (len(piece),), name)
        parts.append(part)
    if seen != count:
        raise InvalidRequestError(
            f"unexpected number of elements {seen} for input '{name}' of shape {shape}, "
            f"expecting {count}"
        )
    if not parts:
        return np.empty(tuple(shape), dtype=dtype.numpy_dtype)
    joined = parts[0] if len(parts) == 1 else np.concatenate(parts)
    return joined.reshape(tuple(shape))


_SLICE = 1 << 16
"""Elements of a JSON tensor converted in one call, at most."""
_NUMBERS = frozenset({int, float})
_JSON_TYPES = {
    "b": frozenset({bool}),
    "i": frozenset({int}),
    "u": frozenset({int}),
    "O": frozenset({str}),
}
"""The JSON value types a tensor's elements may have, by numpy kind (others: numbers)."""
_ARRAYS = frozenset({list, json_slices.Runs})


def _element_problem(name: str, dtype: DataType, kinds: set[type]) -> str:
    """What is wrong with elements of these ``kinds`` in a ``dtype`` tensor."""
    if dtype is DataType.BYTES:
        return f"input '{name}': BYTES elements must be strings"
    if dtype is DataType.BOOL:
        return f"input '{name}': BOOL elements must be true or false"
    if kinds - _NUMBERS:
        return f"input '{name}': {dtype.value} elements must be numbers"
    return f"input '{name}': {dtype.value} elements must be integers"


def _encoded(piece: list[str], name: str, at: int) -> list[bytes]:
    """BYTES elements given as JSON strings, UTF-8 encoded."""
    try:
        return [item.encode() for item in piece]
    except UnicodeEncodeError:  # a lone surrogate, which JSON text can carry
        index = at + next(i for i, item in enumerate(piece) if not _encodable(item))
        raise InvalidRequestError(
            f"input '{name}': element {index} is not valid Unicode (a lone surrogate); "
            "send such bytes as binary data"
        ) from None


def _encodable(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _pieces(items: list[Any], name: str, depth: int = 1) -> Iterator[list[Any]]:
    """The scalars of (nested) JSON data in row-major order, in lists of at most about
    `_SLICE` (a `json_slices.Runs` run by run, each dropped once given)."""
    if isinstance(items, json_slices.Runs):
        items.reverse()
        while items:
            yield from _pieces(items.pop(), name, depth)
        return
    if not set(map(type, items)) & _ARRAYS:
        yield items
        return
    if depth >= MAX_JSON_DEPTH:
        raise InvalidRequestError(f"input '{name}': {NESTING}")
    piece: list[Any] = []
    for item in items:
        if type(item) is list and not set(map(type, item)) & _ARRAYS:
            piece += item  # a row of scalars
        elif isinstance(item, list):  # nested deeper (or a large row, in runs)
            if piece:
                yield piece
                piece = []
            yield from _pieces(item, name, depth + 1)
            continue
        else:
            piece.append(item)
        if len(piece) >= _SLICE:
            yield piece
            piece = []
    if piece:
        yield piece
