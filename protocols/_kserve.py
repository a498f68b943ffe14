"""The Open Inference Protocol (KServe v2) as Triton speaks it: the wire formats, no I/O.

How this works: a front end (HTTP or gRPC) turns what arrived into a `WireRequest` (the
arguments of ``AsyncServer.infer`` plus how the client wants its outputs encoded), runs it,
and turns the `InferResponse` back into bytes. Everything both front ends share lives here:
tensors as raw little-endian bytes (BYTES as 4-byte length prefixes), request parameters with
Triton's reserved names, the error-to-status mapping, and the JSON documents of the metadata,
config and statistics calls. The HTTP body codec (JSON plus Triton's binary tensor extension)
is here too; the gRPC messages are in `_kserve_grpc`.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping, Sequence
from typing import Any, TypeGuard

import attrs
import numpy as np
from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2

from ._bytes_wire import decode_bytes, encode_bytes
from ._config import ModelConfig
from ._converter import model_config_to_dict
from ._dtypes import DataType
from ._errors import (
    ConfigError,
    InferenceTimeoutError,
    InvalidRequestError,
    ModelControlError,
    ModelLoadError,
    ModelNotFoundError,
    OrchestrionError,
    QueueFullError,
    ServerClosedError,
)
from ._messages import InferResponse, ParameterValue
from ._statistics import DurationStatistics, ModelStatistics

PROTOCOL_VERSION = "2"
"""The KServe v2 protocol; Triton reports its own release as the server version."""

EXTENSIONS = (
    "binary_tensor_data",
    "parameters",
    "statistics",
    "model_configuration",
    "model_repository",
    "model_repository(unload_dependents)",
    "schedule_policy",
    "sequence",
)
"""The server metadata's ``extensions`` (perf_analyzer reads ``statistics`` from here)."""

HEADER_LENGTH = "inference-header-content-length"
"""Triton's binary tensor extension: the length of the JSON header before the tensors."""

_RESERVED = frozenset(
    {
        "sequence_id",
        "sequence_start",
        "sequence_end",
        "priority",
        "timeout",
        "binary_data_output",
        "binary_data_size",
        "binary_data",
        "classification",
        "shared_memory_region",
        "shared_memory_byte_size",
        "shared_memory_offset",
        "triton_enable_empty_final_response",
        "headers",
    }
)
"""Parameter names with a meaning to the server: not forwarded to models as custom ones."""

_JSON_NUMBERS = frozenset(
    {DataType.BF16, DataType.FP16}
)  # not representable in JSON (Triton: binary data only)


# ------------------------------------------------------------------------ errors and status


def http_status(error: BaseException) -> int:
    """Triton's HTTP status for an error: 404 unknown model, 400 bad request, 503 busy or
    closing, 500 the pipeline failed."""
    if isinstance(error, ModelNotFoundError):
        return 404
    if isinstance(error, InvalidRequestError | ConfigError | ModelLoadError):
        return 400
    if isinstance(
        error, QueueFullError | ServerClosedError | InferenceTimeoutError | ModelControlError
    ):
        return 503
    return 500


def grpc_status(error: BaseException) -> str:
    """The gRPC status code name (``grpc.StatusCode`` member) Triton uses for an error."""
    return {
        404: "NOT_FOUND",
        400: "INVALID_ARGUMENT",
        503: "UNAVAILABLE",
        500: "INTERNAL",
    }[http_status(error)]


def error_message(error: BaseException) -> str:
    """What the client is shown: our own errors as written, anything else as unexpected."""
    if isinstance(error, OrchestrionError):
        return str(error)
    return f"internal error: {type(error).__name__}: {error}"


# ------------------------------------------------------------------------ requests


