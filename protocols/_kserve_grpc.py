"""The gRPC messages of ``inference.GRPCInferenceService`` (tritonclient's generated
classes), to and from orchestrion's requests and responses. No I/O.

How this works: tensors travel in ``raw_input_contents``/``raw_output_contents`` (the bytes of
`_kserve_tensors`), or, on input, in the typed ``contents`` fields; the request parameters are
read as HTTP's are (`_kserve_requests`). The documents shared with HTTP (metadata, statistics,
the repository index) are built once, as JSON (`_kserve_documents`), and parsed into the
messages.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

import numpy as np
from google.protobuf import json_format
from tritonclient.grpc import service_pb2

from ._config import ModelConfig
from ._dtypes import DataType
from ._errors import InvalidRequestError
from ._kserve_documents import (
    model_config_message,
    model_metadata,
    model_statistics_json,
    repository_index,
    server_metadata,
)
from ._kserve_requests import (
    SharedInput,
    SharedMemoryRef,
    WireRequest,
    classification_count,
    parse_version,
    request_parameters,
    shared_memory_ref,
)
from ._kserve_tensors import (
    data_type,
    element_count,
    numeric_array,
    tensor_from_bytes,
    tensor_to_bytes,
)
from ._messages import InferResponse
from ._request_options import ParameterValue, RequestOptions
from ._statistics import ModelStatistics

_CONTENTS = {
    DataType.BOOL: "bool_contents",
    DataType.INT8: "int_contents",
    DataType.INT16: "int_contents",
    DataType.INT32: "int_contents",
    DataType.INT64: "int64_contents",
    DataType.UINT8: "uint_contents",
    DataType.UINT16: "uint_contents",
    DataType.UINT32: "uint_contents",
    DataType.UINT64: "uint64_contents",
    DataType.FP32: "fp32_contents",
    DataType.FP64: "fp64_contents",
    DataType.BYTES: "bytes_contents",
}
"""Which typed ``InferTensorContents`` field carries each data type (FP16/BF16: none)."""


def parameter_value(parameter: Any) -> ParameterValue:
    """The value of an ``InferParameter`` (whichever of its fields is set)."""
    which = parameter.WhichOneof("parameter_choice")
    if which is None:
        return ""
    value: ParameterValue = getattr(parameter, which)
    return value


def set_parameter(parameter: Any, value: ParameterValue) -> None:
    """Write a value into an ``InferParameter`` of the matching kind."""
    if isinstance(value, bool):
        parameter.bool_param = value
    elif isinstance(value, int):
        if value >= 2**63:  # a sequence id past int64 (the request's checks bound it)
            parameter.uint64_param = value
        else:
            parameter.int64_param = value
    elif isinstance(value, float):
        parameter.double_param = value
    else:
        parameter.string_param = str(value)


def decode_grpc_request(message: Any) -> WireRequest:
    """A ``ModelInferRequest`` as a `WireRequest`.

    Raises:
        InvalidRequestError: a tensor or a parameter is malformed (its name said).
    """
    parameters = {key: parameter_value(value) for key, value in message.parameters.items()}
    fields, flags = request_parameters(parameters)  # binary_data_output is HTTP's: ignored
    raw = message.raw_input_contents
    used = 0  # raw_input_contents are taken in order by the inputs that have no other data
    inputs: dict[str, np.ndarray[Any, Any]] = {}
    shared_inputs: dict[str, SharedInput] = {}
    for tensor in message.inputs:
        name = tensor.name
        if name in inputs or name in shared_inputs:
            raise InvalidRequestError(f"input '{name}' is given twice")
        dtype = data_type(tensor.datatype, name)
        shape = list(tensor.shape)
        where = shared_memory_ref(_parameters(tensor.parameters), name)
        contents = tensor.HasField("contents")
        if where is not None:
            if contents:
                raise InvalidRequestError(
                    f"unexpected 'content' provided when using shared memory for input tensor "
                    f"'{name}' for model '{message.model_name}'"
                )
            element_count(shape, name)
            shared_inputs[name] = SharedInput(where, dtype, tuple(shape))
        elif contents and raw:
            raise InvalidRequestError(
                f"contents field must not be specified when using raw_input_contents for "
                f"'{name}' for model '{message.model_name}'"
            )
        elif contents or (used == len(raw) and element_count(shape, name) == 0):
            inputs[name] = _from_contents(tensor, dtype, shape)
        elif used < len(raw):
            inputs[name] = tensor_from_bytes(raw[used], dtype, shape, name)
            used += 1
        else:
            raise InvalidRequestError(
                f"unable to find data for input tensor '{name}' for model "
                f"'{message.model_name}' in request."
            )
    if used != len(raw):
        raise InvalidRequestError(
            f"{len(raw)} raw_input_contents for the {used} inputs that take theirs from "
            "raw_input_contents (one each, in order)"
        )
    names, shared_outputs, classifications = _requested_outputs(message.outputs)
    return WireRequest(
        model_name=message.model_name,
        inputs=inputs,
        options=RequestOptions(
            model_version=parse_version(message.model_version),
            outputs=tuple(names) or None,
            request_id=message.id,
            **fields,
        ),
        empty_final_response=flags.get("empty_final_response", False),
        shared_inputs=shared_inputs,
        shared_outputs=shared_outputs,
        classifications=classifications,
    )


def _requested_outputs(
    outputs: Any,
) -> tuple[list[str], dict[str, SharedMemoryRef], dict[str, int]]:
    """The requested outputs' names, and those asked in shared memory or as classes."""
    names: list[str] = []
    shared_outputs: dict[str, SharedMemoryRef] = {}
    classifications: dict[str, int] = {}
    seen: set[str] = set()
    for output in outputs:
        name = output.name
        if name in seen:
            raise InvalidRequestError(f"output '{name}' already exists in request")
        seen.add(name)
        parameters = _parameters(output.parameters)
        count = classification_count(parameters, name)
        where = shared_memory_ref(parameters, name)
        if where is not None:
            if "classification" in parameters:
                raise InvalidRequestError(
                    f"output '{name}': output can't set both 'shared_memory_region' and "
                    "'classification'"
                )
            shared_outputs[name] = where
        elif count:
            classifications[name] = count
        names.append(name)
    return names, shared_outputs, classifications


