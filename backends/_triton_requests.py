"""Requests as a Triton python-backend model sees them (`InferenceRequest`, received by
``execute`` or built by the model to call another model), their response senders, and the
model-loading calls of ``pb_utils``.

How this works: a received request wraps the server's request (its inputs as read-only
arrays, its metadata as Triton's accessors give it) and the sender the backend made for it.
A request the model builds is turned into the server's request by `as_request` and run
through the current `Execution` (``_triton_calls.py``): `exec` waits for it in the model's
thread, `async_exec` awaits it on the model's asyncio loop.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import threading
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import attrs
import trio

from ..protocols import Cancellation, InferRequest, OrchestrionError, RequestOptions
from ._base import ServerCalls
from ._triton_api import (
    TRITONSERVER_REQUEST_FLAG_SEQUENCE_END,
    TRITONSERVER_REQUEST_FLAG_SEQUENCE_START,
    TRITONSERVER_REQUEST_RELEASE_ALL,
    TRITONSERVER_REQUEST_RELEASE_RESCHEDULE,
    TRITONSERVER_RESPONSE_COMPLETE_FINAL,
    InferenceResponse,
    Tensor,
    TritonModelException,
    _parameters_json,
    check_argument,
    check_sequence,
    tensor_array,
)
from ._triton_calls import (
    Execution,
    current_execution,
    error_response,
    in_trio_worker_thread,
    server_calls,
)

T = TypeVar("T")

Deliver = Callable[[InferenceResponse | None, bool], None]
"""Hands one response (None: none, only the final flag) and whether it is the last."""


class InferenceResponseSender:
    """Sends a request's responses (``request.get_response_sender()``): any number for a
    decoupled model, exactly one otherwise; the last carries
    ``TRITONSERVER_RESPONSE_COMPLETE_FINAL``."""

    def __init__(self, deliver: Deliver, cancelled: Callable[[], bool]) -> None:
        self._deliver = deliver
        self._cancelled = cancelled
        self._closed = False
        self._lock = threading.Lock()

    def send(self, response: InferenceResponse | None = None, flags: int = 0) -> None:
        """Send ``response``; with the final flag, the request is complete.

        Raises:
            TritonModelException: the final flag was sent already, or no response is given
                without the final flag.
        """
        final = bool(flags & TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        if response is None and not final:
            raise TritonModelException(
                "send() needs a response unless flags is TRITONSERVER_RESPONSE_COMPLETE_FINAL"
            )
        if response is not None and not isinstance(response, InferenceResponse):
            raise TritonModelException(
                f"send() takes a pb_utils.InferenceResponse, got {type(response).__name__}"
            )
        with self._lock:
            if self._closed:
                raise TritonModelException(  # Triton's words
                    "Unable to send response. Response sender has been closed."
                )
            self._closed = final
        try:
            self._deliver(response, final)
        except Exception:
            self._closed = False  # refused: the sender stays as it was
            raise

    def is_cancelled(self) -> bool:
        """Whether the request was cancelled (its client went away or timed out)."""
        return self._cancelled()

    @property
    def closed(self) -> bool:
        """Whether the final flag was sent."""
        return self._closed


class InferenceRequest:
    """A request: one a model's ``execute`` receives, or one its code builds to call
    another model (BLS) with `exec` or `async_exec`."""

    def __init__(
        self,
        model_name: str | bytes = "",
        inputs: Sequence[Tensor] = (),
        requested_output_names: Sequence[str | bytes] = (),
        request_id: str = "",
        correlation_id: int | str = 0,
        model_version: int = -1,
        flags: int = 0,
        timeout: int = 0,
        preferred_memory: Any = None,
        trace: Any = None,
        parameters: Mapping[str, Any] | str | None = None,
    ) -> None:
        if isinstance(model_name, bytes):
            model_name = model_name.decode()
        _check_arguments(
            model_name,
            inputs,
            requested_output_names,
            request_id,
            correlation_id,
            integers={"model_version": model_version, "flags": flags, "timeout": timeout},
        )
        self._model_name = model_name
        self._inputs = list(inputs)
        for tensor in self._inputs:
            if not isinstance(tensor, Tensor):
                raise TritonModelException(
                    f"InferenceRequest inputs are pb_utils.Tensor objects, got "
                    f"{type(tensor).__name__}"
                )
        self._outputs = [
            name.decode() if isinstance(name, bytes) else name for name in requested_output_names
        ]
        self._request_id = str(request_id)
        self._correlation_id = correlation_id
        self._model_version = int(model_version)
        self._flags = int(flags)
        self._timeout = int(timeout)
        self._parameters: str | Mapping[str, Any] = _parameters_json(parameters)
        self._sender: InferenceResponseSender | None = None
        self._cancelled: Callable[[], bool] = _never
        self._cancellation: Cancellation | None = None
        self._release_flags = TRITONSERVER_REQUEST_RELEASE_ALL

    @classmethod
    def received(
        cls,
        request: InferRequest,
        inputs: Mapping[str, Any],
        outputs: Sequence[str],
        sender: InferenceResponseSender,
        cancelled: Callable[[], bool],
    ) -> InferenceRequest:
        """A request as the model's ``execute`` receives it (made per request: its fields
        are set directly, the server having checked them already)."""
        made = cls.__new__(cls)
        made._model_name = request.model_name
        made._inputs = [Tensor.of(name, value) for name, value in inputs.items()]
        made._outputs = list(outputs)
        made._request_id = request.options.request_id
        made._correlation_id = request.options.sequence_id
        made._model_version = request.model_version
        made._flags = (
            TRITONSERVER_REQUEST_FLAG_SEQUENCE_START if request.options.sequence_start else 0
        ) | (TRITONSERVER_REQUEST_FLAG_SEQUENCE_END if request.options.sequence_end else 0)
        made._timeout = int(request.options.timeout * 1e6) if request.options.timeout else 0
        made._parameters = request.options.parameters  # made JSON text when the model asks
        made._sender = sender
        made._cancelled = cancelled
        made._cancellation = request.cancellation
        made._release_flags = TRITONSERVER_REQUEST_RELEASE_ALL
        return made

    def inputs(self) -> list[Tensor]:
        """The request's input tensors."""
        return list(self._inputs)

    def requested_output_names(self) -> list[str]:
        """The outputs the client asked for (every output when it named none)."""
        return list(self._outputs)

    def request_id(self) -> str:
        """The client's request id ("" when none)."""
        return self._request_id

    def correlation_id(self) -> int | str:
        """The sequence's correlation id (0 outside a sequence)."""
        return self._correlation_id

    def flags(self) -> int:
        """``TRITONSERVER_REQUEST_FLAG_SEQUENCE_START`` / ``_END``, or'ed."""
        return self._flags

    def model_name(self) -> str:
        """The name of the model the request is for."""
        return self._model_name

    def model_version(self) -> int:
        """The requested version (-1: the latest)."""
        return self._model_version

    def timeout(self) -> int:
        """The request's timeout in microseconds (0: none)."""
        return self._timeout

    def parameters(self) -> str:
        """The request's parameters, as a JSON object's text."""
        if not isinstance(self._parameters, str):
            self._parameters = json.dumps(dict(self._parameters))
        return self._parameters

    def is_cancelled(self) -> bool:
        """Whether the client went away, the request timed out, or a BLS caller cancelled
        it (``ResponseIterator.cancel()``)."""
        asked = self._cancellation
        return (asked is not None and asked.requested) or self._cancelled()

    def get_response_sender(self) -> InferenceResponseSender:
        """The sender of this request's responses (a request ``execute`` received).

        Raises:
            TritonModelException: a request the model built itself has no sender.
        """
        if self._sender is None:
            raise TritonModelException("only a request that execute received has a sender")
        return self._sender

    def set_release_flags(self, flags: int) -> None:
        """How the request is released when ``execute`` returns:
        ``TRITONSERVER_REQUEST_RELEASE_RESCHEDULE`` runs it again in a later ``execute``
        (a model with ``sequence_batching { iterative_sequence: true }``)."""
        self._release_flags = int(flags)

    def release_flags(self) -> int:
        """The flags `set_release_flags` gave (``TRITONSERVER_REQUEST_RELEASE_ALL``)."""
        return self._release_flags

    @property
    def rescheduled(self) -> bool:
        """Whether the model asked to run the request again."""
        return bool(self._release_flags & TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)

    def release(self) -> None:
        """Before an execution: released as a whole unless the model says otherwise."""
        self._release_flags = TRITONSERVER_REQUEST_RELEASE_ALL

    def as_request(self, parent: InferRequest | None) -> InferRequest:
        """This request as the server runs it (a BLS call)."""
        return InferRequest(
            model_name=self._model_name,
            model_version=self._model_version,
            inputs={t.name(): tensor_array(t) for t in self._inputs},
            requested_outputs=frozenset(self._outputs) if self._outputs else None,
            options=RequestOptions(
                request_id=self._request_id,
                parameters=json.loads(self.parameters()),
                sequence_id=self._correlation_id,
                sequence_start=bool(self._flags & TRITONSERVER_REQUEST_FLAG_SEQUENCE_START),
                sequence_end=bool(self._flags & TRITONSERVER_REQUEST_FLAG_SEQUENCE_END),
            ),
            trace=parent.trace if parent is not None else None,
        )

    def exec(self, decoupled: bool = False) -> Any:
        """Run this request on a loaded model and wait for its response (with
        ``decoupled=True``: an iterator of a decoupled model's responses). A failure is
        the response's ``error()``, as in Triton.

        Raises:
            TritonModelException: called outside a model's ``execute``.
        """
        execution = current_execution("InferenceRequest.exec")
        try:
            if decoupled:
                return execution.to_trio(execution.open_stream, self)
            return execution.to_trio(execution.infer, self)
        except trio.Cancelled as exc:  # the request being executed was cancelled
            if decoupled:
                return iter([error_response(exc)])
            return error_response(exc)

    def async_exec(self, decoupled: bool = False) -> Awaitable[Any]:
        """`exec` for an ``async def execute``: an awaitable of the response (or, with
        ``decoupled=True``, of the iterator of responses, once the first has come, as
        Triton's).

        Raises:
            TritonModelException: called outside a model's ``execute``.
        """
        execution = current_execution("InferenceRequest.async_exec")

        async def call() -> Any:
            if decoupled:
                return await execution.bridge.call(execution.open_stream_answered, self)
            return await execution.bridge.call(execution.infer, self)

        return call()


