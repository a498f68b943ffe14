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

from ._errors import InvalidRequestError
from ._messages import ParameterValue
from ._requests import RequestOptions

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


def parse_version(text: str) -> int:
    """A model version from a URL or a message field: empty means the latest (-1)."""
    if text in ("", "-1"):
        return -1
    if not (text.isascii() and text.isdigit()) or len(text) > 18:
        raise InvalidRequestError(f"invalid model version '{text:.40}': expected an integer")
    return int(text)


def request_parameters(
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
    return options, flags


_UINT64_MAX = 2**64 - 1
_INT_RANGE = (-(2**63), _UINT64_MAX)
"""Integers a parameter may hold: what Triton's ``int64_param`` or ``uint64_param`` carry
(HTTP's JSON has no limit; larger ones would fail later, on the way out over gRPC)."""


def _unsigned(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _UINT64_MAX


def flag(key: str, value: object, where: str) -> bool:
    """A boolean parameter (``binary_data``, ``sequence_end``...).

    Raises:
        InvalidRequestError: ``value`` is not a boolean.
    """
    if not isinstance(value, bool):
        raise InvalidRequestError(f"{where}: {key} must be a boolean")
    return value
