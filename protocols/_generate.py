"""Triton's generate extension: its JSON request made into a `WireRequest`, and each response
made into its JSON object (pure code; the routes are in ``frontends._http_generate``).

How a request maps (as Triton's HTTP front end maps it, with its error texts, which clients
match): the body is one JSON object whose members are read in order, duplicates included.
A member named like one of the model's inputs becomes that input: a scalar or a flat list,
shaped to the input's dims (fixed dims divide the element count, the innermost variable dim
takes the rest, other variable dims are 1), its elements checked against the data type.
``id`` is the request id (a string). ``parameters`` is an object read the same way, one
level deep. Any other member is a request parameter: a string, integer, float or boolean.

A response becomes one object: ``id`` (when the request had one), ``model_name``,
``model_version``, the response's parameters, and each output as a flat list, or as its one
element when it has one.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from ._config import ModelConfig, TensorConfig
from ._dtypes import DataType
from ._errors import InvalidRequestError
from ._kserve_http import json_data
from ._kserve_requests import WireRequest
from ._messages import InferResponse
from ._request_options import RequestOptions

PARAMETERS = "parameters"
"""The one nested member: its members map as the top level's do."""
_ACCESS = {
    "bool": "attempt to access JSON non-boolean as boolean",
    "int": "attempt to access JSON non-signed-integer as signed-integer",
    "uint": "attempt to access JSON non-unsigned-integer as unsigned-integer",
    "float": "attempt to access JSON non-number as number",
    "str": "attempt to access JSON non-string as string",
}
"""Triton's words for a JSON value of the wrong kind, by the kind expected."""


@attrs.frozen
class _Members:
    """A JSON object's members in document order, duplicates kept."""

    pairs: list[tuple[str, Any]]


def _members(pairs: list[tuple[str, Any]]) -> _Members:
    return _Members(pairs)


def decode_generate_request(
    config: ModelConfig, version: int, body: bytes | bytearray, max_input_size: int
) -> WireRequest:
    """The request in a generate body, for the model ``config`` describes.

    Raises:
        InvalidRequestError: not a JSON object, a member of the wrong kind, an input that
            cannot take the shape of its dims, inputs larger than ``max_input_size`` bytes
            together, an input given twice (Triton's texts).
    """
    document = _parsed(body)
    inputs = {tensor.name: tensor for tensor in config.input}
    request = _Request(config, max_input_size)
    for name, value in document.pairs:
        if name == PARAMETERS:
            request.nested(name, value, inputs)
        else:
            if name == "id" and "id" not in inputs:
                request.request_id = _request_id(value)
                continue
            request.member(name, value, inputs)
    return WireRequest(
        model_name=config.name,
        inputs=request.tensors,
        options=RequestOptions(
            model_version=version,
            request_id=request.request_id,
            parameters=request.parameters,
        ),
    )


def _parsed(body: bytes | bytearray) -> _Members:
    if not body.strip():
        return _Members([])  # Triton reads an empty body as an empty request
    try:
        document = json.loads(body, object_pairs_hook=_members)
    except RecursionError:
        raise InvalidRequestError(
            "failed to parse the request JSON buffer: nested too deeply"
        ) from None
    except ValueError as exc:
        raise InvalidRequestError(f"failed to parse the request JSON buffer: {exc}") from None
    if not isinstance(document, _Members):
        raise InvalidRequestError("failed to parse the request JSON buffer: not an object")
    return document


def _request_id(value: object) -> str:
    if not isinstance(value, str):
        raise InvalidRequestError(f"Unable to parse 'id': {_ACCESS['str']}")
    return value


