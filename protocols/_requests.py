"""Building an `InferRequest` from a model name, inputs and `RequestOptions`.

Every way in builds the options (``_request_options.py``, which checks each field):
``AsyncServer.infer`` and ``stream_infer`` (from their keyword arguments, or an options object
the caller made), the blocking ``Server``, and the HTTP and gRPC decoders. `new_request` then
checks the model name and inputs and makes the `InferRequest` that travels through the
actors, holding the options.

The embedding API is called by people in notebooks: a dict where a list was meant, a string
where a list of names was meant, seconds given as a string. Each such mistake gets an
`InvalidRequestError` that says which argument and what was expected, rather than a
``TypeError`` from deep inside.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import attrs

from ._messages import InferRequest
from ._request_options import DEFAULT_OPTIONS, RequestOptions, _bad

_FIELDS = frozenset(field.name for field in attrs.fields(RequestOptions))


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
        options = RequestOptions(**fields) if fields else DEFAULT_OPTIONS
    elif not isinstance(options, RequestOptions):
        raise _bad("options", "a RequestOptions", options)
    else:
        # A front end passes its traceparent, None most often: evolve (which checks every
        # field again, ~3 us) only for a value that is not already the options' own.
        changed = {k: v for k, v in fields.items() if getattr(options, k) is not v}
        if changed:
            options = attrs.evolve(options, **changed)
    request = InferRequest(
        model_name=model_name,
        model_version=options.model_version,
        inputs=inputs,
        requested_outputs=options.outputs,
        options=options,
    )
    return request, options
