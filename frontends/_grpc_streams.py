"""gRPC's ModelStreamInfer on the trio side: one stream's requests, lanes and credits.

How this works: a stream is one trio task (`Stream`) that runs its requests concurrently (at
most `STREAM_WINDOW`), keeps each sequence's requests in order in a lane that exists only while
the sequence has requests waiting, and hands each response to the asyncio side as it is ready,
after taking a credit (`STREAM_BUFFER`): a client that stops reading stops the stream's models.
`OpenStreams` tracks the open ones for a graceful stop.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
from collections.abc import Callable
from typing import Any

import attrs
import trio
from tritonclient.grpc import service_pb2

from .._server import AsyncServer
from ..backends import RESPONSE_ORDER, OrderedRequest, ResponseOrder
from ..protocols import (
    InferenceTimeoutError,
    InvalidRequestError,
    OrchestrionError,
    ServerClosedError,
    WireRequest,
    declared_size,
    decode_grpc_request,
    encode_grpc_response,
    error_message,
    final_response,
    grpc_status,
)
from ._offload import off_loop
from ._wire_infer import WireInfer

_log = logging.getLogger("orchestrion.grpc")

STREAM_WINDOW = 1024
"""Requests of one stream that may run at once; the stream reads no further until one ends."""


@attrs.frozen
class Undecodable:
    """A message protobuf cannot decode (a string field that is not UTF-8, say): it becomes
    this request's INVALID_ARGUMENT, instead of grpcio's UNKNOWN for the whole call (which
    would end a stream with every request on it)."""

    error: str
    model_name: str = ""
    model_version: str = ""
    id: str = ""


END = object()
"""Marks the end of a stream's responses."""


@attrs.define(eq=False)
class OpenStreams:
    """The front end's open streams (trio side), for a graceful stop: one that opens after
    the stop began is stopped at once."""

    _streams: set[Stream] = attrs.field(factory=set)
    _stopping: bool = False

    def add(self, stream: Stream) -> None:
        """A stream opened."""
        self._streams.add(stream)
        if self._stopping:
            stream.stop()

    def discard(self, stream: Stream) -> None:
        """A stream ended."""
        self._streams.discard(stream)

    def stop(self) -> None:
        """Stop every open stream, and those that open later."""
        self._stopping = True
        for stream in list(self._streams):
            stream.stop()


STREAM_BUFFER = 64
"""Responses of one stream made and not yet written to the client: a producer waits for a
credit before each one, so a client that does not read stops the stream's models there."""

SHUTTING_DOWN = "the server is shutting down: this stream's later requests were not run"


