"""DLPack exchange of a python-backend model's tensors with other frameworks (PyTorch, ...),
BF16 included, which numpy's own DLPack support refuses.

How this works: numpy exports and imports every DLPack data type but bfloat16. A BF16
tensor is exported as its bits (a uint16 view) in a standard ``dltensor`` capsule whose data
type is then marked ``kDLBfloat``; a ``kDLBfloat`` capsule is imported the other way round
(marked uint16, imported by numpy, viewed as ``ml_dtypes.bfloat16``). Both touch only the
``dtype`` field of the capsule's ``DLTensor``, whose layout is fixed by the DLPack standard.
A request's inputs are read-only (they may be shared with an ensemble's other steps and the
cache): their export is a copy, so that a framework that writes into what it imported
changes nothing of the request.
"""

from __future__ import annotations

import ctypes
from typing import Any

import ml_dtypes
import numpy as np

_KDL_UINT = 1
_KDL_BFLOAT = 4
_CAPSULE_NAME = b"dltensor"


class _DataType(ctypes.Structure):
    _fields_ = (("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16))


class _Device(ctypes.Structure):
    _fields_ = (("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32))


class _DLTensor(ctypes.Structure):
    """The start of a ``DLManagedTensor`` (the struct of a ``dltensor`` capsule)."""

    _fields_ = (
        ("data", ctypes.c_void_p),
        ("device", _Device),
        ("ndim", ctypes.c_int32),
        ("dtype", _DataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    )


_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_get_pointer.restype = ctypes.c_void_p
_get_pointer.argtypes = (ctypes.py_object, ctypes.c_char_p)
_is_valid = ctypes.pythonapi.PyCapsule_IsValid
_is_valid.restype = ctypes.c_int
_is_valid.argtypes = (ctypes.py_object, ctypes.c_char_p)


def _dtype_of(capsule: Any) -> _DataType | None:
    """The data type field of an unconsumed ``dltensor`` capsule (None: not one)."""
    if not _is_valid(capsule, _CAPSULE_NAME):
        return None
    tensor = _DLTensor.from_address(_get_pointer(capsule, _CAPSULE_NAME))
    dtype: _DataType = tensor.dtype
    return dtype


def export(array: np.ndarray[Any, Any]) -> Any:
    """A ``dltensor`` capsule of ``array`` (C order; a copy when it is read-only).

    Raises:
        BufferError: numpy cannot export the data type.
    """
    if not array.flags.writeable:
        array = np.array(array, order="C")
    array = np.ascontiguousarray(array)
    if array.dtype != ml_dtypes.bfloat16:
        return array.__dlpack__()
    capsule = array.view(np.uint16).__dlpack__()
    dtype = _dtype_of(capsule)
    if dtype is None or dtype.code != _KDL_UINT:  # numpy's own capsule: never
        raise BufferError("numpy gave no dltensor capsule of uint16 for a BF16 tensor")
    dtype.code = _KDL_BFLOAT
    return capsule


def import_(source: Any) -> np.ndarray[Any, Any]:
    """The array a DLPack capsule, or an object with ``__dlpack__``, holds (CPU memory, no
    copy).

    Raises:
        BufferError: numpy cannot import it.
    """
    capsule = source.__dlpack__() if hasattr(source, "__dlpack__") else source
    dtype = _dtype_of(capsule)
    bf16 = dtype is not None and dtype.code == _KDL_BFLOAT and dtype.bits == 16
    if dtype is not None and bf16:
        dtype.code = _KDL_UINT  # numpy imports the bits; the view below gives their type
    array = np.from_dlpack(_Capsule(capsule))
    return array.view(ml_dtypes.bfloat16) if bf16 else array


class _Capsule:
    """Gives numpy's ``from_dlpack`` a raw capsule (CPU memory)."""

    def __init__(self, capsule: Any) -> None:
        self._capsule = capsule

    def __dlpack__(self, **_: Any) -> Any:
        return self._capsule

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)  # kDLCPU, device 0
