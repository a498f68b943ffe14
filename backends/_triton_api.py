"""What a Triton python-backend model sees: tensors, responses, errors and the helpers of
``triton_python_backend_utils`` (the module every such ``model.py`` imports as ``pb_utils``).

How this works: these are plain Python objects over numpy arrays. A `Tensor` wraps one named
array (no copy); an `InferenceResponse` holds output tensors or a `TritonError`. Requests and
the calls a model makes back into the server (BLS, response senders) are in
``_triton_calls.py``; the auto-complete ``ModelConfig`` in ``_triton_config.py``; the logger
and custom metrics in ``_triton_metrics.py``. The top-level module
``triton_python_backend_utils`` re-exports all of them, so a model written for Triton imports
it unchanged, and so can the model's own unit tests.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping, Sequence
from typing import Any

import ml_dtypes
import numpy as np
from tritonclient.grpc import model_config_pb2

from ..protocols import DataType
from . import _dlpack

TRITONSERVER_REQUEST_FLAG_SEQUENCE_START = 1
TRITONSERVER_REQUEST_FLAG_SEQUENCE_END = 2
TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
TRITONSERVER_REQUEST_RELEASE_ALL = 1
TRITONSERVER_REQUEST_RELEASE_RESCHEDULE = 2
TRITONSERVER_MEMORY_CPU = 0
TRITONSERVER_MEMORY_CPU_PINNED = 1
TRITONSERVER_MEMORY_GPU = 2


class TritonModelException(Exception):
    """Raised by model code (``initialize``, ``execute``, ``finalize``) to fail the call;
    also what a failed call into the server raises where Triton's does."""


class TritonError(Exception):
    """An error a response carries (``InferenceResponse(error=TritonError(...))``), with one
    of Triton's error codes (INTERNAL unless given)."""

    UNKNOWN = 0
    INTERNAL = 1
    NOT_FOUND = 2
    INVALID_ARG = 3
    UNAVAILABLE = 4
    UNSUPPORTED = 5
    ALREADY_EXISTS = 6
    CANCELLED = 7

    def __init__(self, message: str, code: int = INTERNAL) -> None:
        if message is None:
            raise TypeError("TritonError: message must be a str, not None")
        super().__init__(message)
        self._message = str(message)
        self._code = int(code)

    def message(self) -> str:
        """The error's text."""
        return self._message

    def code(self) -> int:
        """Its Triton error code (`TritonError.INTERNAL`, ...)."""
        return self._code

    def __repr__(self) -> str:
        return f"TritonError({self._message!r}, code={self._code})"


def _triton_type_number(data_type: DataType) -> int:
    return int(model_config_pb2.DataType.Value(data_type.config_name))


def check_argument(call: str, name: str, value: Any, kinds: Any, what: str) -> None:
    """The type check pybind11 makes of an argument in Triton's python backend: a
    TypeError naming the call and the argument (Triton's QA ``argument_validation``).

    Raises:
        TypeError: ``value`` is not an instance of ``kinds``.
    """
    if not isinstance(value, kinds):
        raise TypeError(
            f"{call}(): incompatible function arguments: '{name}' must be {what}, got "
            f"{type(value).__name__}"
        )


def check_sequence(call: str, name: str, value: Any) -> None:
    """`check_argument` for a list argument (a list or tuple; not a string).

    Raises:
        TypeError: ``value`` is not a list or a tuple.
    """
    check_argument(call, name, value, (list, tuple), "a list")


