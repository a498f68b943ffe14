"""The exception hierarchy of orchestrion.

Every error raised on purpose derives from `OrchestrionError`. Each class says whose fault
it is, so that a front end can map it to a status code (a caller's mistake is a 4xx, ours is
a 5xx) and so that callers can catch the builtin they already expect (`ValueError`,
`LookupError`, `TimeoutError`).

`leaf_errors` and `ungrouped` are the one place that looks inside exception groups (what trio's
nurseries wrap errors in), so that an error can leave a nursery as itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from types import TracebackType
from typing import Generic, TypeVar

_T = TypeVar("_T")


class OrchestrionError(Exception):
    """Root of every error orchestrion raises on purpose."""


class ConfigError(OrchestrionError, ValueError):
    """A model repository, a ``config.pbtxt`` or a Python model definition is wrong.

    The operator's fault. ``errors`` lists every problem found (validation reports them all at
    once); the message joins them, each naming the file and field, or the ensemble, step and
    tensor concerned.
    """

    def __init__(self, errors: str | Sequence[str]) -> None:
        self.errors: tuple[str, ...] = (errors,) if isinstance(errors, str) else tuple(errors)
        super().__init__("\n".join(self.errors))


class ModelLoadError(OrchestrionError, RuntimeError):
    """A model's code failed while loading (import, ``initialize`` or compilation).

    The fault of the model's author; the message names the file and keeps the original error.
    """


class InvalidRequestError(OrchestrionError, ValueError):
    """A request is malformed: missing, unexpected or wrongly typed or shaped inputs.

    The caller's fault. Nothing ran.
    """


class ModelNotFoundError(InvalidRequestError, LookupError):
    """The request names a model or version that is not loaded.

    The caller's fault (or an operator who has not loaded the model yet).
    """


class JsonFieldError(InvalidRequestError):
    """A request's JSON field of the wrong kind, said in Triton's words and answered as Triton
    answers its JSON reader's errors: HTTP 500 (clients match on both).

    The caller's fault all the same.
    """


class RegionNotFoundError(InvalidRequestError, LookupError):
    """A request names a shared memory region that is not registered (HTTP 404, NOT_FOUND).

    The caller's fault.
    """


class UnsupportedError(OrchestrionError):
    """The server does not offer what the request asks for: an extension turned off or one
    this machine cannot give (HTTP 501, gRPC UNIMPLEMENTED).
    """


class InferenceError(OrchestrionError, RuntimeError):
    """Running a model or an ensemble failed.

    Our fault or the model's: the message names the model (and, in an ensemble, the step's
    model) and keeps the original error's message; the original is the ``__cause__``.
    """

    def __init__(self, message: str, *, model_name: str) -> None:
        super().__init__(message)
        self.model_name = model_name


class StepRefusedError(InferenceError):
    """An ensemble step's composing model refused the step's request as invalid: a required
    input that an earlier step left out of its answer, or a tensor whose data type or shape
    does not fit. Nothing of that step ran.

    The fault of the ensemble's models or wiring, seen in the client's request: the front
    ends answer it as Triton does, with the composing request's INVALID_ARG (HTTP 400).
    """


ERROR_CODES = (
    "UNKNOWN",
    "INTERNAL",
    "NOT_FOUND",
    "INVALID_ARG",
    "UNAVAILABLE",
    "UNSUPPORTED",
    "ALREADY_EXISTS",
    "CANCELLED",
)
"""Triton's error codes (``TRITONSERVER_Error_Code``), by name, in their numeric order."""


class ModelReportedError(InferenceError):
    """The error a model answered a request with, under one of Triton's error codes (a
    python-backend model's ``InferenceResponse(error=pb_utils.TritonError(msg, code))``).

    The model's own words: the client is shown the message as the model wrote it, with the
    code's HTTP status and gRPC status code (as Triton shows it).
    """

    def __init__(self, message: str, *, model_name: str, code: str = "INTERNAL") -> None:
        super().__init__(message, model_name=model_name)
        if code not in ERROR_CODES:
            raise ValueError(f"unknown error code {code!r}: one of {', '.join(ERROR_CODES)}")
        self.code = code


class InferenceTimeoutError(OrchestrionError, TimeoutError):
    """A request did not finish within its ``timeout``.

    Nobody's fault in particular: the work was cancelled and its slots released.
    """


class ServerClosedError(OrchestrionError, RuntimeError):
    """The server (or the model) is shutting down and accepts no new requests.

    The caller's fault for using a server after leaving its ``async with`` block.
    """


