"""Triton's classification extension: an output asked for with ``classification: k`` is
answered as its ``k`` highest values, each the string ``"score:index[:label]"`` (BYTES).

How this works: the front end runs the model as usual, then replaces each such output by its
classes (`classified`). A batching model's output is classified per batch item (its first
dim is kept, ``[batch, k]``); any other output is classified as a whole (``[k]``). Scores
are written as Triton writes them (C's ``%f`` for floats, integers as integers); the label is
the ``index``-th line of the output's ``label_filename``, when it has one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from ._dtypes import DataType
from ._errors import InvalidRequestError
from ._messages import InferResponse

MAX_CLASSIFIED_ELEMENTS = 1_000_000
"""The most values one batch item of a classified output may have (Triton's limit)."""

_CLASSIFIABLE = frozenset(
    {
        DataType.UINT8,
        DataType.UINT16,
        DataType.UINT32,
        DataType.UINT64,
        DataType.INT8,
        DataType.INT16,
        DataType.INT32,
        DataType.INT64,
        DataType.FP32,
        DataType.FP64,
    }
)


def classified(
    response: InferResponse,
    counts: Mapping[str, int],
    labels: Mapping[str, Sequence[str]],
    *,
    batched: bool,
) -> InferResponse:
    """``response`` with each output named in ``counts`` replaced by its top classes.

    Raises:
        InvalidRequestError: an output's data type has no order (BYTES, BOOL, FP16, BF16),
            or a batch item has more than `MAX_CLASSIFIED_ELEMENTS` values.
    """
    if not counts:
        return response
    outputs = dict(response.outputs)
    for name, count in counts.items():
        array = outputs.get(name)
        if array is not None:
            outputs[name] = top_classes(
                np.asarray(array), count, labels.get(name, ()), batched=batched, name=name
            )
    return attrs.evolve(response, outputs=outputs)


def top_classes(
    array: np.ndarray[Any, Any],
    count: int,
    labels: Sequence[str],
    *,
    batched: bool,
    name: str = "",
) -> np.ndarray[Any, Any]:
    """The ``count`` highest values of ``array`` (per batch item when ``batched``), highest
    first, as BYTES ``"score:index[:label]"``; ties keep the lower index first.

    Raises:
        InvalidRequestError: see `classified`.
    """
    dtype = DataType.from_numpy(array.dtype)
    if dtype not in _CLASSIFIABLE:
        raise InvalidRequestError(
            f"class result not available for output '{name}' due to unsupported type "
            f"'{dtype.value}'"
        )
    per_item = batched and array.ndim > 0
    rows = array.reshape(array.shape[0] if per_item else 1, -1)
    if rows.shape[1] > MAX_CLASSIFIED_ELEMENTS:
        raise InvalidRequestError(
            f"classification output tensor too large: output '{name}' has {rows.shape[1]} "
            f"values per item (at most {MAX_CLASSIFIED_ELEMENTS})"
        )
    k = min(count, rows.shape[1])
    floats = dtype in (DataType.FP32, DataType.FP64)
    result = np.empty((rows.shape[0], k), dtype=object)
    for row_index, row in enumerate(rows):
        for slot, index in enumerate(_highest(row, k)):
            value = row[index]
            text = f"{float(value):f}:{index}" if floats else f"{int(value)}:{index}"
            if index < len(labels):
                text += ":" + labels[index]
            result[row_index, slot] = text.encode()
    return result if per_item else result.reshape(k)


def _highest(row: np.ndarray[Any, Any], k: int) -> list[int]:
    """Indices of the ``k`` highest values of ``row``, highest first, ties by index."""
    if k == 0:
        return []
    # A stable ascending sort of the values' order reversed in place: ascending by value,
    # descending by index among equals; reversed, that is descending by value, ascending by
    # index. Only the top k are sorted when k is small.
    n = row.shape[0]
    if k < n // 8:
        candidates = np.argpartition(row, n - k)[n - k :]
        threshold = row[candidates].min()
        candidates = np.flatnonzero(row >= threshold)  # every tie of the k-th value
    else:
        candidates = np.arange(n)
    reversed_candidates = candidates[::-1]
    order = reversed_candidates[np.argsort(row[reversed_candidates], kind="stable")][::-1]
    return [int(i) for i in order[:k]]