def _parameters(parameters: Mapping[str, Any]) -> dict[str, ParameterValue]:
    return {key: parameter_value(value) for key, value in parameters.items()}


def _from_contents(tensor: Any, dtype: DataType, shape: list[int]) -> np.ndarray[Any, Any]:
    field = _CONTENTS.get(dtype)
    if field is None:
        raise InvalidRequestError(
            f"input '{tensor.name}': {dtype.value} tensors can only be sent in raw_input_contents"
        )
    values = getattr(tensor.contents, field)
    count = element_count(shape, tensor.name)
    if len(values) != count:
        raise InvalidRequestError(
            f"unexpected number of elements {len(values)} for input '{tensor.name}' of shape "
            f"{shape}, expecting {count}"
        )
    if dtype is DataType.BYTES:
        array = np.empty(count, dtype=object)
        array[:] = list(values)
        return array.reshape(tuple(shape))
    return numeric_array(values, dtype, shape, tensor.name)


def _described(
    response: InferResponse, final: bool | None, shared: Collection[str]
) -> tuple[Any, list[Any]]:
    """A ``ModelInferResponse`` of everything but the raw contents, and the raw contents
    (empty for the outputs in ``shared``, written into shared memory, as Triton's)."""
    message = service_pb2.ModelInferResponse(
        model_name=response.model_name,
        model_version=str(response.model_version),
        id=response.request_id,
    )
    for key, value in response.parameters.items():
        set_parameter(message.parameters[key], value)
    if final is not None:
        message.parameters["triton_final_response"].bool_param = final
    raws = []
    for name, array in response.outputs.items():
        output = message.outputs.add()
        output.name = name
        output.datatype = DataType.from_numpy(array.dtype).value
        output.shape.extend(array.shape)
        raws.append(b"" if name in shared else tensor_to_bytes(array))
    return message, raws


def encode_grpc_response(
    response: InferResponse, *, final: bool | None = None, shared: Collection[str] = ()
) -> Any:
    """A ``ModelInferResponse`` with every output in ``raw_output_contents``.

    ``final`` sets the ``triton_final_response`` parameter (streams); the outputs named in
    ``shared`` went into shared memory and have empty contents.
    """
    message, raws = _described(response, final, shared)
    message.raw_output_contents.extend(bytes(raw) for raw in raws)
    return message


def serialized_grpc_response(response: InferResponse, shared: Collection[str] = ()) -> bytes:
    """`encode_grpc_response`'s message, serialized: the same bytes a client parses, made
    with one copy of the tensors. protobuf's own serializer (upb) takes ~10 ns a byte of a
    large ``bytes`` field (2.8 s for 256 MiB, holding the GIL), so the raw contents are
    written here as what they are on the wire: field 6, length-delimited, after the rest."""
    message, raws = _described(response, None, shared)
    parts = [message.SerializeToString()]
    for raw in raws:
        parts += [_RAW_OUTPUT_TAG, _varint(len(raw)), raw]
    return b"".join(parts)


_RAW_OUTPUT_TAG = bytes([6 << 3 | 2])
"""``raw_output_contents`` (field 6) as a length-delimited field."""


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low = value & 0x7F
        value >>= 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def declared_size(message: Any) -> int:
    """About how many bytes a ``ModelInferRequest``'s tensors hold, from their shapes (cheap:
    ``ByteSize()`` serializes the whole message to find out)."""
    total = 0
    for tensor in message.inputs:
        count = 1
        for dim in tensor.shape:
            count *= max(int(dim), 0)
        total += min(count, 2**40) * 4
    return total


def final_response(model_name: str, model_version: str, request_id: str) -> Any:
    """The empty response that ends a decoupled request's stream
    (``triton_enable_empty_final_response``)."""
    message = service_pb2.ModelInferResponse(
        model_name=model_name, model_version=model_version, id=request_id
    )
    message.parameters["triton_final_response"].bool_param = True
    return message


def server_metadata_message(version: str, name: str = "orchestrion") -> Any:
    """``ServerMetadataResponse``."""
    return json_format.ParseDict(
        server_metadata(version, name), service_pb2.ServerMetadataResponse()
    )


def model_metadata_message(config: ModelConfig, versions: Sequence[int]) -> Any:
    """``ModelMetadataResponse``."""
    return json_format.ParseDict(
        model_metadata(config, versions), service_pb2.ModelMetadataResponse()
    )


def model_config_response(config: ModelConfig) -> Any:
    """``ModelConfigResponse``."""
    return service_pb2.ModelConfigResponse(config=model_config_message(config))


def model_statistics_message(statistics: Sequence[ModelStatistics]) -> Any:
    """``ModelStatisticsResponse``."""
    return json_format.ParseDict(
        model_statistics_json(statistics),
        service_pb2.ModelStatisticsResponse(),
        ignore_unknown_fields=True,
    )


def repository_index_message(
    loaded: Mapping[str, Sequence[int]],
    available: Sequence[str],
    *,
    ready_only: bool,
    failed: Mapping[str, str] | None = None,
) -> Any:
    """``RepositoryIndexResponse``."""
    return json_format.ParseDict(
        {"models": repository_index(loaded, available, ready_only=ready_only, failed=failed)},
        service_pb2.RepositoryIndexResponse(),
    )