@attrs.define(eq=False)
class Stream:
    """One ModelStreamInfer stream on the trio side.

    Requests without a sequence id run concurrently (at most `STREAM_WINDOW`); those of one
    sequence id run one after another in the order sent, in a *lane* that exists only while
    it has requests (so a stream of many ids holds no memory for the idle ones, and a
    sequence that ends and starts again keeps its order). Each response takes a credit
    (`STREAM_BUFFER`) that comes back once it is written to the client.
    """

    server: AsyncServer
    post: Callable[[Any], object]
    """Hands a response (or `END`) to the asyncio side, thread-safely."""
    streams: OpenStreams
    """The front end's open streams, to `stop` on a graceful stop."""
    wire: WireInfer
    """Runs each request (shared memory, classification) on ``server``."""
    status_on_error: bool = False
    """Triton's ``triton_grpc_error: true`` header: the first error ends the stream with
    its gRPC status (`failure`) instead of travelling in it as one response's message."""
    credit: trio.Semaphore = attrs.field(factory=lambda: trio.Semaphore(STREAM_BUFFER))
    orders: dict[str, ResponseOrder] = attrs.field(factory=dict)
    """Per decoupled model: the order its responses go out in (as its code sent them)."""
    stopping: bool = False
    failure: tuple[str, str] | None = None
    """The gRPC status code name and message the stream ended with (`status_on_error`)."""
    _nursery: trio.Nursery | None = None
    _window: trio.Semaphore = attrs.field(factory=lambda: trio.Semaphore(STREAM_WINDOW))
    _lanes: dict[int | str, collections.deque[tuple[WireRequest, str | None]]] = attrs.field(
        factory=dict
    )
    _input_closed: trio.Event = attrs.field(factory=trio.Event)
    _started: trio.Event = attrs.field(factory=trio.Event)

    async def run(self) -> None:
        """Serve the stream's requests until the input ends and every answer is sent."""
        self.streams.add(self)
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                self._started.set()
                await self._input_closed.wait()
        finally:
            self.streams.discard(self)
            self.post(END)

    async def close_input(self) -> None:
        """The client half-closed the stream (or went away)."""
        self._input_closed.set()

    def stop(self) -> None:
        """A graceful stop: requests already read are answered, later ones are refused, and
        the stream ends once the answers are out."""
        self.stopping = True
        self._input_closed.set()

    def ending(self) -> tuple[str, str] | None:
        """The gRPC status code name and message the stream ends with, where not OK: the
        first error's (`status_on_error`), or UNAVAILABLE after a graceful stop."""
        if self.failure is not None:
            return self.failure
        return ("UNAVAILABLE", SHUTTING_DOWN) if self.stopping else None

    async def emit(self, message: Any, ordered: OrderedRequest | None = None) -> None:
        """Send one response, once the client has read enough of the earlier ones; for a
        response of ``ordered`` (a decoupled request), also once every response its model
        sent before it on this stream is out."""
        ticket = None if ordered is None else ordered.next_ticket()
        if ordered is None or ticket is None:
            await self.credit.acquire()
            self.post(message)
            return
        try:
            await ordered.turn(ticket)
            await self.credit.acquire()
            self.post(message)
        finally:
            ordered.written(ticket)  # also when cancelled: the next ones go

    async def submit(self, message: Any, traceparent: str | None) -> None:
        """Start one request of the stream (waits while the window is full)."""
        await self._started.wait()
        assert self._nursery is not None
        if self.stopping:
            refusal = ServerClosedError(SHUTTING_DOWN)
            await self._failed(message.model_name, "", message.id, refusal)
            return
        await self._window.acquire()
        try:
            if isinstance(message, Undecodable):
                raise InvalidRequestError(message.error)
            wire = await off_loop(declared_size(message), decode_grpc_request, message)
        except Exception as exc:  # one bad request fails alone; the stream goes on
            self._window.release()
            if not isinstance(exc, OrchestrionError):
                _log.error("decoding a stream request failed unexpectedly", exc_info=exc)
            await self._failed(message.model_name, message.model_version, message.id, exc)
            return
        sequence_id = wire.options.sequence_id
        if sequence_id:
            lane = self._lanes.get(sequence_id)
            if lane is None:
                lane = self._lanes[sequence_id] = collections.deque()
                self._nursery.start_soon(self._lane, sequence_id, lane)
            lane.append((wire, traceparent))
        else:
            self._nursery.start_soon(self._answer, wire, traceparent)

    async def _lane(
        self, sequence_id: int | str, lane: collections.deque[tuple[WireRequest, str | None]]
    ) -> None:
        # A sequence's requests run one after another, in the order the client sent them;
        # the lane goes as soon as it is empty (no await between the check and the removal).
        try:
            while lane:
                await self._answer(*lane[0])
                lane.popleft()
        finally:
            if self._lanes.get(sequence_id) is lane:
                del self._lanes[sequence_id]

    async def _answer(self, wire: WireRequest, traceparent: str | None) -> None:
        try:
            if self.wire.on_demand is None:
                await self._answered(wire, traceparent)
            else:
                async with self.wire.holding(wire.model_name):  # loaded on demand
                    await self._answered(wire, traceparent)
        except Exception as exc:  # the model could not be loaded on demand
            await self._failed(*_names(wire), exc)
        finally:
            self._window.release()

    async def _answered(self, wire: WireRequest, traceparent: str | None) -> None:
        ordered = None
        try:
            decoupled = self.server.is_decoupled(wire.model_name)
            if not decoupled:  # one answer: `infer` carries the timeout to the models too
                response = await self.wire.infer(wire, traceparent)
                message = encode_grpc_response(response, final=True, shared=wire.shared_outputs)
                await self.emit(_stream_response(message))
                return
            # Its model's responses go out in the order sent, among the stream's others.
            order = self.orders.get(wire.model_name)
            if order is None:
                order = self.orders[wire.model_name] = ResponseOrder()
            ordered = order.request(wire.model_name)
            reading = RESPONSE_ORDER.set(ordered)
            try:
                await self._streamed(wire, traceparent, ordered)
            finally:
                RESPONSE_ORDER.reset(reading)
        except trio.TooSlowError:
            error = InferenceTimeoutError(
                f"request for model '{wire.model_name}' timed out after {wire.options.timeout} s"
            )
            await self._failed(*_names(wire), error, ordered)
        except Exception as exc:
            if not isinstance(exc, OrchestrionError):
                _log.error("stream request failed unexpectedly", exc_info=exc)
            await self._failed(*_names(wire), exc, ordered)
        finally:
            if ordered is not None:
                ordered.close()

    async def _streamed(
        self, wire: WireRequest, traceparent: str | None, ordered: OrderedRequest
    ) -> None:
        """A decoupled model's responses to one request (raises what `_answered` answers)."""
        # The stream's own deadline below covers the timeout: stream_infer takes none.
        options = attrs.evolve(wire.options, timeout=None, traceparent=traceparent)
        responses = self.wire.stream(wire, options)
        final = False  # the last response came with the model's final flag
        async with contextlib.aclosing(responses) as each:
            with trio.fail_after(wire.options.timeout or math.inf):
                async for response in each:
                    final = response.final
                    if response.error is not None:  # the request goes on after it, unless final
                        await self._failed(*_names(wire), response.error, ordered, final=final)
                        continue
                    message = encode_grpc_response(
                        response, final=final, shared=wire.shared_outputs
                    )
                    await self.emit(_stream_response(message), ordered)
        if wire.empty_final_response and not final:
            empty = final_response(*_names(wire))
            await self.emit(_stream_response(empty), ordered)  # in the final flag's place

    async def _failed(
        self,
        model: str,
        version: str,
        request_id: str,
        error: Exception,
        ordered: OrderedRequest | None = None,
        *,
        final: bool = True,
    ) -> None:
        """A request failed, or its decoupled model sent an error response (``final``: its
        last): the error response (in its place among the responses its model sent, for
        ``ordered``); or, under `status_on_error`, the end of the stream with the error's
        status (the stream's other requests cancelled)."""
        if not self.status_on_error:
            message = _error_response(model, version, request_id, error, final)
            await self.emit(message, ordered)
            return
        if self.failure is None:
            self.failure = (grpc_status(error), error_message(error))
            self.stopping = True
            self._input_closed.set()
            if self._nursery is not None:
                self._nursery.cancel_scope.cancel()


def _names(wire: WireRequest) -> tuple[str, str, str]:
    """The model, version and request id a response of ``wire`` names."""
    return wire.model_name, str(wire.options.model_version), wire.options.request_id


def _stream_response(message: Any) -> Any:
    return service_pb2.ModelStreamInferResponse(infer_response=message)


def _error_response(
    model: str, version: str, request_id: str, error: BaseException, final: bool = True
) -> Any:
    """An error message of a stream, with Triton's ``triton_final_response`` (whether the
    request ends with it)."""
    message = service_pb2.ModelStreamInferResponse(
        error_message=error_message(error),
        infer_response=service_pb2.ModelInferResponse(
            model_name=model, model_version=version if version != "-1" else "", id=request_id
        ),
    )
    message.infer_response.parameters["triton_final_response"].bool_param = final
    return message
