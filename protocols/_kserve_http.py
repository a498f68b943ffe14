"""HTTP infer bodies: Triton's JSON request and response, and its binary tensor extension.

How this works: a request body is a JSON document, optionally followed by raw tensors; the
``Inference-Header-Content-Length`` header says where the JSON ends, and each binary input says
its ``binary_data_size``, in order. `decode_http_request` checks all of it and makes a
`WireRequest`. A response writes each output as JSON ``data`` or, when the client asked
(``binary_data``, ``binary_data_output``), as raw bytes after the JSON header. Large JSON
outputs are written block by block so that the GIL is released between blocks.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping
from typing import Any

import numpy as np

from . import _json_slices as json_slices
from ._config import ModelConfig
from ._dtypes import DataType
from ._errors import InvalidRequestError, JsonFieldError
from ._json_tensors import JSON_NUMBERS, NESTING, json_tensor
from ._kserve_requests import (
    SharedInput,
    SharedMemoryRef,
    WireRequest,
    classification_count,
    flag,
    parse_version,
    request_parameters,
    shared_memory_ref,
)
from ._kserve_status import error_message
from ._kserve_tensors import (
    data_type,
    element_count,
    tensor_from_bytes,
    tensor_to_bytes,
)
from ._messages import InferResponse
from ._request_options import RequestOptions

HEADER_LENGTH = "inference-header-content-length"
"""Triton's binary tensor extension: the length of the JSON header before the tensors."""


def decode_http_request(
    model_name: str, version: str, body: bytes | bytearray | memoryview, header_length: int | None
) -> WireRequest:
    """An HTTP infer request: a JSON document, then binary tensors when ``header_length``
    (``Inference-Header-Content-Length``) is given.

    Raises:
        InvalidRequestError: the body, a tensor or a parameter is malformed (its name said).
    """
    length = len(body) if header_length is None else header_length
    if length <= json_slices.WINDOW:
        return _decoded_request(model_name, version, body, header_length)
    with json_slices.collector_paused():  # millions of elements: see _json_slices
        return _decoded_request(model_name, version, body, header_length)


def _decoded_request(
    model_name: str, version: str, body: bytes | bytearray | memoryview, header_length: int | None
) -> WireRequest:
    view = memoryview(body).toreadonly()  # tensors are read-only views of it
    if header_length is None:
        header_length = len(view)
    elif header_length > len(view):
        raise InvalidRequestError(
            f"Inference-Header-Content-Length {header_length} is larger than the body "
            f"({len(view)} bytes)"
        )
    try:
        document = json_slices.loads(view[:header_length], runs=True)
    except RecursionError:
        raise InvalidRequestError(f"failed to parse the request JSON: {NESTING}") from None
    except ValueError as exc:
        raise InvalidRequestError(f"failed to parse the request JSON: {exc}") from None
    if not isinstance(document, dict):
        raise InvalidRequestError("the request JSON must be an object")
    binary = view[header_length:]
    fields, flags = request_parameters(_object(document, "parameters"))
    request_id = document.get("id", "")
    if not isinstance(request_id, str):
        raise InvalidRequestError("request 'id' must be a string")
    inputs_field = document.get("inputs")
    if not isinstance(inputs_field, list):
        raise InvalidRequestError("the request JSON needs an 'inputs' array")
    inputs, shared_inputs = _decode_inputs(inputs_field, binary)
    outputs, binary_outputs, shared_outputs, classifications = _requested_outputs(
        document.get("outputs")
    )
    return WireRequest(
        model_name=model_name,
        inputs=inputs,
        options=RequestOptions(
            model_version=parse_version(version), outputs=outputs, request_id=request_id, **fields
        ),
        binary_outputs=binary_outputs,
        shared_inputs=shared_inputs,
        shared_outputs=shared_outputs,
        classifications=classifications,
        **flags,
    )


