"""`RequestOptions`, how to run an inference request, and building an `InferRequest` from them.

How this works: everything a caller can say about a request besides the model and its inputs
(version, outputs, request id, parameters, sequence, priority, timeout, traceparent) is one
field of `RequestOptions`, and each field's converter checks the value given and returns its
normal form. Every way in builds one: ``AsyncServer.infer`` and ``stream_infer`` (from their
keyword arguments, or an options object the caller made), the blocking ``Server``, and the HTTP
and gRPC decoders. `new_request` then checks the model name and inputs and makes the
`InferRequest` that travels through the actors.

The embedding API is called by people in notebooks: a dict where a list was meant, a string
where a list of names was meant, seconds given as a string. Each such mistake gets an
`InvalidRequestError` that says which argument and what was expected, rather than a
``TypeError`` from deep inside.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from numbers import Real
from typing import Any

import attrs

from ._errors import InvalidRequestError
from ._messages import InferRequest, ParameterValue


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


def _parameters(value: Mapping[str, ParameterValue] | None) -> dict[str, ParameterValue]:
    params = dict(value or {})
    for key, item in params.items():
        if not isinstance(key, str) or not isinstance(item, str | int | float | bool):
            raise _bad(f"parameters[{key!r}]", "a str, int, float or bool", item)
    return params


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
    return value


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
    parameters: dict[str, ParameterValue] = attrs.field(factory=dict, converter=_parameters)
    """Custom request parameters, forwarded to composing models."""
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


_FIELDS = frozenset(field.name for field in attrs.fields(RequestOptions))
_DEFAULTS = RequestOptions()
"""Every field's default (its ``parameters`` are never handed out: requests get a copy)."""


def check_field_names(
    fields: Mapping[str, object], caller: str, *, refused: Collection[str] = ()
) -> None:
    """Refuse a keyword argument that is not a `RequestOptions` field (or is one of
    ``refused``), the way Python refuses an unknown keyword.

    Raises:
        TypeError: ``<caller>() got an unexpected keyword argument '<name>'``.
    """
    for name in fields:
        if name not in _FIELDS or name in refused:
            raise TypeError(f"{caller}() got an unexpected keyword argument '{name}'")


def new_request(
    model_name: str,
    inputs: Mapping[str, Any],
    options: RequestOptions | None = None,
    fields: Mapping[str, Any] | None = None,
    *,
    caller: str = "new_request",
    refused: Collection[str] = (),
) -> tuple[InferRequest, RequestOptions]:
    """Check the arguments of ``infer`` and build the request; also returns the options it
    was built from: ``options`` (the defaults when None) with ``fields`` (`RequestOptions`
    fields by name) replacing some of them.

    The checks run in the order of the arguments: the keyword names, the model name, the
    inputs, then each field.

    Raises:
        TypeError: a name in ``fields`` that is no field (or is ``refused``), as from
            ``caller``.
        InvalidRequestError: an argument of the wrong kind, naming it.
    """
    fields = fields or {}
    if fields:
        check_field_names(fields, caller, refused=refused)
    if not isinstance(model_name, str) or not model_name:
        raise _bad("model_name", "a non-empty string", model_name)
    if not isinstance(inputs, Mapping):
        raise _bad("inputs", "a mapping of input names to arrays", inputs)
    if not all(isinstance(k, str) for k in inputs):
        raise _bad("inputs", "keyed by input names (strings)", list(inputs))
    if options is None:
        # The defaults are made once: checking ten fields costs ~2.5 us per request.
        options = RequestOptions(**fields) if fields else _DEFAULTS
    elif not isinstance(options, RequestOptions):
        raise _bad("options", "a RequestOptions", options)
    else:
        # A front end passes its traceparent, None most often: evolve (which checks every
        # field again, ~3 us) only for a value that is not already the options' own.
        changed = {k: v for k, v in fields.items() if getattr(options, k) is not v}
        if changed:
            options = attrs.evolve(options, **changed)
    timeout = options.timeout
    request = InferRequest(
        model_name=model_name,
        model_version=options.model_version,
        inputs=inputs,
        requested_outputs=options.outputs,
        request_id=options.request_id,
        parameters=dict(options.parameters),  # the request's own: models may not share it
        priority=options.priority,
        timeout=float(timeout) if timeout is not None else None,
        sequence_id=options.sequence_id,
        sequence_start=options.sequence_start,
        sequence_end=options.sequence_end,
    )
    return request, options
