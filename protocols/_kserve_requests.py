"""An inference request as a front end received it (`WireRequest`), and the request fields the
HTTP and gRPC messages share: the model version and Triton's request parameters.

How this works: a decoder (`_kserve_http`, `_kserve_grpc`) reads the tensors itself, and reads
the rest through `parse_version` and `request_parameters`: Triton's reserved parameters
(``sequence_id``, ``priority``, ``timeout`` in microseconds, ...) become `RequestOptions`
fields and the response encoding's flags, the others stay custom parameters that models see.
The wire's own limits (unsigned 64-bit integers) are checked here; `RequestOptions` checks the
rest, as for an embedding call.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeGuard

import attrs
import numpy as np

from ._dtypes import DataType
from ._errors import InvalidRequestError
from ._request_options import ParameterValue, RequestOptions

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


@attrs.frozen
class SharedMemoryRef:
    """Where a tensor lies in a registered system shared memory region: Triton's
    ``shared_memory_region``, ``shared_memory_byte_size`` and ``shared_memory_offset``
    parameters of an input or a requested output (the offset is into the registered part)."""

    region: str
    byte_size: int
    offset: int = 0


@attrs.frozen
class SharedInput:
    """An input whose bytes lie in shared memory, read by the front end before the model runs."""

    where: SharedMemoryRef
    datatype: DataType
    shape: tuple[int, ...]


@attrs.frozen(kw_only=True)
class WireRequest:
    """An inference request as a front end received it: the model, its inputs, the
    `RequestOptions` to run it with, and how the client wants each output encoded."""

    model_name: str
    inputs: dict[str, np.ndarray[Any, Any]] = attrs.field(factory=dict, eq=False, repr=False)
    options: RequestOptions = attrs.field(factory=RequestOptions)
    """Everything else ``AsyncServer.infer`` takes (the traceparent comes from the headers
    or metadata, not the message)."""
    binary_outputs: Mapping[str, bool] = attrs.field(factory=dict)
    """Per-output ``binary_data`` choices (HTTP)."""
    binary_default: bool = False
    """``binary_data_output``: outputs not named in ``binary_outputs`` go as binary (HTTP)."""
    empty_final_response: bool = False
    """``triton_enable_empty_final_response`` (gRPC streams)."""
    shared_inputs: Mapping[str, SharedInput] = attrs.field(factory=dict)
    """Inputs to read from shared memory (not in ``inputs`` until the front end reads them)."""
    shared_outputs: Mapping[str, SharedMemoryRef] = attrs.field(factory=dict)
    """Outputs to write into shared memory instead of the response."""
    classifications: Mapping[str, int] = attrs.field(factory=dict)
    """Outputs asked for as their top classes (``classification``: how many)."""


def parse_version(text: str) -> int:
    """A model version from a URL or a message field: empty means the latest (-1).

    Raises:
        InvalidRequestError: not a version number, in Triton's words (its clients match
            them: ``grpc_explicit_int8_content_client.py``).
    """
    if text in ("", "-1"):
        return -1
    shown = text if len(text) <= 100 else text[:100] + "..."
    if text.isascii() and text.startswith("-") and text[1:].isdigit():
        raise InvalidRequestError(
            f"invalid model version specified '{shown}' , version should be an integral value > 0"
        )
    if not (text.isascii() and text.isdigit()) or len(text) > 18:
        raise InvalidRequestError(
            f"failed to get model version from specified version string '{shown}' "
            "(details: stol), version should be an integral value > 0"
        )
    return int(text)


def request_parameters(  # noqa: C901 (per request: see docs/architecture.md)
    parameters: Mapping[str, object], *, where: str = "request parameters"
) -> tuple[dict[str, Any], dict[str, bool]]:
    """A request's parameters, read the way Triton does: the `RequestOptions` fields they
    give (the reserved sequence, priority and timeout ones, and the custom ones as
    ``parameters``), and the `WireRequest` flags they set (``binary_default``,
    ``empty_final_response``).

    Raises:
        InvalidRequestError: a reserved parameter of the wrong kind, shared memory, or a
            custom parameter that is not a string, boolean or 64-bit number.
    """
    options: dict[str, Any] = {}
    flags: dict[str, bool] = {}
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
        elif key in ("sequence_start", "sequence_end"):
            options[key] = flag(key, value, where)
        elif key == "binary_data_output":
            flags["binary_default"] = flag(key, value, where)
        elif key == "triton_enable_empty_final_response":
            flags["empty_final_response"] = flag(key, value, where)
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
            continue  # shared memory and classification are a tensor's, not the request's
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
    return options, flags


_UINT64_MAX = 2**64 - 1
_INT_RANGE = (-(2**63), _UINT64_MAX)
"""Integers a parameter may hold: what Triton's ``int64_param`` or ``uint64_param`` carry
(HTTP's JSON has no limit; larger ones would fail later, on the way out over gRPC)."""


def _unsigned(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _UINT64_MAX


def shared_memory_ref(parameters: Mapping[str, object], tensor: str) -> SharedMemoryRef | None:
    """A tensor's shared memory parameters, read as Triton reads them (None: not in shared
    memory).

    Raises:
        InvalidRequestError: an offset or size without a region, a region without a size,
            or a value of the wrong kind.
    """
    region = parameters.get("shared_memory_region")
    offset = parameters.get("shared_memory_offset", 0)
    size = parameters.get("shared_memory_byte_size")
    if region is None:
        for key in ("shared_memory_offset", "shared_memory_byte_size"):
            if key in parameters:
                raise InvalidRequestError(
                    f"'{key}' can not be specified without 'shared_memory_region' parameter "
                    f"for tensor '{tensor}'"
                )
        return None
    if not isinstance(region, str):
        raise InvalidRequestError(
            f"invalid value type for 'shared_memory_region' parameter for tensor '{tensor}', "
            "expected a string"
        )
    if size is None:
        raise InvalidRequestError(
            "'shared_memory_byte_size' must be specified along with 'shared_memory_region' "
            f"parameter for tensor '{tensor}'"
        )
    return SharedMemoryRef(
        region,
        _size_parameter("shared_memory_byte_size", size, tensor),
        _size_parameter("shared_memory_offset", offset, tensor),
    )


def _size_parameter(key: str, value: object, tensor: str) -> int:
    if not _unsigned(value):
        raise InvalidRequestError(
            f"invalid value for '{key}' parameter for tensor '{tensor}', expected an unsigned "
            "64-bit integer"
        )
    return value


def classification_count(parameters: Mapping[str, object], output: str) -> int:
    """How many top classes a requested output asks for (``classification``; 0: none).

    Raises:
        InvalidRequestError: not a positive integer.
    """
    value = parameters.get("classification", 0)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidRequestError(
            f"output '{output}': invalid value for 'classification' parameter, expected an "
            "integer >= 0"
        )
    return min(value, _UINT64_MAX)


def flag(key: str, value: object, where: str) -> bool:
    """A boolean parameter (``binary_data``, ``sequence_end``...).

    Raises:
        InvalidRequestError: ``value`` is not a boolean.
    """
    if not isinstance(value, bool):
        raise InvalidRequestError(f"{where}: {key} must be a boolean")
    return value
