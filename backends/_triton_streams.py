"""A decoupled python-backend request's responses: a `PushedStream`. Its execution runs in a
task of the backend's nursery while the model's code, from any thread, pushes responses
through the request's sender into a channel of no capacity that the stream's reader takes
them from one at a time, so a reader that stops reading stops the senders (backpressure,
nothing buffered)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import trio

from ..protocols import (
    InferRequest,
    ParameterizedOutputs,
    ServerClosedError,
    error_of,
    parameters_of,
    sent_final,
)
from ._base import LoadedInstance
from ._response_order import RESPONSE_ORDER
from ._triton_api import InferenceResponse, TritonModelException
from ._triton_calls import in_trio_worker_thread
from ._triton_host import TritonHost
from ._triton_requests import InferenceRequest, InferenceResponseSender


class PushedStream:
    """One decoupled request: its execution runs in the backend's nursery, and its senders
    push responses through a channel of no capacity that `__anext__` reads."""

    def __init__(
        self, backend: TritonHost, instance: LoadedInstance, request: InferRequest
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
        ordered = RESPONSE_ORDER.get()  # the client's stream writes responses as sent
        self._ordered = ordered if ordered and ordered.claim(backend.model.name) else None

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
        if isinstance(item, Exception) or sent_final(item):  # the stream's last
            self._final = True  # (before the reader leaves: `_push` may not have run on)
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
        if self._ordered is not None:  # a timeout or a cancellation: what it holds goes
            self._ordered.close()
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
                received = backend.received(request, self._sender)
                if backend.batches is not None:  # one call of execute with others
                    failure = await backend.batches.execute(self._instance, received, request)
                    if failure is not None and not self._sender.closed:
                        await self._push(failure, True, self._ticket())
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
            failure = backend.failed(self._instance, exc)  # logged, after a final flag too
            if not self._sender.closed:
                await self._push(failure, True, self._ticket())
        finally:
            self._done.set()

    def _ticket(self) -> int | None:
        """The place among the model's responses on the client's stream of what is sent now
        (a response, the final flag, a failed execution's error); None: no order, or no
        reader any more."""
        if self._ordered is None or self._reader_gone:
            return None
        return self._ordered.sent()

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
        item: Any = None
        if response is not None:
            declared = self._backend.declared
            item = declared.outputs_of(response)
            if self._ordered is not None and isinstance(item, Exception):
                # A gRPC stream's own request takes error responses as they come, as
                # Triton's clients do (on to the final flag); any other reader ends at one.
                item = ParameterizedOutputs({}, {}, final, error=item)
        ticket = self._ticket()
        try:
            if in_trio_worker_thread():
                trio.from_thread.run(self._push, item, final, ticket)
            else:
                trio.from_thread.run(self._push, item, final, ticket, trio_token=self._token)
        except (trio.Cancelled, trio.RunFinishedError):
            pass  # the request was cancelled or the server stopped: the response is dropped

    async def _push(self, item: Any, final: bool, ticket: int | None = None) -> None:
        handed = False
        try:
            if final and isinstance(item, Mapping) and error_of(item) is None:  # the last
                item = ParameterizedOutputs(item, parameters_of(item), final=True)
            if item is not None:
                await self._send.send(item)
            handed = True
            if final or isinstance(item, Exception):
                self._final = True
                await self._send.aclose()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the reader went away: dropped, as Triton drops a cancelled request's
        finally:
            if ticket is not None and not handed and self._ordered is not None:
                self._ordered.dropped(ticket)  # later responses need not wait for it