@attrs.frozen(kw_only=True)
class WireRequest:
    """An inference request as a front end received it: ``AsyncServer.infer``'s arguments,
    and how the client wants each output encoded."""

    model_name: str
    model_version: int = -1
    inputs: dict[str, np.ndarray[Any, Any]] = attrs.field(factory=dict, eq=False, repr=False)
    outputs: tuple[str, ...] | None = None
    request_id: str = ""
    parameters: dict[str, ParameterValue] = attrs.field(factory=dict)
    sequence_id: int | str = 0
    sequence_start: bool = False
    sequence_end: bool = False
    priority: int = 0
    timeout: float | None = None
    """Seconds (Triton's wire value is microseconds)."""
    binary_outputs: Mapping[str, bool] = attrs.field(factory=dict)
    """Per-output ``binary_data`` choices (HTTP)."""
    binary_default: bool = False
    """``binary_data_output``: outputs not named in ``binary_outputs`` go as binary (HTTP)."""
    empty_final_response: bool = False
    """``triton_enable_empty_final_response`` (gRPC streams)."""

    def infer_arguments(self) -> dict[str, Any]:
        """Keyword arguments for ``AsyncServer.infer`` (after the model name and inputs)."""
        return {
            "model_version": self.model_version,
            "outputs": self.outputs,
            "request_id": self.request_id,
            "parameters": self.parameters,
            "sequence_id": self.sequence_id,
            "sequence_start": self.sequence_start,
            "sequence_end": self.sequence_end,
            "priority": self.priority,
        }


def parse_version(text: str) -> int:
    """A model version from a URL or a message field: empty means the latest (-1)."""
    if text in ("", "-1"):
        return -1
    if not (text.isascii() and text.isdigit()) or len(text) > 18:
        raise InvalidRequestError(f"invalid model version '{text:.40}': expected an integer")
    return int(text)


def request_options(
    parameters: Mapping[str, object], *, where: str = "request parameters"
) -> dict[str, Any]:
    """Triton's reserved request parameters as ``WireRequest`` fields, and the custom ones.

    Raises:
        InvalidRequestError: a reserved parameter of the wrong kind.
    """
    options: dict[str, Any] = {}
    custom: dict[str, ParameterValue] = {}
    for key, value in parameters.items():
        if key == "sequence_id":
            if isinstance(value, bool) or not isinstance(value, int | str):
                raise InvalidRequestError(f"{where}: sequence_id must be an integer or a string")
            if isinstance(value, int) and not 0 <= value <= _UINT64_MAX:
                raise InvalidRequestError(
                    f"{where}: sequence_id must be an unsigned 64-bit integer (0 to 2**64-1)"
                )
            options["sequence_id"] = value
        elif key in ("sequence_start", "sequence_end", "binary_data_output"):
            options[_OPTION_FIELD[key]] = _flag(key, value, where)
        elif key == "triton_enable_empty_final_response":
            options["empty_final_response"] = _flag(key, value, where)
        elif key == "priority":
            if not _unsigned(value):
                raise InvalidRequestError(
                    f"{where}: priority must be an unsigned 64-bit integer (0 to 2**64-1)"
                )
            options["priority"] = value
        elif key == "timeout":
            if not _unsigned(value):
                raise InvalidRequestError(
                    f"{where}: timeout must be an unsigned 64-bit integer (microseconds)"
                )
            options["timeout"] = value / 1e6 if value > 0 else None
        elif key in _RESERVED:
            if key.startswith("shared_memory"):
                raise InvalidRequestError(f"{where}: shared memory is not supported")
            continue
        elif (
            isinstance(value, int)
            and not isinstance(value, bool)
            and not _INT_RANGE[0] <= value <= _UINT64_MAX
        ):
            raise InvalidRequestError(
                f"{where}: parameter '{key:.80}' is out of range (a 64-bit integer, signed or "
                "unsigned)"
            )
        elif isinstance(value, str | int | float | bool):
            custom[key] = value
        else:
            raise InvalidRequestError(
                f"{where}: parameter '{key:.80}' must be a string, number or boolean"
            )
    options["parameters"] = custom
    return options


_UINT64_MAX = 2**64 - 1
_INT_RANGE = (-(2**63), _UINT64_MAX)
"""Integers a parameter may hold: what Triton's ``int64_param`` or ``uint64_param`` carry
(HTTP's JSON has no limit; larger ones would fail later, on the way out over gRPC)."""


