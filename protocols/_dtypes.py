"""Tensor data types: Triton's ``TYPE_*`` config names, the protocol names of the Open Inference
Protocol (``FP32``, ``BYTES``, ...) and numpy dtypes, in one table.

BYTES tensors are numpy ``object`` arrays holding ``bytes`` (what Triton's Python backend uses);
BF16 is ``ml_dtypes.bfloat16``, the dtype JAX itself uses.
"""

from __future__ import annotations

import enum
from typing import Any

import ml_dtypes
import numpy as np


class DataType(enum.Enum):
    """A tensor element type. The value is the protocol name (``"FP32"``)."""

    BOOL = "BOOL"
    UINT8 = "UINT8"
    UINT16 = "UINT16"
    UINT32 = "UINT32"
    UINT64 = "UINT64"
    INT8 = "INT8"
    INT16 = "INT16"
    INT32 = "INT32"
    INT64 = "INT64"
    FP16 = "FP16"
    FP32 = "FP32"
    FP64 = "FP64"
    BF16 = "BF16"
    BYTES = "BYTES"

    @property
    def config_name(self) -> str:
        """The ``config.pbtxt`` spelling: ``TYPE_FP32``, and ``TYPE_STRING`` for BYTES."""
        return _CONFIG_NAME[self]

    @property
    def numpy_dtype(self) -> np.dtype[Any]:
        """The numpy dtype of arrays of this type."""
        return _NUMPY[self]

    @classmethod
    def from_config_name(cls, name: str) -> DataType:
        """Parse ``TYPE_FP32``-style names.

        Raises:
            ValueError: the name is not a data type orchestrion supports.
        """
        try:
            return _FROM_CONFIG_NAME[name]
        except KeyError:
            raise ValueError(f"unknown data_type {name!r}") from None

    @classmethod
    def from_numpy(cls, dtype: np.dtype[Any]) -> DataType:
        """The data type of a numpy dtype (``object`` and ``S`` are BYTES).

        Raises:
            ValueError: numpy dtype with no Triton equivalent (complex numbers, say).
        """
        if dtype.kind in "OSU":
            return cls.BYTES
        try:
            return _FROM_NUMPY[dtype]
        except KeyError:
            raise ValueError(f"numpy dtype {dtype} has no Triton data type") from None


_NUMPY: dict[DataType, np.dtype[Any]] = {
    DataType.BOOL: np.dtype(np.bool_),
    DataType.UINT8: np.dtype(np.uint8),
    DataType.UINT16: np.dtype(np.uint16),
    DataType.UINT32: np.dtype(np.uint32),
    DataType.UINT64: np.dtype(np.uint64),
    DataType.INT8: np.dtype(np.int8),
    DataType.INT16: np.dtype(np.int16),
    DataType.INT32: np.dtype(np.int32),
    DataType.INT64: np.dtype(np.int64),
    DataType.FP16: np.dtype(np.float16),
    DataType.FP32: np.dtype(np.float32),
    DataType.FP64: np.dtype(np.float64),
    DataType.BF16: np.dtype(ml_dtypes.bfloat16),
    DataType.BYTES: np.dtype(object),
}
_FROM_NUMPY = {dt: t for t, dt in _NUMPY.items() if t is not DataType.BYTES}
_CONFIG_NAME = {t: "TYPE_STRING" if t is DataType.BYTES else f"TYPE_{t.value}" for t in DataType}
_FROM_CONFIG_NAME = {name: t for t, name in _CONFIG_NAME.items()}
