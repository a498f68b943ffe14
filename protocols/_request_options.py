"""`RequestOptions`: how to run one inference request, each field checked when it is made.

Everything a caller can say about a request besides the model and its inputs (version,
outputs, request id, parameters, sequence, priority, timeout, traceparent) is one field, and
each field's converter checks the value given and returns its normal form. An `InferRequest`
holds the options it was made with (``request.options``), and an ensemble's requests of its
composing models share them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from numbers import Real
from types import MappingProxyType

import attrs

from ._errors import InvalidRequestError

ParameterValue = str | int | float | bool
"""A request parameter's value."""


def _bad(argument: str, expected: str, got: object) -> InvalidRequestError:
    return InvalidRequestError(f"{argument} must be {expected}, got {got!r:.80}")


def _model_version(value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad("model_version", "an integer (-1 for the latest)", value)
    return value


def _outputs(value: Sequence[str] | None) -> frozenset[str] | None:
    if value is None:
        return None
    if isinstance(value, str | bytes) or not all(isinstance(o, str) for o in value):
        raise _bad("outputs", "a list of output names", value)
    return frozenset(value) or None


def _request_id(value: str | None) -> str:
    if value is not None and not isinstance(value, str):
        raise _bad("request_id", "a string", value)
    return value or ""


def _parameters(value: Mapping[str, ParameterValue] | None) -> Mapping[str, ParameterValue]:
    params = dict(value or {})  # a copy: a proxy the caller made may wrap a dict it changes
    for key, item in params.items():
        if not isinstance(key, str) or not isinstance(item, str | int | float | bool):
            raise _bad(f"parameters[{key!r}]", "a str, int, float or bool", item)
    return MappingProxyType(params)


def _sequence_id(value: int | str) -> int | str:
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise _bad("sequence_id", "an integer or a string", value)
    return value


def _priority(value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise _bad("priority", "a non-negative integer", value)
    return value


def _timeout(value: float | None) -> float | None:
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, Real) or math.isnan(value) or value <= 0
    ):
        raise _bad("timeout", "a positive number of seconds", value)
    return None if value is None else float(value)


@attrs.frozen(kw_only=True)
class RequestOptions:
    """How to run one inference request: everything ``infer`` takes besides the model name
    and the inputs. ``server.infer(name, inputs, priority=2)`` builds one from its keyword
    arguments; make one yourself to reuse it (``options=...``, changed with `attrs.evolve`).

    Each field is checked when the options are made.

    Raises:
        InvalidRequestError: a field of the wrong kind, naming it.
    """

    model_version: int = attrs.field(default=-1, converter=_model_version)
    """The model's version: -1 or 0 for the latest loaded one."""
    outputs: frozenset[str] | None = attrs.field(default=None, converter=_outputs)
    """The outputs wanted (any collection of names; None or empty: all). An ensemble skips
    steps that only lead to outputs nobody asked for. An output the model (or an ensemble's
    composing model) leaves out of its answer is left out of the response, as in Triton."""
    request_id: str = attrs.field(default="", converter=_request_id)
    """Echoed in the response and forwarded to composing models (None: none)."""
    parameters: Mapping[str, ParameterValue] = attrs.field(factory=dict, converter=_parameters)
    """Custom request parameters, forwarded to composing models (read-only: every request
    made with these options shares them)."""
    sequence_id: int | str = attrs.field(default=0, converter=_sequence_id)
    """The sequence (correlation id) the request belongs to (0 or "": none); forwarded to
    composing models, like the two flags below."""
    sequence_start: bool = attrs.field(default=False, converter=bool)
    """The request starts its sequence."""
    sequence_end: bool = attrs.field(default=False, converter=bool)
    """The request ends its sequence."""
    priority: int = attrs.field(default=0, converter=_priority)
    """Request priority, forwarded to composing models."""
    timeout: float | None = attrs.field(default=None, converter=_timeout)
    """Seconds the whole request may take (None: no limit); forwarded to composing models.
    Work that can be cancelled (async models, queued requests, waits) is cancelled then; a
    synchronous execution that is running finishes, and its late result is discarded.
    ``stream_infer`` takes none: wrap its loop in a trio deadline."""
    traceparent: str | None = None
    """A W3C ``traceparent`` header: the request's span becomes a child of the span it names
    (when the server traces; a malformed one is ignored)."""


DEFAULT_OPTIONS = RequestOptions()
"""Every field's default, made once (checking ten fields costs ~2.5 us per request)."""