def _unsigned(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _UINT64_MAX


_OPTION_FIELD = {
    "sequence_start": "sequence_start",
    "sequence_end": "sequence_end",
    "binary_data_output": "binary_default",
}


def _flag(key: str, value: object, where: str) -> bool:
    if not isinstance(value, bool):
        raise InvalidRequestError(f"{where}: {key} must be a boolean")
    return value


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


def element_count(shape: Sequence[object], tensor: str) -> int:
    """Elements in a tensor of ``shape``, checking every dim.

    Raises:
        InvalidRequestError: a dim that is not a non-negative integer, too many dims, or a
            dim too large for an array (even an empty one).
    """
    if len(shape) > MAX_DIMS:
        raise InvalidRequestError(
            f"invalid shape for tensor '{tensor}': {len(shape)} dims (at most {MAX_DIMS})"
        )
    count = span = 1
    for dim in shape:
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 0:
            raise InvalidRequestError(
                f"invalid shape {list(shape)!s:.80} for tensor '{tensor}': dims must be "
                "non-negative integers"
            )
        if dim > MAX_DIM:
            raise InvalidRequestError(
                f"invalid shape {list(shape)!s:.80} for tensor '{tensor}': dim {dim} is too large"
            )
        count *= dim
        span *= max(dim, 1)
    if span > MAX_DIM:  # numpy refuses such a shape even with a zero dim ("too big")
        raise InvalidRequestError(
            f"invalid shape {list(shape)!s:.80} for tensor '{tensor}': too large (the non-zero "
            f"dims multiply to more than {MAX_DIM})"
        )
    return count


MAX_DIM = 2**40
"""The largest dim accepted on the wire (numpy's own limit is 2**63 - 1 elements)."""
MAX_DIMS = 32
"""numpy's (and so orchestrion's) most dims per array."""


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


# ------------------------------------------------------------------------ HTTP bodies


def decode_http_request(
    model_name: str, version: str, body: bytes | memoryview, header_length: int | None
) -> WireRequest:
    """An HTTP infer request: a JSON document, then binary tensors when ``header_length``
    (``Inference-Header-Content-Length``) is given.

    Raises:
        InvalidRequestError: the body, a tensor or a parameter is malformed (its name said).
    """
    view = memoryview(body)
    if header_length is None:
        header_length = len(view)
    elif header_length > len(view):
        raise InvalidRequestError(
            f"Inference-Header-Content-Length {header_length} is larger than the body "
            f"({len(view)} bytes)"
        )
    try:
        document = json.loads(bytes(view[:header_length]))
    except (ValueError, RecursionError) as exc:
        raise InvalidRequestError(f"failed to parse the request JSON: {exc}") from None
    if not isinstance(document, dict):
        raise InvalidRequestError("the request JSON must be an object")
    binary = view[header_length:]
    options = request_options(_object(document, "parameters"))
    request_id = document.get("id", "")
    if not isinstance(request_id, str):
        raise InvalidRequestError("request 'id' must be a string")
    inputs_field = document.get("inputs")
    if not isinstance(inputs_field, list):
        raise InvalidRequestError("the request JSON needs an 'inputs' array")
    inputs: dict[str, np.ndarray[Any, Any]] = {}
    offset = 0
    for item in inputs_field:
        if not isinstance(item, dict):
            raise InvalidRequestError("each element of 'inputs' must be an object")
        name = item.get("name")
        if not isinstance(name, str):
            raise InvalidRequestError("an input has no 'name' string")
        if name in inputs:
            raise InvalidRequestError(f"input '{name}' is given twice")
        dtype = data_type(item.get("datatype"), name)
        shape = item.get("shape")
        if not isinstance(shape, list):
            raise InvalidRequestError(f"input '{name}' has no 'shape' array")
        size = _object(item, "parameters", where=f"input '{name}'").get("binary_data_size")
        if size is not None:
            if "data" in item:
                raise InvalidRequestError(
                    f"input '{name}' has both 'data' and binary data (binary_data_size): "
                    "send its values one way"
                )
            if isinstance(size, bool) or not isinstance(size, int) or size < 0:
                raise InvalidRequestError(
                    f"input '{name}': binary_data_size must be a non-negative integer"
                )
            if offset + size > len(binary):
                raise InvalidRequestError(
                    f"input '{name}': binary_data_size {size} runs past the end of the body "
                    f"({len(binary) - offset} bytes left)"
                )
            inputs[name] = tensor_from_bytes(binary[offset : offset + size], dtype, shape, name)
            offset += size
        elif "data" in item:
            inputs[name] = _json_tensor(item["data"], dtype, shape, name)
        else:
            raise InvalidRequestError(f"input '{name}' has neither 'data' nor binary data")
    if offset != len(binary):
        raise InvalidRequestError(
            f"{len(binary) - offset} bytes of binary data follow the tensors the header names"
        )
    outputs, binary_outputs = _requested_outputs(document.get("outputs"))
    return WireRequest(
        model_name=model_name,
        model_version=parse_version(version),
        inputs=inputs,
        outputs=outputs,
        request_id=request_id,
        binary_outputs=binary_outputs,
        **options,
    )


def _object(document: Mapping[str, Any], key: str, *, where: str = "request") -> dict[str, Any]:
    value = document.get(key, {})
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidRequestError(f"{where}: '{key}' must be an object")
    return value


def _requested_outputs(
    field: object,
) -> tuple[tuple[str, ...] | None, dict[str, bool]]:
    if field is None:
        return None, {}
    if not isinstance(field, list):
        raise InvalidRequestError("'outputs' must be an array")
    names: list[str] = []
    binary: dict[str, bool] = {}
    for item in field:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise InvalidRequestError("each requested output needs a 'name' string")
        name = item["name"]
        parameters = _object(item, "parameters", where=f"output '{name}'")
        if "classification" in parameters:
            raise InvalidRequestError(
                f"output '{name}': the classification extension is not supported"
            )
        if any(key.startswith("shared_memory") for key in parameters):
            raise InvalidRequestError(f"output '{name}': shared memory is not supported")
        if "binary_data" in parameters:
            binary[name] = _flag("binary_data", parameters["binary_data"], f"output '{name}'")
        names.append(name)
    return tuple(names), binary


def _json_tensor(
    data: object, dtype: DataType, shape: list[Any], name: str
) -> np.ndarray[Any, Any]:
    count = element_count(shape, name)
    if dtype in _JSON_NUMBERS:
        raise InvalidRequestError(
            f"input '{name}': {dtype.value} tensors can only be sent as binary data"
        )
    flat = _flatten(data, name)
    if len(flat) != count:
        raise InvalidRequestError(
            f"unexpected number of elements {len(flat)} for input '{name}' of shape {shape}, "
            f"expecting {count}"
        )
    if dtype is DataType.BYTES:
        array = np.empty(count, dtype=object)
        for i, item in enumerate(flat):
            if not isinstance(item, str):
                raise InvalidRequestError(f"input '{name}': BYTES elements must be strings")
            try:
                array[i] = item.encode()
            except UnicodeEncodeError:  # a lone surrogate, which JSON text can carry
                raise InvalidRequestError(
                    f"input '{name}': element {i} is not valid Unicode (a lone surrogate); "
                    "send such bytes as binary data"
                ) from None
        return array.reshape(tuple(shape))
    if dtype is DataType.BOOL:
        if not all(isinstance(item, bool) for item in flat):
            raise InvalidRequestError(f"input '{name}': BOOL elements must be true or false")
    elif any(isinstance(item, bool) or not isinstance(item, int | float) for item in flat):
        raise InvalidRequestError(f"input '{name}': {dtype.value} elements must be numbers")
    elif dtype.numpy_dtype.kind in "iu" and not all(isinstance(item, int) for item in flat):
        raise InvalidRequestError(f"input '{name}': {dtype.value} elements must be integers")
    return numeric_array(flat, dtype, shape, name)


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


def _flatten(data: object, name: str) -> list[Any]:
    """Triton accepts tensor data flat or nested row-major."""
    if not isinstance(data, list):
        raise InvalidRequestError(f"input '{name}': 'data' must be an array")
    if not any(isinstance(item, list) for item in data):
        return data
    flat: list[Any] = []
    stack: list[Any] = [iter(data)]
    while stack:
        for item in stack[-1]:
            if isinstance(item, list):
                stack.append(iter(item))
                break
            flat.append(item)
        else:
            stack.pop()
    return flat


def encode_http_response(
    response: InferResponse, request: WireRequest
) -> tuple[list[bytes | memoryview], int | None]:
    """The body of an HTTP infer response: its chunks, and the JSON header's length when
    binary tensors follow it (the ``Inference-Header-Content-Length`` header).

    Raises:
        InvalidRequestError: an output cannot be written as JSON (BYTES that are not UTF-8, FP16
            and BF16: the client must ask for binary data).
    """
    outputs: list[dict[str, Any]] = []
    chunks: list[bytes | memoryview] = []
    large: list[bytes] = []
    nonce = secrets.token_hex(16) + ":"
    for name, array in response.outputs.items():
        dtype = DataType.from_numpy(array.dtype)
        entry: dict[str, Any] = {
            "name": name,
            "datatype": dtype.value,
            "shape": list(array.shape),
        }
        if request.binary_outputs.get(name, request.binary_default):
            raw = tensor_to_bytes(array)
            entry["parameters"] = {"binary_data_size": len(raw)}
            chunks.append(raw)
        elif array.size > _JSON_BLOCK:
            # Written apart, block by block, and spliced in below: one json.dumps of millions
            # of numbers would hold the GIL (so the event loop) for a second or more.
            entry["data"] = f"{nonce}{len(large)}"  # unguessable: no client string can match
            large.append(_json_data_text(array, dtype, name))
        else:
            entry["data"] = _json_data(array, dtype, name)
        outputs.append(entry)
    document: dict[str, Any] = {
        "model_name": response.model_name,
        "model_version": str(response.model_version),
    }
    if response.request_id:
        document["id"] = response.request_id
    if response.parameters:
        document["parameters"] = dict(response.parameters)  # the sequence ones among them
    document["outputs"] = outputs
    header = json.dumps(document, separators=(",", ":")).encode()
    for index, text in enumerate(large):
        header = header.replace(f'"{nonce}{index}"'.encode(), text, 1)
    return [header, *chunks], (len(header) if chunks else None)


_JSON_BLOCK = 1 << 16
"""Elements of an output written as JSON in one call (a few milliseconds holding the GIL)."""


def _json_data_text(array: np.ndarray[Any, Any], dtype: DataType, name: str) -> bytes:
    """A large output's JSON ``data`` array as text, written one block of elements at a
    time (between blocks, other threads get the GIL)."""
    flat = array.reshape(-1)
    parts = [
        json.dumps(_json_data(flat[at : at + _JSON_BLOCK], dtype, name), separators=(",", ":"))[
            1:-1
        ]
        for at in range(0, flat.size, _JSON_BLOCK)
    ]
    return ("[" + ",".join(p for p in parts if p) + "]").encode()


def _json_data(array: np.ndarray[Any, Any], dtype: DataType, name: str) -> list[Any]:
    if dtype in _JSON_NUMBERS:
        raise InvalidRequestError(
            f"output '{name}' is {dtype.value}, which JSON cannot carry: request it as binary data"
        )
    if dtype is DataType.BYTES:
        try:
            return [
                item.decode() if isinstance(item, bytes) else str(item)
                for item in array.reshape(-1)
            ]
        except UnicodeDecodeError:
            raise InvalidRequestError(
                f"output '{name}' holds bytes that are not UTF-8: request it as binary data"
            ) from None
    data: list[Any] = array.reshape(-1).tolist()  # NaN and infinity as JSON's NaN/Infinity
    return data


def error_body(error: BaseException) -> bytes:
    """Triton's JSON error body: ``{"error": "<message>"}``."""
    return json.dumps({"error": error_message(error)}).encode()


# ------------------------------------------------------------------------ documents


def server_metadata(version: str) -> dict[str, Any]:
    """The server metadata document (``GET /v2``)."""
    return {"name": "orchestrion", "version": version, "extensions": list(EXTENSIONS)}


def _tensor_metadata(config: ModelConfig, tensors: Sequence[Any]) -> list[dict[str, Any]]:
    batch = [-1] if config.max_batch_size > 0 else []
    return [
        {"name": t.name, "datatype": t.data_type.value, "shape": [*batch, *t.dims]} for t in tensors
    ]


def model_metadata(config: ModelConfig, versions: Sequence[int]) -> dict[str, Any]:
    """The model metadata document: ``-1`` leads the shape when the model batches."""
    return {
        "name": config.name,
        "versions": [str(v) for v in versions],
        "platform": model_platform(config),
        "inputs": _tensor_metadata(config, config.input),
        "outputs": _tensor_metadata(config, config.output),
    }


def model_platform(config: ModelConfig) -> str:
    """What the metadata calls the model's platform (``ensemble`` for ensembles)."""
    return config.platform or config.backend or "jax"


def model_config_json(config: ModelConfig) -> dict[str, Any]:
    """The model config as Triton's JSON: proto field names, every field present (defaults
    included), and 64-bit integers as numbers, the way perf_analyzer reads it."""
    message = model_config_message(config)
    document: dict[str, Any] = _message_json(message)
    return document


def model_config_message(config: ModelConfig) -> Any:
    """The model config as Triton's protobuf ``ModelConfig`` message, with the defaults
    Triton fills in (version policy, transaction policy) present."""
    message = json_format.ParseDict(model_config_to_dict(config), model_config_pb2.ModelConfig())
    if not message.HasField("version_policy"):
        message.version_policy.latest.num_versions = 1
    message.model_transaction_policy.SetInParent()
    # `count` defaults to 1 here and to 0 in the proto: write it (Triton reports it too), and
    # the instance group a model gets without one.
    for group, written in zip(config.instance_group, message.instance_group, strict=True):
        written.count = group.count
    if not config.instance_group and not config.is_ensemble:
        message.instance_group.add(kind=model_config_pb2.ModelInstanceGroup.KIND_CPU, count=1)
    return message


_INTEGER_TYPES = frozenset({3, 4, 5, 6, 13, 15, 16, 17, 18})  # FieldDescriptor.TYPE_*INT*


def _message_json(message: Any) -> dict[str, Any]:
    """A protobuf message as JSON with defaults included and integers as numbers."""
    data = json_format.MessageToDict(
        message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    return _numbers(message, data)


def _numbers(message: Any, data: dict[str, Any]) -> dict[str, Any]:
    # protobuf's JSON writes 64-bit integers as strings; Triton (and perf_analyzer) use numbers.
    for field in message.DESCRIPTOR.fields:
        key = field.name
        if key not in data:
            continue
        value = getattr(message, key)
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            value_field = field.message_type.fields_by_name["value"]
            if value_field.message_type is not None:
                data[key] = {k: _numbers(value[k], data[key][k]) for k in data[key]}
            elif value_field.type in _INTEGER_TYPES:
                data[key] = {k: int(v) for k, v in data[key].items()}
        elif field.message_type is not None:
            if _is_repeated(field):
                data[key] = [_numbers(m, d) for m, d in zip(value, data[key], strict=True)]
            else:
                data[key] = _numbers(value, data[key])
        elif field.type in _INTEGER_TYPES:
            data[key] = [int(v) for v in data[key]] if _is_repeated(field) else int(data[key])
    return data


def _is_repeated(field: Any) -> bool:
    check = getattr(field, "is_repeated", None)  # protobuf >= 6.30; `label` is deprecated
    if check is None:
        return bool(field.label == field.LABEL_REPEATED)
    return bool(check() if callable(check) else check)


def _duration(stats: DurationStatistics) -> dict[str, int]:
    return {"count": stats.count, "ns": stats.ns}


def model_statistics_json(statistics: Sequence[ModelStatistics]) -> dict[str, Any]:
    """Triton's statistics document (``GET /v2/models/{m}/stats``)."""
    entries = []
    for s in statistics:
        infer = s.inference_stats
        entries.append(
            {
                "name": s.name,
                "version": str(s.version),
                "last_inference": s.last_inference,
                "inference_count": s.inference_count,
                "execution_count": s.execution_count,
                "inference_stats": {
                    "success": _duration(infer.success),
                    "fail": _duration(infer.fail),
                    "queue": _duration(infer.queue),
                    "compute_input": _duration(infer.compute_input),
                    "compute_infer": _duration(infer.compute_infer),
                    "compute_output": _duration(infer.compute_output),
                    "cache_hit": _duration(infer.cache_hit),
                    "cache_miss": _duration(infer.cache_miss),
                },
                "response_stats": {},
                "batch_stats": [],
                "memory_usage": [],
            }
        )
    return {"model_stats": entries}


def repository_index(
    loaded: Mapping[str, Sequence[int]], available: Sequence[str], *, ready_only: bool = False
) -> list[dict[str, str]]:
    """The repository index: every model folder, with its loaded versions ``READY`` and the
    others ``UNAVAILABLE``."""
    entries: list[dict[str, str]] = []
    for name in sorted(set(available) | set(loaded)):
        versions = loaded.get(name, ())
        if versions:
            entries.extend(
                {"name": name, "version": str(v), "state": "READY", "reason": ""} for v in versions
            )
        elif not ready_only:
            entries.append(
                {"name": name, "version": "", "state": "UNAVAILABLE", "reason": "unloaded"}
            )
    return entries
