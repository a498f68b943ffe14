"""What a failed request tells its client: Triton's HTTP status and gRPC status code for each
error, and the message shown.

How this works: every orchestrion error maps to one HTTP status the way Triton's do (404 for an
unknown model, 400 for a bad request, 503 when busy or closing, 500 when the pipeline failed);
the gRPC code is derived from that status, so the two front ends never disagree. Errors that
are not orchestrion's own are shown as unexpected, with their type.
"""

from __future__ import annotations

from ._errors import (
    ConfigError,
    InferenceTimeoutError,
    InvalidRequestError,
    JsonFieldError,
    ModelControlError,
    ModelLoadError,
    ModelNotFoundError,
    ModelReportedError,
    OrchestrionError,
    QueueFullError,
    RegionNotFoundError,
    ServerClosedError,
    StepRefusedError,
    UnsupportedError,
)


def http_status(error: BaseException) -> int:
    """Triton's HTTP status for an error: 404 unknown model, 400 bad request (also a step's
    request that its composing model refused, as Triton passes its status on), 503 busy or
    closing, 500 the pipeline failed, 501 not offered; a model's own error by its code."""
    if isinstance(error, ModelReportedError):
        return _HTTP_OF_CODE.get(error.code, 400)
    if isinstance(error, ModelNotFoundError | RegionNotFoundError):
        return 404
    if isinstance(error, UnsupportedError):
        return 501
    if isinstance(error, JsonFieldError):
        return 500
    if isinstance(error, InvalidRequestError | ConfigError | ModelLoadError | StepRefusedError):
        return 400
    if isinstance(
        error, QueueFullError | ServerClosedError | InferenceTimeoutError | ModelControlError
    ):
        return 503
    return 500


_HTTP_OF_CODE = {"INTERNAL": 500, "NOT_FOUND": 404, "UNAVAILABLE": 503, "UNSUPPORTED": 501}
"""The HTTP status of a Triton error code; every other code is a 400, as in Triton's
``HttpCodeFromError``."""

_GRPC_OF_CODE = {
    "UNKNOWN": "UNKNOWN",
    "INTERNAL": "INTERNAL",
    "NOT_FOUND": "NOT_FOUND",
    "INVALID_ARG": "INVALID_ARGUMENT",
    "UNAVAILABLE": "UNAVAILABLE",
    "UNSUPPORTED": "UNIMPLEMENTED",
    "ALREADY_EXISTS": "ALREADY_EXISTS",
    "CANCELLED": "CANCELLED",
}
"""The gRPC status code of a Triton error code (Triton's ``GrpcStatusUtil::CodeToStatus``)."""


def grpc_status(error: BaseException) -> str:
    """The gRPC status code name (``grpc.StatusCode`` member) Triton uses for an error."""
    if isinstance(error, ModelReportedError):
        return _GRPC_OF_CODE[error.code]
    return {
        404: "NOT_FOUND",
        400: "INVALID_ARGUMENT",
        503: "UNAVAILABLE",
        500: "INTERNAL",
        501: "UNIMPLEMENTED",
    }[http_status(error)]


def error_message(error: BaseException) -> str:
    """What the client is shown: our own errors as written, anything else as unexpected."""
    if isinstance(error, OrchestrionError):
        return str(error)
    return f"internal error: {type(error).__name__}: {error}"