@attrs.define
class _Request:
    """A generate request as its members are read."""

    config: ModelConfig
    max_input_size: int
    tensors: dict[str, np.ndarray[Any, Any]] = attrs.field(factory=dict)
    parameters: dict[str, str | int | float | bool] = attrs.field(factory=dict)
    request_id: str = ""
    consumed: int = 0
    """Bytes of the inputs read so far (Triton's limit counts them all)."""

    def nested(self, name: str, value: object, inputs: Mapping[str, TensorConfig]) -> None:
        if name in inputs:
            raise InvalidRequestError(
                f"Keyword '{name}' for nested schema also given as input tensor name"
            )
        if not isinstance(value, _Members):
            raise InvalidRequestError(f"Expected JSON object for keyword: '{name}'")
        for member, item in value.pairs:
            try:
                self.member(member, item, inputs)
            except InvalidRequestError as exc:
                raise InvalidRequestError(f"Converting keyword: '{name}': {exc}") from None

    def member(self, name: str, value: object, inputs: Mapping[str, TensorConfig]) -> None:
        tensor = inputs.get(name)
        if tensor is None:
            self.parameters[name] = _parameter(name, value)
            return
        if name in self.tensors:
            raise InvalidRequestError(f"input '{name}' already exists in request")
        self.tensors[name] = self._tensor(tensor, value)

    def _tensor(self, tensor: TensorConfig, value: object) -> np.ndarray[Any, Any]:
        items = value if isinstance(value, list) else [value]
        dtype = tensor.data_type
        name = tensor.name
        data = _elements(items, dtype)
        if dtype is DataType.BYTES:  # as serialized: a 4-byte length before each element
            size = sum(4 + len(item) for item in data)
        else:
            size = len(items) * dtype.numpy_dtype.itemsize
        if size and (self.consumed + size > self.max_input_size):
            raise InvalidRequestError(
                f"request size of {self.consumed} bytes with input '{name}' of size {size} "
                f"bytes exceeds the maximum allowed input size of {self.max_input_size}. "
                "Use --http-max-input-size to increase the limit."
            )
        self.consumed += size
        shape = _shape(self.config, tensor, len(items))
        if dtype is DataType.BYTES:
            array = np.empty(len(data), dtype=object)
            array[:] = data
        else:
            try:
                array = np.array(data, dtype=dtype.numpy_dtype)
            except OverflowError:  # an integer outside the type's range
                raise InvalidRequestError(
                    f"input '{name}': a value is out of range for {dtype.value}"
                ) from None
        return array.reshape(shape)


def _elements(items: Sequence[object], dtype: DataType) -> list[Any]:
    """``items`` checked against ``dtype`` (BYTES as UTF-8 bytes)."""
    if dtype is DataType.BYTES:
        if not all(isinstance(item, str) for item in items):
            raise InvalidRequestError(_ACCESS["str"])
        return [item.encode() for item in items if isinstance(item, str)]
    if dtype is DataType.BOOL:
        kind = "bool"
        fits = all(isinstance(item, bool) for item in items)
    elif dtype.value.startswith("UINT"):
        kind = "uint"
        fits = all(type(item) is int and item >= 0 for item in items)
    elif dtype.value.startswith("INT"):
        kind = "int"
        fits = all(type(item) is int for item in items)
    else:
        kind = "float"
        fits = all(type(item) in (int, float) for item in items)
    if not fits:
        raise InvalidRequestError(_ACCESS[kind])
    return list(items)


def _shape(config: ModelConfig, tensor: TensorConfig, count: int) -> tuple[int, ...]:
    """The shape ``count`` elements take in ``tensor`` (its metadata shape: a leading -1 when
    the model batches), as Triton's generate endpoint makes it: the fixed dims divide the
    count, the innermost variable dim takes what is left, the other variable dims are 1."""
    dims = [-1, *tensor.dims] if config.max_batch_size > 0 else list(tensor.dims)
    left = count
    for dim in reversed(dims):
        if dim > 0:
            if left % dim:
                left = -1
                break
            left //= dim
    shape = list(dims)
    for at in range(len(shape) - 1, -1, -1):
        if shape[at] == -1:
            shape[at], left = max(left, 0), 1
    if left < 0 or math.prod(shape) != count:
        raise InvalidRequestError(
            f"The schema can not convert input '{tensor.name}' to tensor with proper shape"
        )
    return tuple(shape)


def _parameter(name: str, value: object) -> str | int | float | bool:
    if isinstance(value, str | bool | int | float):
        return value
    raise InvalidRequestError(
        f"parameter '{name}' has invalid type. It should be either 'int', 'bool', or 'string'."
    )


def generate_response(response: InferResponse, request_id: str) -> dict[str, Any]:
    """The generate extension's JSON object for one response.

    Raises:
        InvalidRequestError: an output JSON cannot carry (FP16, BF16, bytes that are not
            UTF-8), or a parameter of bytes.
    """
    document: dict[str, Any] = {}
    if request_id:
        document["id"] = request_id
    document["model_name"] = response.model_name
    document["model_version"] = str(response.model_version)
    for name, value in response.parameters.items():
        if isinstance(value, bytes):
            raise InvalidRequestError(
                f"Response parameter '{name}' has type 'TRITONSERVER_PARAMETER_BYTES' which "
                "is not currently supported"
            )
        document[name] = value
    for name, array in response.outputs.items():
        data = json_data(np.asarray(array), DataType.from_numpy(np.asarray(array).dtype), name)
        document[name] = data[0] if len(data) == 1 else data
    return document
