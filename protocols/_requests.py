"""Building an `InferRequest` from the arguments of ``infer``, checking each one.

The embedding API is called by people in notebooks: a dict where a list was meant, a string
where a list of names was meant, seconds given as a string. Each such mistake gets an
`InvalidRequestError` that says which argument and what was expected, rather than a
``TypeError`` from deep inside.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from numbers import Real
from typing import Any

from ._errors import InvalidRequestError
from ._messages import InferRequest, ParameterValue


def _bad(argument: str, expected: str, got: object) -> InvalidRequestError:
    return InvalidRequestError(f"{argument} must be {expected}, got {got!r:.80}")


def new_request(
    model_name: str,
    inputs: Mapping[str, Any],
    *,
    model_version: int = -1,
    outputs: Sequence[str] | None = None,
    request_id: str | None = None,
    parameters: Mapping[str, ParameterValue] | None = None,
    sequence_id: int | str = 0,
    sequence_start: bool = False,
    sequence_end: bool = False,
    priority: int = 0,
    timeout: float | None = None,
) -> InferRequest:
    """Check the arguments of ``infer`` and build the request.

    ``outputs`` empty or None asks for every output (as in Triton).

    Raises:
        InvalidRequestError: an argument of the wrong kind, naming it.
    """
    if not isinstance(model_name, str) or not model_name:
        raise _bad("model_name", "a non-empty string", model_name)
    if not isinstance(inputs, Mapping):
        raise _bad("inputs", "a mapping of input names to arrays", inputs)
    if not all(isinstance(k, str) for k in inputs):
        raise _bad("inputs", "keyed by input names (strings)", list(inputs))
    if isinstance(model_version, bool) or not isinstance(model_version, int):
        raise _bad("model_version", "an integer (-1 for the latest)", model_version)
    requested = None
    if outputs is not None:
        if isinstance(outputs, str | bytes) or not all(isinstance(o, str) for o in outputs):
            raise _bad("outputs", "a list of output names", outputs)
        requested = frozenset(outputs) or None
    if request_id is not None and not isinstance(request_id, str):
        raise _bad("request_id", "a string", request_id)
    params = dict(parameters or {})
    for key, value in params.items():
        if not isinstance(key, str) or not isinstance(value, str | int | float | bool):
            raise _bad(f"parameters[{key!r}]", "a str, int, float or bool", value)
    if isinstance(sequence_id, bool) or not isinstance(sequence_id, int | str):
        raise _bad("sequence_id", "an integer or a string", sequence_id)
    if isinstance(priority, bool) or not isinstance(priority, int) or priority < 0:
        raise _bad("priority", "a non-negative integer", priority)
    if timeout is not None and (
        isinstance(timeout, bool)
        or not isinstance(timeout, Real)
        or math.isnan(timeout)
        or timeout <= 0
    ):
        raise _bad("timeout", "a positive number of seconds", timeout)
    return InferRequest(
        model_name=model_name,
        model_version=model_version,
        inputs=inputs,
        requested_outputs=requested,
        request_id=request_id or "",
        parameters=params,
        priority=priority,
        timeout=float(timeout) if timeout is not None else None,
        sequence_id=sequence_id,
        sequence_start=bool(sequence_start),
        sequence_end=bool(sequence_end),
    )