def _check_arguments(
    model_name: object,
    inputs: object,
    requested_output_names: Any,
    request_id: object,
    correlation_id: object,
    *,
    integers: Mapping[str, object],
) -> None:
    """The argument types Triton's ``InferenceRequest`` takes (its pybind11 checks);
    ``integers``: the arguments that must be integers, by name.

    Raises:
        TypeError: one is of another type (named).
    """
    call = "InferenceRequest"
    check_argument(call, "model_name", model_name, str, "a string")
    check_sequence(call, "inputs", inputs)
    check_sequence(call, "requested_output_names", requested_output_names)
    for name in requested_output_names:  # a list or a tuple, checked just above
        check_argument(call, "requested_output_names", name, (str, bytes), "a list of strings")
    check_argument(call, "request_id", request_id, str, "a string")
    check_argument(call, "correlation_id", correlation_id, (int, str), "an integer or a string")
    for name, value in integers.items():
        check_argument(call, name, value, int, "an integer")


def _never() -> bool:
    return False


@attrs.frozen
class ModelSetup:
    """A model's ``initialize`` running (in a worker thread, while the model loads): it may
    use Triton's model loading API (`load_model`, `unload_model`, `is_model_ready`), as
    Triton's QA model ``bls_model_loading`` does, though not BLS inference."""

    model_name: str
    calls: ServerCalls | None

    def to_trio(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``await fn(*args)`` in trio and wait for it (from the load's worker thread).

        Raises:
            TritonModelException: called from another thread (one the model started).
        """
        if not in_trio_worker_thread():
            raise TritonModelException(
                f"model '{self.model_name}': the model loading API is available to "
                "initialize in its own thread only"
            )
        return trio.from_thread.run(fn, *args)

    def _server(self, call: str) -> ServerCalls:
        return server_calls(self.calls, self.model_name, call)


_SETUP: contextvars.ContextVar[ModelSetup] = contextvars.ContextVar("orchestrion_model_setup")


@contextlib.contextmanager
def setting_up(setup: ModelSetup) -> Iterator[None]:
    """While a model's ``initialize`` runs: its model control calls go through ``setup``."""
    token = _SETUP.set(setup)
    try:
        yield
    finally:
        _SETUP.reset(token)


def _control(call: str) -> Execution | ModelSetup:
    """What a model's call of the model loading API runs through: the execution whose
    code runs, or the ``initialize`` running.

    Raises:
        TritonModelException: neither (``call`` named).
    """
    try:
        return _SETUP.get()
    except LookupError:
        return current_execution(call)


def is_model_ready(model_name: str, model_version: str = "") -> bool:
    """Whether ``model_name`` (at ``model_version``; "": any) is loaded and serving.

    Raises:
        TritonModelException: called outside a model's ``initialize`` and ``execute``.
    """
    calls = _control("is_model_ready")._server("is_model_ready")
    return calls.is_ready(str(model_name), int(model_version) if model_version else -1)


def _controlled(call: str, fn: Callable[..., Awaitable[None]], *args: Any) -> None:
    """Run a model control call of the server from the model's code, and wait for it."""
    try:
        _control(call).to_trio(fn, *args)
    except OrchestrionError as exc:  # refused, or the load failed: the model's to handle
        raise TritonModelException(f"{call}: {exc}") from exc


def load_model(model_name: str, config: str = "", files: Mapping[str, bytes] | None = None) -> None:
    """Load (or reload) ``model_name`` from a model's code, as Triton's: with ``config``
    (a model config's JSON text) and ``files`` (``{"file:1/model.onnx": bytes}``) instead of
    the repository's where given. As in Triton, only a server in explicit model control
    mode (``orchestrion serve --model-control-mode=explicit``) allows it.

    Raises:
        TritonModelException: refused, or the load failed (the reason given).
    """
    calls = _control("load_model")._server("load_model")
    _controlled("load_model", calls.load_model, str(model_name), config, files)


def unload_model(model_name: str, unload_dependents: bool = False) -> None:
    """Unload ``model_name`` from a model's code, as Triton's (explicit mode only).

    Raises:
        TritonModelException: refused, or the unload failed (the reason given).
    """
    calls = _control("unload_model")._server("unload_model")
    _controlled("unload_model", calls.unload_model, str(model_name), bool(unload_dependents))