class CacheUnavailableError(OrchestrionError, ConnectionError):
    """The response cache's backend cannot be used (Redis unreachable, credentials refused).

    The operator's fault or the network's. At start-up it stops the server; at run time the
    cache actor catches it, logs it once per outage and serves requests uncached.
    """


class CacheWriteRefusedError(OrchestrionError, RuntimeError):
    """The cache's backend answered, but refused to store ``refused`` of the entries given
    to ``ResponseCache.insert`` (a Redis at its ``maxmemory`` with the policy noeviction, a
    read-only replica, an ACL that forbids writes).

    The operator's to fix (more memory, an eviction policy, a TTL). It is not an outage: the
    cache actor keeps looking entries up, counts the refused ones as not stored and logs one
    warning when the refusals begin.
    """

    def __init__(self, message: str, *, refused: int) -> None:
        super().__init__(message)
        self.refused = refused


class QueueFullError(OrchestrionError, RuntimeError):
    """A model's queue is full (``dynamic_batching`` ``max_queue_size``): the request was
    refused without running, to shed load.

    Nobody's fault in particular: retry later, or raise the limit.
    """


class QueueTimeoutError(InferenceTimeoutError):
    """A request waited in a model's queue past its ``dynamic_batching`` queue policy's
    ``default_timeout_microseconds`` (``timeout_action: REJECT``) and was refused unrun.

    Load: the model cannot keep up. Counted as a REJECTED failure, as in Triton.
    """


class LoadRequestError(OrchestrionError, ValueError):
    """A load request could not be carried out before any model code ran: the model's
    folder is missing or its config is wrong, or the request's ``config`` override or
    ``file:`` parameters are wrong or refused. Nothing changed: what was serving serves on.

    The caller's fault or the repository's. The message is Triton's ("failed to load
    '<model>', failed to poll from model repository") followed by the reason, and the front
    ends answer it as Triton does: HTTP 500, gRPC INTERNAL.
    """

    def __init__(self, model: str, reason: str) -> None:
        super().__init__(
            f"failed to load '{model}', failed to poll from model repository: {reason}"
        )
        self.model = model
        self.reason = reason


class ModelControlError(OrchestrionError, RuntimeError):
    """The server's model control mode does not allow this load or unload.

    The operator's choice (``--model-control-mode``), not a fault in the request or the model.
    """


def leaf_errors(error: BaseException) -> list[BaseException]:
    """The exceptions in ``error``: ``[error]`` when it is no exception group, else those of
    its (nested) groups, depth first. One leaf means nurseries wrapped a single error.

    The one place that looks inside exception groups: `ungrouped` lets a single error leave a
    nursery as itself, `os_error_in` finds a bind error, and a caller that merges several
    errors (the loader's ConfigErrors, say) reads them all from here.
    """
    if not isinstance(error, BaseExceptionGroup):
        return [error]
    return [leaf for inner in error.exceptions for leaf in leaf_errors(inner)]


def os_error_in(error: BaseException) -> OSError | None:
    """The first OSError of `leaf_errors`, if any: what a server that failed to bind its
    address raised inside its nurseries."""
    return next((e for e in leaf_errors(error) if isinstance(e, OSError)), None)


class _Ungrouped(Generic[_T]):
    """`ungrouped`'s context manager."""

    def __init__(self, manager: AbstractAsyncContextManager[_T]) -> None:
        self._manager = manager

    async def __aenter__(self) -> _T:
        return await self._manager.__aenter__()

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> bool | None:
        try:
            return await self._manager.__aexit__(kind, error, traceback)
        except BaseExceptionGroup as group:
            leaves = leaf_errors(group)
            if len(leaves) != 1:
                raise
        # It leaves as if no nursery had held it: raised here, not in the except clause, so
        # the group does not become its context, and with the context it had (raising it
        # while the block's cancellation is handled would make that its context).
        sole = leaves[0]
        context, suppressed = sole.__context__, sole.__suppress_context__
        try:
            raise sole
        finally:
            sole.__context__, sole.__suppress_context__ = context, suppressed


def ungrouped(manager: AbstractAsyncContextManager[_T]) -> AbstractAsyncContextManager[_T]:
    """``manager`` (a trio nursery, typically), except that an error leaving it alone in an
    exception group, or in nested groups of one, leaves as itself; several stay grouped.

    ``async with ungrouped(trio.open_nursery()) as nursery:`` is the nursery of a function
    or context manager whose callers should see its errors and their own as themselves: a
    start-up error raised in the block (a port that cannot be bound), the caller's error
    thrown in at a ``yield``, the one task that failed. A cancellation stays a
    cancellation. (Pure: it imports nothing from trio, and wraps any async context manager.)
    """
    return _Ungrouped(manager)