class Tensor:
    """One named tensor: an input of a request, or an output a model returns.

    ``Tensor("OUTPUT0", array)`` wraps ``array`` (numpy; BYTES tensors are ``object`` arrays
    of ``bytes``) without copying it.
    """

    def __init__(self, name: str, data: Any, dtype: Any = None) -> None:
        if isinstance(name, bytes):
            name = name.decode()
        check_argument("Tensor", "name", name, str, "a string")
        if data is None:
            raise TypeError("Tensor(): incompatible function arguments: 'data' must be an array")
        array = np.asarray(data) if dtype is None else np.asarray(data, dtype=dtype)
        if array.dtype.kind in "SU":  # fixed-width strings: BYTES elements, as Triton stores them
            array = np.array(
                [v.encode() if isinstance(v, str) else bytes(v) for v in array.ravel()],
                dtype=object,
            ).reshape(array.shape)
        try:
            DataType.from_numpy(array.dtype)
        except ValueError as exc:
            raise TritonModelException(f"tensor '{name}': {exc}") from None
        self._name = str(name)
        self._array = array

    @classmethod
    def of(cls, name: str, array: np.ndarray[Any, Any]) -> Tensor:
        """A tensor of an array the server has already checked (no conversion)."""
        tensor = cls.__new__(cls)
        tensor._name = name
        tensor._array = array
        return tensor

    def name(self) -> str:
        """The tensor's name."""
        return self._name

    def as_numpy(self) -> np.ndarray[Any, Any]:
        """The tensor's data as a numpy array (the same memory, not a copy).

        Raises:
            TritonModelException: a BF16 tensor, as in Triton (use `to_dlpack`).
        """
        if self._array.dtype == ml_dtypes.bfloat16:
            raise TritonModelException(
                f"tensor '{self._name}': tensor dtype is bf16 and cannot be converted to "
                "numpy (use to_dlpack(), as in Triton)"
            )
        return self._array

    def shape(self) -> list[int]:
        """The tensor's shape."""
        return list(self._array.shape)

    def triton_dtype(self) -> int:
        """Triton's number for the tensor's data type (``TYPE_FP32`` is 11)."""
        return _triton_type_number(DataType.from_numpy(self._array.dtype))

    def data_type(self) -> str:
        """The protocol name of the tensor's data type (``FP32``, ``BYTES``, ...)."""
        return DataType.from_numpy(self._array.dtype).value

    def is_cpu(self) -> bool:
        """Whether the data is in CPU memory: always, in orchestrion's python backend."""
        return True

    def to_dlpack(self) -> Any:
        """A DLPack capsule of the data, for exchange with other frameworks (BF16 too): the
        same memory, except for a request's inputs, which are read-only (a copy of them).

        Raises:
            TritonModelException: BYTES tensors have no DLPack form.
        """
        if self._array.dtype == object:
            raise TritonModelException(f"tensor '{self._name}': BYTES tensors have no DLPack form")
        return _dlpack.export(self._array)

    @staticmethod
    def from_dlpack(name: str, capsule: Any) -> Tensor:
        """A tensor of a DLPack capsule or of an object with ``__dlpack__`` (CPU memory,
        C order; no copy).

        Raises:
            TritonModelException: the data is not on the CPU, or not in C order.
        """
        if capsule is None:
            raise TritonModelException(f"Tensor.from_dlpack('{name}'): no DLPack capsule given")
        device = capsule.__dlpack_device__() if hasattr(capsule, "__dlpack_device__") else (1, 0)
        if device[0] not in (1, 3):  # kDLCPU, kDLCUDAHost
            raise TritonModelException(
                f"Tensor.from_dlpack('{name}'): the data is on device type {device[0]}; "
                "orchestrion's python backend takes tensors in CPU memory (copy it to the "
                "host first)"
            )
        array = _dlpack.import_(capsule)
        if not array.flags.c_contiguous:
            raise TritonModelException(f"Tensor.from_dlpack('{name}'): the data is not in C order")
        return Tensor(name, array)

    def __repr__(self) -> str:
        return f"Tensor({self._name!r}, {self._array.dtype}{list(self._array.shape)})"


def tensor_array(tensor: Tensor) -> np.ndarray[Any, Any]:
    """The array a `Tensor` holds, whatever its data type (BF16 too: the server's view)."""
    return tensor._array


def _parameters_json(parameters: Any) -> str:
    """The JSON text of a request's or response's ``parameters``, with Triton's checks: a
    dict (None: empty) of str keys and bool, int or str values.

    Raises:
        TritonModelException: anything else, in Triton's words.
    """
    if parameters is None:
        return "{}"
    if not isinstance(parameters, dict):
        raise TritonModelException(f"Expect dict, got {type(parameters)}")
    for key, value in parameters.items():
        if not isinstance(key, str):
            raise TritonModelException(
                f"Expect parameters keys to have type str, found type {type(key)}"
            )
        if not isinstance(value, bool | int | str):
            raise TritonModelException(
                f"Expect parameters values to have type bool/int/str, found type {type(value)}"
            )
    return json.dumps(parameters)


class InferenceResponse:
    """One response: its output tensors, or an error (then the tensors are ignored)."""

    def __init__(
        self,
        output_tensors: Sequence[Tensor] = (),
        error: TritonError | str | None = None,
        parameters: dict[str, Any] | None = None,
    ) -> None:
        check_sequence("InferenceResponse", "output_tensors", output_tensors)
        tensors = list(output_tensors)
        for tensor in tensors:
            if not isinstance(tensor, Tensor):
                raise TritonModelException(
                    f"InferenceResponse takes pb_utils.Tensor objects, got {type(tensor).__name__}"
                )
        self._tensors = tensors
        self._error = TritonError(error) if isinstance(error, str) else error
        self._parameters = _parameters_json(parameters)

    def output_tensors(self) -> list[Tensor]:
        """The output tensors."""
        return list(self._tensors)

    def has_error(self) -> bool:
        """Whether the response is an error."""
        return self._error is not None

    def error(self) -> TritonError | None:
        """The error, or None."""
        return self._error

    def parameters(self) -> str:
        """The response's parameters, as a JSON object's text."""
        return self._parameters

    @classmethod
    def of(cls, tensors: list[Tensor], parameters: Mapping[str, Any]) -> InferenceResponse:
        """A response the server made (a BLS call's answer): its parameters as they came,
        a DOUBLE one among them, without the checks that model code's responses get."""
        response = cls(tensors)
        response._parameters = json.dumps(dict(parameters))
        return response

    def parameter_values(self) -> dict[str, Any]:
        """The parameters as a dict, for the response that leaves the server."""
        if self._parameters == "{}":
            return {}
        values: dict[str, Any] = json.loads(self._parameters)
        return values