def decode_raw_request(
    config: ModelConfig, version: str, body: bytes | bytearray | memoryview
) -> WireRequest:
    """Triton's raw binary request (``Inference-Header-Content-Length: 0``): the body is the
    one input's bytes, its shape deduced from the config (one variable dim at most; a BYTES
    input must be one element); every output comes back as binary data.

    Raises:
        InvalidRequestError: the model has several inputs, a shape cannot be deduced, or the
            body does not fit the shape (Triton's words).
    """
    if len(config.input) != 1:
        raise InvalidRequestError(
            f"Raw request must only have 1 input (found 1) to be deduced but got "
            f"{len(config.input)} inputs in '{config.name}' model configuration"
        )
    spec = config.input[0]
    shape = [1] if config.max_batch_size > 0 else []
    variable: int | None = None
    count = 1
    for dim in spec.dims:
        if dim < 0:
            if variable is not None:
                raise InvalidRequestError(
                    f"The shape of the raw input '{spec.name}' can not be deduced because "
                    "there are more than one variable-sized dimension"
                )
            variable = len(shape)
        else:
            count *= dim
        shape.append(dim)
    if spec.data_type is DataType.BYTES:
        if variable is not None or count != 1:
            raise InvalidRequestError(
                f"For BYTE datatype raw input '{spec.name}', the model must have input shape [1]"
            )
        array = np.empty(1, dtype=object)
        array[0] = bytes(body)
        tensor = array.reshape(tuple(shape))
    else:
        if variable is not None:
            unit = count * spec.data_type.numpy_dtype.itemsize
            shape[variable] = len(body) // unit if unit else 0
        tensor = tensor_from_bytes(memoryview(body).toreadonly(), spec.data_type, shape, spec.name)
    return WireRequest(
        model_name=config.name,
        inputs={spec.name: tensor},
        options=RequestOptions(model_version=parse_version(version)),
        binary_default=True,
    )


def _decode_inputs(
    inputs_field: list[Any], binary: memoryview
) -> tuple[dict[str, np.ndarray[Any, Any]], dict[str, SharedInput]]:
    """The request's ``inputs``, each from its JSON ``data``, from its ``binary_data_size``
    bytes of ``binary`` (the body after the JSON header, taken in order and used up exactly),
    or, set apart, from shared memory.
    """
    inputs: dict[str, np.ndarray[Any, Any]] = {}
    shared: dict[str, SharedInput] = {}
    offset = 0
    for item in inputs_field:
        if not isinstance(item, dict):
            raise InvalidRequestError("each element of 'inputs' must be an object")
        name = item.get("name")
        if not isinstance(name, str):
            raise InvalidRequestError("an input has no 'name' string")
        if name in inputs or name in shared:
            raise InvalidRequestError(f"input '{name}' is given twice")
        dtype = data_type(item.get("datatype"), name)
        shape = item.get("shape")
        if not isinstance(shape, list):
            raise InvalidRequestError(f"input '{name}' has no 'shape' array")
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise JsonFieldError(
                f"input '{name}': Unable to parse 'shape': attempt to access JSON "
                "non-unsigned-integer as unsigned-integer"
            )
        element_count(shape, name, 0 if dtype is DataType.BYTES else dtype.numpy_dtype.itemsize)
        parameters = _object(item, "parameters", where=f"input '{name}'")
        _one_source(name, item, parameters)
        size = parameters.get("binary_data_size")
        where = shared_memory_ref(parameters, name)
        if where is not None:
            shared[name] = SharedInput(where, dtype, tuple(shape))
        elif size is not None:
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
        else:
            inputs[name] = json_tensor(item["data"], dtype, shape, name)
    if offset != len(binary):
        raise InvalidRequestError(
            f"{len(binary) - offset} bytes of binary data follow the tensors the header names"
        )
    return inputs, shared


