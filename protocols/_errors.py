"""The exception hierarchy of orchestrion.

Every error raised on purpose derives from `OrchestrionError`. Each class says whose fault
it is, so that a front end can map it to a status code (a caller's mistake is a 4xx, ours is
a 5xx) and so that callers can catch the builtin they already expect (`ValueError`,
`LookupError`, `TimeoutError`).
"""

from __future__ import annotations

from collections.abc import Sequence


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


class InferenceError(OrchestrionError, RuntimeError):
    """Running a model or an ensemble failed.

    Our fault or the model's: the message names the model (and, in an ensemble, the step's
    model) and keeps the original error's message; the original is the ``__cause__``.
    """

    def __init__(self, message: str, *, model_name: str) -> None:
        super().__init__(message)
        self.model_name = model_name


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


class ModelControlError(OrchestrionError, RuntimeError):
    """The server's model control mode does not allow this load or unload.

    The operator's choice (``--model-control-mode``), not a fault in the request or the model.
    """


def os_error_in(error: BaseException) -> OSError | None:
    """The OSError in ``error`` or in a (nested) exception group, if any: what a server that
    failed to bind its address raised inside its nurseries."""
    if isinstance(error, OSError):
        return error
    if isinstance(error, BaseExceptionGroup):
        for inner in error.exceptions:
            found = os_error_in(inner)
            if found is not None:
                return found
    return None