def get_input_tensor_by_name(inference_request: Any, name: str) -> Tensor | None:
    """The request's input tensor ``name``, or None."""
    return next((t for t in inference_request.inputs() if t.name() == name), None)


def get_output_tensor_by_name(inference_response: Any, name: str) -> Tensor | None:
    """The response's output tensor ``name``, or None."""
    return next((t for t in inference_response.output_tensors() if t.name() == name), None)


def _tensor_config(model_config: Mapping[str, Any], kind: str, name: str) -> Any:
    return next((t for t in model_config.get(kind, ()) if t.get("name") == name), None)


def get_input_config_by_name(model_config: Mapping[str, Any], name: str) -> Any:
    """The config (a dict of Triton's JSON) of input ``name``, or None."""
    return _tensor_config(model_config, "input", name)


def get_output_config_by_name(model_config: Mapping[str, Any], name: str) -> Any:
    """The config (a dict of Triton's JSON) of output ``name``, or None."""
    return _tensor_config(model_config, "output", name)


def using_decoupled_model_transaction_policy(model_config: Mapping[str, Any]) -> bool:
    """Whether the config makes the model decoupled."""
    return bool(model_config.get("model_transaction_policy", {}).get("decoupled", False))


TRITON_STRING_TO_NUMPY: dict[str, Any] = {
    t.config_name: (np.object_ if t is DataType.BYTES else t.numpy_dtype.type)
    for t in DataType
    if t is not DataType.BF16
} | {"TYPE_BOOL": bool}


def triton_string_to_numpy(triton_type_string: str) -> Any:
    """The numpy type of a ``TYPE_*`` name (``TYPE_STRING`` is ``np.object_``)."""
    return TRITON_STRING_TO_NUMPY[triton_type_string]


_BY_NUMBER = {_triton_type_number(t): t for t in DataType}


def triton_to_numpy_type(data_type: int) -> Any:
    """The numpy type of Triton's data type number, or None."""
    found = _BY_NUMBER.get(data_type)
    if found is None:
        return None
    return np.object_ if found is DataType.BYTES else found.numpy_dtype.type


def numpy_to_triton_type(data_type: Any) -> int | None:
    """Triton's data type number of a numpy type, or None."""
    try:
        return _triton_type_number(DataType.from_numpy(np.dtype(data_type)))
    except (TypeError, ValueError):
        return None


def serialize_byte_tensor(input_tensor: np.ndarray[Any, Any]) -> Any:
    """A BYTES tensor as Triton's wire form: each element's 4-byte little-endian length,
    then its bytes, in C order (``()`` for an empty tensor; None for a non-BYTES one)."""
    if input_tensor.size == 0:
        return ()
    if input_tensor.dtype != np.object_ and input_tensor.dtype.type is not np.bytes_:
        return None
    parts = []
    for item in input_tensor.ravel(order="C"):
        data = item if isinstance(item, bytes) else str(item).encode("utf-8")
        parts.append(struct.pack("<I", len(data)))
        parts.append(data)
    return b"".join(parts)


def deserialize_bytes_tensor(encoded_tensor: bytes) -> np.ndarray[Any, Any]:
    """The elements of Triton's BYTES wire form, as a 1-D ``object`` array of ``bytes``."""
    items = []
    offset = 0
    view = memoryview(encoded_tensor)
    while offset < len(view):
        (length,) = struct.unpack_from("<I", view, offset)
        offset += 4
        items.append(bytes(view[offset : offset + length]))
        offset += length
    return np.array(items, dtype=np.object_)


class PreferredMemory:
    """Where a BLS call's outputs should be placed (accepted; orchestrion's python backend
    always gives them in CPU memory)."""

    def __init__(
        self, preferred_memory_type: int = TRITONSERVER_MEMORY_CPU, preferred_device_id: int = 0
    ) -> None:
        self.preferred_memory_type = preferred_memory_type
        self.preferred_device_id = preferred_device_id