def _one_source(name: str, item: Mapping[str, Any], parameters: Mapping[str, Any]) -> None:
    """Refuses an input that gives its values in none or several of the three ways, in
    Triton's words."""
    given = [
        label
        for label, present in (
            ("'data'", "data" in item),
            ("'binary_data_size'", "binary_data_size" in parameters),
            ("'shared_memory_region'", "shared_memory_region" in parameters),
        )
        if present
    ]
    if len(given) != 1:
        found = "no field is set" if not given else "set " + " ".join(given)
        raise InvalidRequestError(
            f"input '{name}': Input must set only one of the following fields: 'data', "
            "'binary_data_size' in 'parameters', 'shared_memory_region' in 'parameters'. "
            f"But {found}"
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
) -> tuple[tuple[str, ...] | None, dict[str, bool], dict[str, SharedMemoryRef], dict[str, int]]:
    """The requested outputs' names, and per output: binary_data, shared memory, and
    classification."""
    if field is None:
        return None, {}, {}, {}
    if not isinstance(field, list):
        raise InvalidRequestError("'outputs' must be an array")
    names: list[str] = []
    binary: dict[str, bool] = {}
    shared: dict[str, SharedMemoryRef] = {}
    classes: dict[str, int] = {}
    seen: set[str] = set()
    for item in field:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise InvalidRequestError("each requested output needs a 'name' string")
        name = item["name"]
        if name in seen:
            raise InvalidRequestError(f"output '{name}' already exists in request")
        seen.add(name)
        parameters = _object(item, "parameters", where=f"output '{name}'")
        if "binary_data" in parameters:
            binary[name] = flag("binary_data", parameters["binary_data"], f"output '{name}'")
        count = classification_count(parameters, name)
        where = shared_memory_ref(parameters, name)
        if where is not None:
            if "classification" in parameters:
                raise InvalidRequestError(
                    f"output '{name}': Output can't set both 'shared_memory_region' and "
                    "'classification'"
                )
            if binary.get(name):
                raise InvalidRequestError(
                    f"output '{name}': Output can't set both 'shared_memory_region' and "
                    "'binary_data'"
                )
            shared[name] = where
        elif count:
            classes[name] = count
        names.append(name)
    return tuple(names), binary, shared, classes


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
    large: list[list[bytes]] = []
    nonce = secrets.token_hex(16) + ":"
    for name, array in response.outputs.items():
        dtype = DataType.from_numpy(array.dtype)
        entry: dict[str, Any] = {
            "name": name,
            "datatype": dtype.value,
            "shape": list(array.shape),
        }
        if name in request.shared_outputs:
            pass  # written into the client's region: the entry only describes it
        elif request.binary_outputs.get(name, request.binary_default):
            raw = tensor_to_bytes(array)
            entry["parameters"] = {"binary_data_size": len(raw)}
            chunks.append(raw)
        elif array.size > _JSON_BLOCK:
            # Written apart, block by block, and sent as the blocks between the pieces of the
            # header: one json.dumps of millions of numbers (or one join of their text) would
            # hold the GIL, so the event loop, for a second or more.
            entry["data"] = f"{nonce}{len(large)}"  # unguessable: no client string can match
            large.append(_json_data_blocks(array, dtype, name))
        else:
            entry["data"] = json_data(array, dtype, name)
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
    rest = json.dumps(document, separators=(",", ":")).encode()
    head: list[bytes | memoryview] = []
    for index, blocks in enumerate(large):
        before, rest = rest.split(f'"{nonce}{index}"'.encode(), 1)
        head += (before, *blocks)
    head.append(rest)
    json_length = sum(len(piece) for piece in head) if chunks else None
    return [*head, *chunks], json_length


_JSON_BLOCK = 1 << 16
"""Elements of an output written as JSON in one call (a few milliseconds holding the GIL)."""


def _json_data_blocks(array: np.ndarray[Any, Any], dtype: DataType, name: str) -> list[bytes]:
    """A large output's JSON ``data`` array as pieces of text (``[``, blocks of elements with
    the commas between them, ``]``), each written in one short call."""
    flat = array.reshape(-1)
    pieces = [b"["]
    for at in range(0, flat.size, _JSON_BLOCK):
        text = json.dumps(
            json_data(flat[at : at + _JSON_BLOCK], dtype, name), separators=(",", ":")
        )
        if len(text) > 2:
            pieces.append(text[1:-1].encode() if len(pieces) == 1 else ("," + text[1:-1]).encode())
    pieces.append(b"]")
    return pieces


def json_data(array: np.ndarray[Any, Any], dtype: DataType, name: str) -> list[Any]:
    """An output's elements as JSON values, flat (BYTES as UTF-8 text).

    Raises:
        InvalidRequestError: FP16 or BF16, or bytes that are not UTF-8 (binary data only).
    """
    if dtype in JSON_NUMBERS:
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
