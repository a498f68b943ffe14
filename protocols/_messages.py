"""Request and response messages, as they travel between the API, ensembles and models.

Tensors are numpy arrays keyed by name; equality and reprs skip them so that comparing or
logging a message never walks an array.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeAlias

import attrs
import numpy as np

from ._request_options import DEFAULT_OPTIONS, ParameterValue, RequestOptions

Tensors: TypeAlias = Mapping[str, np.ndarray[Any, Any]]


_SAME: object = object()
"""`InferRequest.derive`'s default: keep the tracing context."""


class Cancellation:
    """A request's cancellation, asked for while its caller goes on reading its responses
    (Triton's ``ResponseIterator.cancel()`` of a BLS call): the model sees it through
    ``request.is_cancelled()`` and ends the stream when it chooses (a model that ignores it
    goes on). Set from any thread."""

    __slots__ = ("requested",)

    def __init__(self) -> None:
        self.requested = False

    def cancel(self) -> None:
        """Ask for the request's cancellation."""
        self.requested = True


@attrs.frozen(kw_only=True)
class InferRequest:
    """One inference request for one model (or ensemble).

    Everything except the tensors is metadata that an ensemble forwards, unchanged, to the
    requests it makes of its composing models.
    """

    model_name: str
    model_version: int = -1
    """-1 (or 0) asks for the latest loaded version."""
    inputs: Tensors = attrs.field(factory=dict, eq=False, repr=False)
    requested_outputs: frozenset[str] | None = None
    """Names of the outputs wanted; None for all of them."""
    options: RequestOptions = DEFAULT_OPTIONS
    """How the client asked to run it: request id, parameters, sequence, priority, timeout
    (its ``model_version`` and ``outputs`` are the client's request's; an ensemble's
    requests of its composing models carry the same options, with their own model,
    version and outputs above)."""
    trace: object | None = attrs.field(default=None, eq=False, repr=False)
    """The tracing context the request's spans are children of (opaque here: an
    OpenTelemetry ``Context`` when the server traces). Travels with the message, so
    long-lived actors never rely on task-local context."""
    cancellation: Cancellation | None = attrs.field(default=None, eq=False, repr=False)
    """Where a caller that keeps reading asks for the request's cancellation (None: it
    cancels by leaving)."""

    # What a model that takes the ``request`` reads (the runtime reads ``options``).

    @property
    def request_id(self) -> str:
        """The client's request id ("": none)."""
        return self.options.request_id

    @property
    def parameters(self) -> Mapping[str, ParameterValue]:
        """The client's request parameters (read-only)."""
        return self.options.parameters

    @property
    def priority(self) -> int:
        """The request's priority (0: the model's default)."""
        return self.options.priority

    @property
    def timeout(self) -> float | None:
        """Seconds the whole request may take (None: no limit)."""
        return self.options.timeout

    @property
    def sequence_id(self) -> int | str:
        """The sequence the request belongs to (0 or "": none)."""
        return self.options.sequence_id

    @property
    def sequence_start(self) -> bool:
        """The request starts its sequence."""
        return self.options.sequence_start

    @property
    def sequence_end(self) -> bool:
        """The request ends its sequence."""
        return self.options.sequence_end

    def sequence_parameters(self) -> dict[str, ParameterValue]:
        """The response parameters that say which sequence this request belongs to (empty
        for a request outside a sequence): what a response to it echoes, whoever computed
        the outputs (a cache hit included)."""
        options = self.options
        if options.sequence_id in (0, ""):
            return {}
        return {
            "sequence_id": options.sequence_id,
            "sequence_start": options.sequence_start,
            "sequence_end": options.sequence_end,
        }

    def with_trace(self, trace: object | None) -> InferRequest:
        """This request with another tracing context (the span that now covers it)."""
        return self.derive(
            model_name=self.model_name,
            model_version=self.model_version,
            inputs=self.inputs,
            requested_outputs=self.requested_outputs,
            trace=trace,
        )

    def derive(
        self,
        *,
        model_name: str,
        model_version: int,
        inputs: Tensors,
        requested_outputs: frozenset[str] | None,
        trace: object | None = _SAME,
    ) -> InferRequest:
        """A request for another model that carries this request's metadata unchanged.

        This is how an ensemble forwards its options (request id, parameters, priority,
        timeout, sequence flags) and tracing context to its composing models (cheaper than
        `attrs.evolve` on a hot path). ``trace`` replaces the tracing context when given.
        """
        return InferRequest(
            model_name=model_name,
            model_version=model_version,
            inputs=inputs,
            requested_outputs=requested_outputs,
            options=self.options,
            trace=self.trace if trace is _SAME else trace,
            cancellation=self.cancellation,
        )


class ParameterizedOutputs(dict[str, Any]):
    """A model's outputs for one request together with the response parameters the model
    set (a python-backend model's ``InferenceResponse(..., parameters={...})``) and whether
    it sent them with its final flag (a decoupled model's last response carrying data): the
    runner puts both on the `InferResponse`. Plain outputs (any other mapping) set none. An
    ``error`` stands for an error response the model sent in place of outputs, where its
    reader takes error responses as they come (see `InferResponse.error`)."""

    __slots__ = ("error", "final", "parameters")

    def __init__(
        self,
        outputs: Mapping[str, Any],
        parameters: Mapping[str, ParameterValue],
        final: bool = False,
        error: Exception | None = None,
    ) -> None:
        super().__init__(outputs)
        self.parameters = parameters
        self.final = final
        self.error = error


def parameters_of(outputs: Tensors) -> Mapping[str, ParameterValue]:
    """The response parameters that came with ``outputs`` (see `ParameterizedOutputs`)."""
    return outputs.parameters if type(outputs) is ParameterizedOutputs else {}


def sent_final(outputs: Tensors) -> bool:
    """Whether ``outputs`` came with the model's final flag (see `ParameterizedOutputs`)."""
    return type(outputs) is ParameterizedOutputs and outputs.final


def error_of(outputs: Tensors) -> Exception | None:
    """The error response ``outputs`` stands for (see `ParameterizedOutputs`), if any."""
    return outputs.error if type(outputs) is ParameterizedOutputs else None


def carried(raw: Tensors, outputs: Tensors) -> Tensors:
    """``outputs`` (made from ``raw``) with the parameters and final flag ``raw`` came with."""
    if type(raw) is not ParameterizedOutputs or (
        not raw.parameters and not raw.final and raw.error is None
    ):
        return outputs
    return ParameterizedOutputs(outputs, raw.parameters, raw.final, raw.error)


def _summary(tensors: Tensors) -> str:
    """Names, shapes and dtypes of tensors, never their values."""
    return "{" + ", ".join(f"{k!r}: {v.dtype}{list(v.shape)}" for k, v in tensors.items()) + "}"


@attrs.frozen(kw_only=True)
class InferResponse:
    """The answer to an `InferRequest`: output tensors and response parameters (or, for a
    decoupled model's error response on a gRPC stream, its `error`)."""

    model_name: str
    model_version: int
    request_id: str = ""
    outputs: Tensors = attrs.field(factory=dict, eq=False, repr=_summary)
    parameters: Mapping[str, ParameterValue] = attrs.field(factory=dict)
    final: bool = False
    """A decoupled model sent this response with its final flag: the last of its stream
    (a stream whose final flag came alone ends without such a response)."""
    error: Exception | None = None
    """An error response of a decoupled python-backend model, on the request a gRPC stream
    reads (the stream goes on after it, as Triton's do, unless it came with the final flag):
    its outputs are empty. Elsewhere an error response is raised, and ends the stream."""
