"""How a Triton python-backend model's answers reach the runtime: the responses ``execute``
returns, the ones it sends through a request's sender, and a decoupled request's stream.

How this works: an answer's outputs are taken in the data types the config declares where
the values convert exactly, in the shapes the model gave (`Declared.outputs_of`); an error
response is the model's own error with its code (`reported`), and the parameters of a
response travel with its outputs. A request of a model that is not decoupled and
answers through its sender has an `Answer` waiting for that one response. A decoupled
request is a `PushedStream`: its execution runs in a task of the backend's nursery while the
model's code, from any thread, pushes responses through the sender into a channel of no
capacity that the stream's reader takes them from one at a time, so a reader that stops
reading stops the senders (backpressure, nothing buffered).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np
import trio

from ..protocols import (
    ERROR_CODES,
    InferRequest,
    ModelConfig,
    ModelReportedError,
    ParameterizedOutputs,
    ServerClosedError,
    parameters_of,
)
from ._base import LoadedInstance
from ._triton_api import InferenceResponse, TritonError, TritonModelException, tensor_array
from ._triton_calls import cancelled_here, in_trio_worker_thread
from ._triton_requests import InferenceRequest, InferenceResponseSender

if TYPE_CHECKING:
    from ._triton_python import TritonPythonBackend

_log = logging.getLogger("orchestrion")
_ANSWERS = threading.Lock()


def _as_declared(array: np.ndarray[Any, Any], dtype: np.dtype[Any] | None) -> Any:
    """An output in the config's data type when all its values convert exactly (Triton
    passes a python model's outputs on in whatever type they have: ``np.array([0])`` is
    INT64 for a TYPE_INT32 output); else as it is, for the output check to refuse."""
    if dtype is None or array.dtype == dtype or "O" in (array.dtype.kind, dtype.kind):
        return array
    if array.dtype.kind in "SU":
        return array
    converted = array.astype(dtype)
    floating = array.dtype.kind in "fc"
    if np.array_equal(converted.astype(array.dtype), array, equal_nan=floating):
        return converted
    return array


def reported(error: TritonError, model_name: str) -> ModelReportedError:
    """A response's ``TritonError`` as the error the client is shown: its message as the
    model wrote it, its code (an unknown number is Triton's UNKNOWN)."""
    code = error.code()
    name = ERROR_CODES[code] if 0 <= code < len(ERROR_CODES) else "UNKNOWN"
    return ModelReportedError(error.message(), model_name=model_name, code=name)


@attrs.frozen
class Declared:
    """What a python-backend model's config declares of its outputs, to take its answers
    as Triton passes them on: each output's numpy dtype (its state outputs' too)."""

    model_name: str
    dtypes: Mapping[str, np.dtype[Any]]

    @classmethod
    def of(cls, config: ModelConfig) -> Declared:
        """The outputs ``config`` declares (the config the model's code sees)."""
        return cls(
            model_name=config.name,
            dtypes={t.name: t.data_type.numpy_dtype for t in config.output},
        )

    def outputs_of(self, response: InferenceResponse) -> Mapping[str, Any] | Exception:
        """A response's outputs (in the declared types, see `_as_declared`; in the shapes
        the model gave, as Triton passes them on), or its error."""
        error = response.error()
        if error is not None:
            return reported(error, self.model_name)
        outputs = {}
        for tensor in response.output_tensors():
            name = tensor.name()
            outputs[name] = _as_declared(tensor_array(tensor), self.dtypes.get(name))
        parameters = response.parameter_values()
        return ParameterizedOutputs(outputs, parameters) if parameters else outputs


class Answer:
    """A request of a model that is not decoupled, answered through its sender: the one
    response, and the final flag as a thread's event and a trio event (sent from any
    thread; a synchronous execute's thread waits on the first, an async one's task on the
    second)."""

    def __init__(self, token: trio.lowlevel.TrioToken | None, declared: Declared) -> None:
        self.token = token
        self.declared = declared
        self.response: InferenceResponse | None = None
        self._done: threading.Event | None = None
        self.trio_done = trio.Event()

    @property
    def done(self) -> threading.Event:
        """Set by the final flag (made when first needed: most models return their
        responses and never use the sender)."""
        with _ANSWERS:
            if self._done is None:
                self._done = threading.Event()
            return self._done

    def deliver(self, response: InferenceResponse | None, final: bool) -> None:
        """A sender's response (from any thread). The first one sent is the request's
        answer, whatever ``execute`` does after (as Triton's: a client already has it).

        Raises:
            TritonModelException: a second response, or the final flag before a response
                (Triton's words).
        """
        if response is not None:
            if self.response is not None:
                raise TritonModelException(
                    "Unable to send response. Non-decoupled model cannot send more than one "
                    "response."
                )
            self.response = response
        elif final and self.response is None:
            raise TritonModelException(
                "Unable to send response. Non-decoupled model cannot send complete final "
                "before sending a response."
            )
        if final:
            self.done.set()
            if self.token is not None:
                with contextlib.suppress(trio.RunFinishedError):
                    self.token.run_sync_soon(self.trio_done.set)

    def wait(self) -> Mapping[str, Any] | Exception:
        """Wait (in a worker thread) for the final flag: the outcome; an error if the
        request is cancelled first."""
        while not self.done.wait(0.05):
            if cancelled_here():
                return TritonModelException("the request was cancelled before its response")
        return self.outcome()

    def outcome(self) -> Mapping[str, Any] | Exception:
        """The sent response's outputs (or its error)."""
        if self.response is None:
            return TritonModelException(  # Triton's words
                "Non-decoupled model cannot send complete final before sending a response"
            )
        return self.declared.outputs_of(self.response)


def never() -> bool:
    """A request's cancellation check where cancellation cannot be seen."""
    return False


class PushedStream:
    """One decoupled request: its execution runs in the backend's nursery, and its senders
    push responses through a channel of no capacity that `__anext__` reads."""

    def __init__(
        self, backend: TritonPythonBackend, instance: LoadedInstance, request: InferRequest
    ) -> None:
        self._backend = backend
        self._instance = instance
        self._request = request
        self._send, self._receive = trio.open_memory_channel[Any](0)
        self._scope = trio.CancelScope()
        self._done = trio.Event()
        self._started = False
        self._final = False
        self._reader_gone = False
        self._token = trio.lowlevel.current_trio_token()
        self._sender = InferenceResponseSender(self._deliver, self._is_cancelled)

    def __aiter__(self) -> PushedStream:
        return self

    async def __anext__(self) -> Mapping[str, Any]:
        if not self._started:
            self._started = True
            try:
                self._backend.spawn(self._produce)
            except ServerClosedError:
                self._done.set()
                raise
        try:
            item = await self._receive.receive()
        except trio.EndOfChannel:
            if self._final:
                raise StopAsyncIteration from None
            raise ServerClosedError(
                f"model '{self._backend.model.name}' is being unloaded"
            ) from None
        if isinstance(item, Exception):
            raise item
        return item  # type: ignore[no-any-return]

    async def aclose(self) -> None:
        """The reader is done: later sends are dropped. Before the final flag the execution
        is cancelled (its BLS calls with it) and waited for; after it, the execution ends
        on its own in the backend's nursery (whatever it raises then is logged)."""
        self._reader_gone = True
        self._receive.close()
        if self._final:
            return
        self._scope.cancel()
        if self._started:
            with trio.CancelScope(shield=True):
                await self._done.wait()

    def _is_cancelled(self) -> bool:
        asked = self._request.cancellation
        return self._reader_gone or (asked is not None and asked.requested)

    async def _produce(self) -> None:
        backend, request = self._backend, self._request
        try:
            with self._scope:
                received = backend._received(request, self._sender)
                if backend.batches is not None:  # one call of execute with others
                    failure = await backend.batches.execute(self._instance, received, request)
                    if failure is not None and not self._sender.closed:
                        await self._push(failure, True)
                    return
                while await self._iteration(received):  # rescheduled: once more
                    if not backend.config.iterative:
                        raise TritonModelException(
                            "request rescheduling needs 'sequence_batching { "
                            "iterative_sequence: true }' in the model's config"
                        )
                    if self._reader_gone:
                        break
        except Exception as exc:
            failure = backend._failed(self._instance, exc)  # logged, after a final flag too
            if not self._sender.closed:
                await self._push(failure, True)
        finally:
            self._done.set()

    async def _iteration(self, received: InferenceRequest) -> bool:
        """One ``execute`` of the request: whether the model rescheduled it. Between two
        iterations the instance's other streams take their turn (the lock is fair)."""
        backend, instance = self._backend, self._instance
        received.release()
        if backend.capabilities.is_async:
            # As Triton's: the executions of an instance share its asyncio loop, the
            # next starting while one waits (the stream window bounds how many).
            result = await backend.call_async(instance, [received], self._request)
        else:
            async with instance.params.lock:  # one execute at a time per instance
                result = await trio.to_thread.run_sync(
                    backend.call, instance, [received], self._request
                )
        if result is not None:
            raise TritonModelException(
                f"Python model '{instance.params.name}' is using the decoupled mode and the "
                "execute function must return None. (It sends its responses through each "
                "request's response sender.)"
            )
        return received.rescheduled

    def _deliver(self, response: InferenceResponse | None, final: bool) -> None:
        """A sender's response, from any thread: wait until the reader takes it."""
        item = None
        if response is not None:
            declared = self._backend.declared
            item = declared.outputs_of(response)
        try:
            if in_trio_worker_thread():
                trio.from_thread.run(self._push, item, final)
            else:
                trio.from_thread.run(self._push, item, final, trio_token=self._token)
        except (trio.Cancelled, trio.RunFinishedError):
            pass  # the request was cancelled or the server stopped: the response is dropped

    async def _push(self, item: Any, final: bool) -> None:
        if final and isinstance(item, Mapping):  # its stream's last response
            item = ParameterizedOutputs(item, parameters_of(item), final=True)
        try:
            if item is not None:
                await self._send.send(item)
            if final or isinstance(item, Exception):
                self._final = True
                await self._send.aclose()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the reader went away: dropped, as Triton drops a cancelled request's
