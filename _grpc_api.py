"""The KServe v2 gRPC front end: Triton's ``inference.GRPCInferenceService``.

How this works: grpcio's asyncio server (its C core does HTTP/2) runs on an asyncio event loop
in one worker thread that a trio task owns; the models run on trio. `TrioBridge` connects the
two without blocking either loop: asyncio hands a call to trio with
``TrioToken.run_sync_soon`` (thread-safe, never waits), the call runs as a task in a trio
nursery the front end owns, and its result comes back with ``loop.call_soon_threadsafe``.
Cancellation crosses too: an RPC that the client abandons cancels its trio task, and closing
the front end cancels what is left. A stream (ModelStreamInfer) is one trio task that runs
its requests concurrently, keeps each sequence's requests in order, and sends responses as
they are ready.

The message classes come from tritonclient's generated modules (never re-generated here).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import inspect
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import attrs
import grpc
import trio
from google.protobuf.message import DecodeError
from tritonclient.grpc import service_pb2, service_pb2_grpc

from ._control import ModelControl
from ._offload import off_loop
from ._server import AsyncServer
from .protocols import (
    ConfigError,
    InferenceTimeoutError,
    InvalidRequestError,
    OrchestrionError,
    ServerClosedError,
    os_error_in,
)
from .protocols._kserve import WireRequest, error_message, grpc_status, parse_version
from .protocols._kserve_grpc import (
    declared_size,
    decode_grpc_request,
    encode_grpc_response,
    final_response,
    model_config_response,
    model_metadata_message,
    model_statistics_message,
    parameter_value,
    repository_index_message,
    serialized_grpc_response,
    server_metadata_message,
)

_log = logging.getLogger("orchestrion.grpc")
T = TypeVar("T")

DEFAULT_MAX_MESSAGE_SIZE = 256 * 1024 * 1024
"""The largest gRPC message accepted or sent by default: 256 MiB. Triton raises gRPC's 4 MiB
limit to 2 GiB - 1, but a request costs the server 6-7 times its size in memory at its peak
(the message as gRPC received it, as protobuf parsed it, its tensor, the answer on its way
out), and grpcio's copies hold the GIL (about 1.8 s per 256 MiB): one 2 GiB request could get
the server killed for memory, and stalls every other client for seconds."""

STREAM_WINDOW = 1024
"""Requests of one stream that may run at once; the stream reads no further until one ends."""


@attrs.define(eq=False)
class _Mailbox:
    """Hands items to another thread's event loop, waking it once per batch of items rather
    than once per item (each wake is a syscall and a thread switch)."""

    wake: Callable[[Callable[[], None]], object]
    """Schedules a callback on the other loop, thread-safely."""
    handle: Callable[[Any], None]
    """Runs on the other loop, for each item."""
    _items: collections.deque[Any] = attrs.field(factory=collections.deque)
    _scheduled: bool = False

    def post(self, item: Any) -> None:
        """Queue ``item`` (from any thread); the other loop handles it soon."""
        self._items.append(item)
        if not self._scheduled:
            self._scheduled = True
            try:
                self.wake(self._drain)
            except BaseException:
                self._scheduled = False
                raise

    def _drain(self) -> None:
        # Clear the flag before draining: an item posted after this line schedules a new
        # drain, and one posted before it is drained here (the GIL orders the two).
        self._scheduled = False
        items = self._items
        while items:
            self.handle(items.popleft())


@attrs.define(eq=False)
class _Call:
    """One asyncio-to-trio call in flight."""

    fn: Callable[..., Awaitable[Any]]
    args: tuple[Any, ...]
    future: asyncio.Future[Any]
    replies: _Mailbox
    """The asyncio loop's mailbox, for the outcome."""
    scope: trio.CancelScope | None = None
    abandoned: bool = False

    def deliver(self, result: object = None, error: BaseException | None = None) -> None:
        """Hand the outcome to the asyncio side (from the trio thread)."""
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
            self.replies.post((self.future, result, error))

    def cancel(self) -> None:
        """The asyncio side gave up (runs on the trio thread)."""
        self.abandoned = True
        if self.scope is not None:
            self.scope.cancel()


def _settle(item: tuple[asyncio.Future[Any], object, BaseException | None]) -> None:
    future, result, error = item
    if future.done():  # cancelled meanwhile
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


_CANCEL = object()
"""Marks a cancellation in the bridge's mailbox to trio."""


@attrs.define(eq=False)
class TrioBridge:
    """Runs trio async functions for code on an asyncio loop in another thread.

    Calls and their outcomes cross in batches: when many calls are in flight, one wake of
    the other loop carries all that are ready (`_Mailbox`).
    """

    token: trio.lowlevel.TrioToken
    nursery: trio.Nursery
    _to_trio: _Mailbox = attrs.field(init=False)
    _to_asyncio: dict[asyncio.AbstractEventLoop, _Mailbox] = attrs.field(factory=dict, init=False)

    def __attrs_post_init__(self) -> None:
        self._to_trio = _Mailbox(self.token.run_sync_soon, self._receive)

    async def call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``await fn(*args)`` in trio and return its result (called on asyncio).

        Cancelling the awaiting asyncio task cancels the trio task.
        """
        loop = asyncio.get_running_loop()
        replies = self._to_asyncio.get(loop)
        if replies is None:
            replies = self._to_asyncio[loop] = _Mailbox(loop.call_soon_threadsafe, _settle)
        call = _Call(fn, args, loop.create_future(), replies)
        try:
            self._to_trio.post(call)
        except trio.RunFinishedError:
            raise ServerClosedError("the server is shutting down") from None
        try:
            result: T = await call.future
        except asyncio.CancelledError:
            with contextlib.suppress(trio.RunFinishedError):
                self._to_trio.post((_CANCEL, call))
            raise
        return result

    def run_soon(self, fn: Callable[[], object]) -> None:
        """Run ``fn()`` on the trio thread soon (called on asyncio; never waits). Nothing
        happens once trio has finished."""
        with contextlib.suppress(trio.RunFinishedError):
            self._to_trio.post(fn)

    def _receive(self, item: Any) -> None:
        if isinstance(item, tuple):
            item[1].cancel()
            return
        if not isinstance(item, _Call):
            item()
            return
        try:
            self.nursery.start_soon(self._run, item)
        except RuntimeError:  # the nursery is closed: the server is stopping
            item.deliver(error=ServerClosedError("the server is shutting down"))

    async def _run(self, call: _Call) -> None:
        delivered = False
        try:
            with trio.CancelScope() as call.scope:
                if call.abandoned:
                    call.scope.cancel()
                result = await call.fn(*call.args)
                call.deliver(result)
                delivered = True
        except Exception as exc:
            call.deliver(error=exc)
            delivered = True
        finally:
            if not delivered:
                call.deliver(error=ServerClosedError("the server is shutting down"))


async def _call_sync(fn: Callable[..., T], *args: Any) -> T:
    return fn(*args)


def _traceparent(context: Any) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key == "traceparent":
            return str(value)
    return None


@attrs.define(eq=False, slots=False)
class InferenceService(service_pb2_grpc.GRPCInferenceServiceServicer):  # type: ignore[misc]
    """The servicer: each RPC of ``GRPCInferenceService`` (runs on the asyncio loop)."""

    server: AsyncServer
    control: ModelControl
    bridge: TrioBridge
    version: str
    _streams: _OpenStreams = attrs.field(factory=lambda: _OpenStreams(), init=False)

    def stop_streams(self) -> None:
        """A graceful stop of every open stream (on the trio thread): each answers what it
        has read, refuses what comes after, and ends (UNAVAILABLE) once its answers are
        out, so an idle stream does not hold the stop up."""
        self._streams.stop()

    async def _abort(self, context: Any, error: BaseException) -> None:
        if not isinstance(error, OrchestrionError):
            _log.error("gRPC call failed unexpectedly", exc_info=error)
        await context.abort(grpc.StatusCode[grpc_status(error)], error_message(error))

    async def ServerLive(self, request: Any, context: Any) -> Any:
        """Whether the server is live."""
        return service_pb2.ServerLiveResponse(live=True)

    async def _read(self, context: Any, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn`` (reading the server's state) on the trio thread, where that state
        lives, so it never races a load or unload; errors abort the RPC."""
        try:
            return await self.bridge.call(_call_sync, fn, *args)
        except Exception as exc:
            await self._abort(context, exc)
            raise  # abort raises; this line is never reached

    async def ServerReady(self, request: Any, context: Any) -> Any:
        """Whether the server is ready."""
        ready = await self._read(context, self.control.ready)
        return service_pb2.ServerReadyResponse(ready=ready)

    async def ModelReady(self, request: Any, context: Any) -> Any:
        """Whether a model (version) is ready."""

        def ready() -> bool:
            return self.server.is_model_ready(request.name, parse_version(request.version))

        return service_pb2.ModelReadyResponse(ready=await self._read(context, ready))

    async def ServerMetadata(self, request: Any, context: Any) -> Any:
        """Server name, version and extensions."""
        return server_metadata_message(self.version)

    async def ModelMetadata(self, request: Any, context: Any) -> Any:
        """A model's inputs and outputs (``-1`` for the batch dimension)."""

        def metadata() -> Any:
            version = parse_version(request.version)
            config = self.server.model_config(request.name, version)
            versions = self.server.model_versions(request.name) if version < 1 else [version]
            return model_metadata_message(config, versions)

        return await self._read(context, metadata)

    async def ModelConfig(self, request: Any, context: Any) -> Any:
        """A model's config, in Triton's ``ModelConfig`` message."""

        def config() -> Any:
            version = parse_version(request.version)
            return model_config_response(self.server.model_config(request.name, version))

        return await self._read(context, config)

    async def ModelStatistics(self, request: Any, context: Any) -> Any:
        """Triton's statistics of one model, or of all (empty name)."""

        def statistics() -> Any:
            if not request.name:
                return model_statistics_message(self.server.model_statistics())
            version = parse_version(request.version)
            found = self.server.model_statistics(request.name, version if version > 0 else None)
            return model_statistics_message(found)

        return await self._read(context, statistics)

    async def RepositoryIndex(self, request: Any, context: Any) -> Any:
        """The repository's models and their state."""

        def index() -> Any:
            loaded = {n: self.server.model_versions(n) for n in self.server.model_names()}
            available = self.control.available()
            return repository_index_message(loaded, available, ready_only=request.ready)

        return await self._read(context, index)

    async def RepositoryModelLoad(self, request: Any, context: Any) -> Any:
        """Load a model (explicit mode)."""
        parameters = {k: parameter_value(v) for k, v in request.parameters.items()}
        try:
            await self.bridge.call(self.control.load, request.model_name, parameters)
        except Exception as exc:
            await self._abort(context, exc)
        return service_pb2.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(self, request: Any, context: Any) -> Any:
        """Unload a model (explicit mode)."""
        parameters = {k: parameter_value(v) for k, v in request.parameters.items()}
        try:
            await self.bridge.call(self.control.unload, request.model_name, parameters)
        except Exception as exc:
            await self._abort(context, exc)
        return service_pb2.RepositoryModelUnloadResponse()

    async def ModelInfer(self, request: Any, context: Any) -> Any:
        """One inference."""
        try:
            return await self.bridge.call(self._infer, request, _traceparent(context))
        except Exception as exc:
            await self._abort(context, exc)

    async def _infer(self, message: Any, traceparent: str | None) -> Any:
        # Decoding and encoding happen here, on trio, so that a large message is handled in
        # a worker thread instead of holding the asyncio loop that every gRPC call shares.
        wire = await off_loop(declared_size(message), decode_grpc_request, message)
        if self.server.is_decoupled(wire.model_name):
            raise InvalidRequestError(
                f"model '{wire.model_name}' is decoupled (zero or many responses per request): "
                "ModelInfer gives one response; use ModelStreamInfer"
            )
        response = await self.server.infer(
            wire.model_name,
            wire.inputs,
            **wire.infer_arguments(),
            timeout=wire.timeout,
            traceparent=traceparent,
        )
        size = sum(int(a.nbytes) for a in response.outputs.values())
        return await off_loop(size, serialized_grpc_response, response)

    async def SystemSharedMemoryStatus(self, request: Any, context: Any) -> Any:
        """No shared memory regions: orchestrion does not offer shared memory."""
        return service_pb2.SystemSharedMemoryStatusResponse()

    async def CudaSharedMemoryStatus(self, request: Any, context: Any) -> Any:
        """No CUDA shared memory regions."""
        return service_pb2.CudaSharedMemoryStatusResponse()

    async def SystemSharedMemoryUnregister(self, request: Any, context: Any) -> Any:
        """Nothing to unregister."""
        return service_pb2.SystemSharedMemoryUnregisterResponse()

    async def CudaSharedMemoryUnregister(self, request: Any, context: Any) -> Any:
        """Nothing to unregister."""
        return service_pb2.CudaSharedMemoryUnregisterResponse()

    async def SystemSharedMemoryRegister(self, request: Any, context: Any) -> Any:
        """Refused: tensors travel in the messages."""
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "shared memory is not supported")

    async def CudaSharedMemoryRegister(self, request: Any, context: Any) -> Any:
        """Refused: tensors travel in the messages."""
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "CUDA shared memory is not supported")

    async def TraceSetting(self, request: Any, context: Any) -> Any:
        """Refused: tracing is configured at start (``--trace-config``)."""
        await context.abort(
            grpc.StatusCode.UNIMPLEMENTED, "trace settings are set at start with --trace-config"
        )

    async def LogSettings(self, request: Any, context: Any) -> Any:
        """Refused: logging is configured at start (``--log-verbose``)."""
        await context.abort(
            grpc.StatusCode.UNIMPLEMENTED, "log settings are set at start with --log-verbose"
        )

    async def ModelStreamInfer(self, request_iterator: Any, context: Any) -> AsyncIterator[Any]:
        """A bidirectional stream: decoupled models, sequences, or any model."""
        responses: asyncio.Queue[Any] = asyncio.Queue()  # holds at most STREAM_BUFFER + 1
        loop = asyncio.get_running_loop()
        stream = _Stream(
            self.server,
            lambda item: loop.call_soon_threadsafe(responses.put_nowait, item),
            self._streams,
        )
        traceparent = _traceparent(context)

        async def read() -> None:
            try:
                async for message in request_iterator:
                    await self.bridge.call(stream.submit, message, traceparent)
            finally:
                await self.bridge.call(stream.close_input)

        session = asyncio.ensure_future(self.bridge.call(stream.run))
        reader = asyncio.ensure_future(read())
        try:
            while True:
                item = await responses.get()
                if item is _END:
                    break
                yield item
                # Sent (grpcio's write waits for HTTP/2 flow control): a credit back to the
                # producers, who wait for one before each response (backpressure).
                self.bridge.run_soon(stream.credit.release)
            if stream.stopping:
                # Every request read so far is answered (those after the stop as refusals);
                # whatever the client still sends is refused by the status.
                reader.cancel()
                await context.abort(grpc.StatusCode.UNAVAILABLE, _SHUTTING_DOWN)
            await asyncio.wait([reader])
            reader.result()
            await session
        finally:
            reader.cancel()
            session.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.gather(reader, session, return_exceptions=True)


_END = object()
"""Marks the end of a stream's responses."""


@attrs.define(eq=False)
class _OpenStreams:
    """The front end's open streams (trio side), for a graceful stop: one that opens after
    the stop began is stopped at once."""

    _streams: set[_Stream] = attrs.field(factory=set)
    _stopping: bool = False

    def add(self, stream: _Stream) -> None:
        """A stream opened."""
        self._streams.add(stream)
        if self._stopping:
            stream.stop()

    def discard(self, stream: _Stream) -> None:
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

_SHUTTING_DOWN = "the server is shutting down: this stream's later requests were not run"


@attrs.define(eq=False)
class _Stream:
    """One ModelStreamInfer stream on the trio side.

    Requests without a sequence id run concurrently (at most `STREAM_WINDOW`); those of one
    sequence id run one after another in the order sent, in a *lane* that exists only while
    it has requests (so a stream of many ids holds no memory for the idle ones, and a
    sequence that ends and starts again keeps its order). Each response takes a credit
    (`STREAM_BUFFER`) that comes back once it is written to the client.
    """

    server: AsyncServer
    post: Callable[[Any], object]
    """Hands a response (or `_END`) to the asyncio side, thread-safely."""
    streams: _OpenStreams
    """The front end's open streams, to `stop` on a graceful stop."""
    credit: trio.Semaphore = attrs.field(factory=lambda: trio.Semaphore(STREAM_BUFFER))
    stopping: bool = False
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
            self.post(_END)

    async def close_input(self) -> None:
        """The client half-closed the stream (or went away)."""
        self._input_closed.set()

    def stop(self) -> None:
        """A graceful stop: requests already read are answered, later ones are refused, and
        the stream ends once the answers are out."""
        self.stopping = True
        self._input_closed.set()

    async def emit(self, message: Any) -> None:
        """Send one response, once the client has read enough of the earlier ones."""
        await self.credit.acquire()
        self.post(message)

    async def submit(self, message: Any, traceparent: str | None) -> None:
        """Start one request of the stream (waits while the window is full)."""
        await self._started.wait()
        assert self._nursery is not None
        if self.stopping:
            refusal = ServerClosedError(_SHUTTING_DOWN)
            await self.emit(_error_response(message.model_name, "", message.id, refusal))
            return
        await self._window.acquire()
        try:
            if isinstance(message, _Undecodable):
                raise InvalidRequestError(message.error)
            wire = await off_loop(declared_size(message), decode_grpc_request, message)
        except Exception as exc:  # one bad request fails alone; the stream goes on
            self._window.release()
            if not isinstance(exc, OrchestrionError):
                _log.error("decoding a stream request failed unexpectedly", exc_info=exc)
            await self.emit(
                _error_response(message.model_name, message.model_version, message.id, exc)
            )
            return
        if wire.sequence_id:
            lane = self._lanes.get(wire.sequence_id)
            if lane is None:
                lane = self._lanes[wire.sequence_id] = collections.deque()
                self._nursery.start_soon(self._lane, wire.sequence_id, lane)
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
            decoupled = self.server.is_decoupled(wire.model_name)
            if not decoupled:  # one answer: `infer` carries the timeout to the models too
                response = await self.server.infer(
                    wire.model_name,
                    wire.inputs,
                    **wire.infer_arguments(),
                    timeout=wire.timeout,
                    traceparent=traceparent,
                )
                await self.emit(_stream_response(encode_grpc_response(response, final=True)))
                return
            responses = self.server.stream_infer(
                wire.model_name, wire.inputs, **wire.infer_arguments(), traceparent=traceparent
            )
            async with contextlib.aclosing(responses) as each:
                with trio.fail_after(wire.timeout or math.inf):
                    async for response in each:
                        message = encode_grpc_response(response, final=False)
                        await self.emit(_stream_response(message))
            if wire.empty_final_response:
                version = str(wire.model_version)
                await self.emit(
                    _stream_response(final_response(wire.model_name, version, wire.request_id))
                )
        except trio.TooSlowError:
            error = InferenceTimeoutError(
                f"request for model '{wire.model_name}' timed out after {wire.timeout} s"
            )
            await self.emit(
                _error_response(wire.model_name, str(wire.model_version), wire.request_id, error)
            )
        except Exception as exc:
            if not isinstance(exc, OrchestrionError):
                _log.error("stream request failed unexpectedly", exc_info=exc)
            await self.emit(
                _error_response(wire.model_name, str(wire.model_version), wire.request_id, exc)
            )
        finally:
            self._window.release()


def _stream_response(message: Any) -> Any:
    return service_pb2.ModelStreamInferResponse(infer_response=message)


def _error_response(model: str, version: str, request_id: str, error: BaseException) -> Any:
    return service_pb2.ModelStreamInferResponse(
        error_message=error_message(error),
        infer_response=service_pb2.ModelInferResponse(
            model_name=model, model_version=version if version != "-1" else "", id=request_id
        ),
    )


@contextlib.asynccontextmanager
async def open_grpc_api(
    server: AsyncServer,
    control: ModelControl,
    version: str,
    host: str = "127.0.0.1",
    port: int = 8001,
    *,
    exit_timeout: float = 30.0,
    max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE,
) -> AsyncIterator[tuple[str, Callable[[], None]]]:
    """Serve ``inference.GRPCInferenceService`` for the duration of the block.

    Yields the address it listens on (``port=0`` picks a free one) and a function that
    starts a graceful stop: no new RPCs, those in flight get up to ``exit_timeout`` seconds.

    Raises:
        ConfigError: the address cannot be bound.
    """
    if not 0 <= port <= 65535:
        raise ConfigError(f"gRPC port {port} is not a TCP port (0-65535; 0: any free port)")
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    bind_error: OSError | None = None
    error: BaseException | None = None
    async with trio.open_nursery() as nursery:
        bridge = TrioBridge(trio.lowlevel.current_trio_token(), nursery)
        service = InferenceService(server, control, bridge, version)
        loop_thread = _LoopThread(service, address, max_message_size)
        try:
            bound = await nursery.start(loop_thread.run)
        except BaseException as exc:
            bind_error = os_error_in(exc)
            if bind_error is None:
                raise
        else:

            def stop() -> None:
                service.stop_streams()
                loop_thread.stop(exit_timeout)

            try:
                yield f"{host}:{bound}", stop
            except BaseException as exc:  # the caller's: leaves as itself, after a quick stop
                error = exc
                loop_thread.stop(0.0)
            else:
                stop()
    if error is not None:
        raise error
    if bind_error is not None:
        raise ConfigError(f"cannot serve gRPC on {host}:{port}: {bind_error}") from None


@attrs.frozen
class _Undecodable:
    """A message protobuf cannot decode (a string field that is not UTF-8, say): it becomes
    this request's INVALID_ARGUMENT, instead of grpcio's UNKNOWN for the whole call (which
    would end a stream with every request on it)."""

    error: str
    model_name: str = ""
    model_version: str = ""
    id: str = ""


def _lenient(parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def deserialize(data: bytes) -> Any:
        try:
            return parse(data)
        except DecodeError as exc:
            return _Undecodable(f"the request message cannot be decoded: {exc}")

    return deserialize


def _refusing_undecodable(behaviour: Callable[..., Any]) -> Callable[..., Awaitable[Any]]:
    async def unary(request: Any, context: Any) -> Any:
        if isinstance(request, _Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.error)
        result = behaviour(request, context)
        return await result if inspect.isawaitable(result) else result

    return unary


def _serializer(message_type: Any) -> Callable[[Any], bytes]:
    """The message's own serializer, passing through what is serialized already
    (`serialized_grpc_response`)."""
    serialize = message_type.SerializeToString

    def serializer(message: Any) -> bytes:
        return message if isinstance(message, bytes) else serialize(message)

    return serializer


def _handlers(service: InferenceService) -> grpc.GenericRpcHandler:
    """The service's methods, as the generated code registers them, with lenient decoding."""
    descriptor = service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    handlers = {}
    for method in descriptor.methods:
        request_type = getattr(service_pb2, method.input_type.name)
        response_type = getattr(service_pb2, method.output_type.name)
        behaviour = getattr(service, method.name)
        coding = {
            "request_deserializer": _lenient(request_type.FromString),
            "response_serializer": _serializer(response_type),
        }
        if method.client_streaming:
            handlers[method.name] = grpc.stream_stream_rpc_method_handler(behaviour, **coding)
        else:
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(
                _refusing_undecodable(behaviour), **coding
            )
    return grpc.method_handlers_generic_handler(descriptor.full_name, handlers)


@attrs.define(eq=False)
class _LoopThread:
    """The asyncio loop (in a worker thread) that runs grpcio's server."""

    service: InferenceService
    address: str
    max_message_size: int
    _loop: asyncio.AbstractEventLoop | None = None
    _stop: asyncio.Event | None = None
    _grace: float = 0.0

    async def run(self, task_status: trio.TaskStatus[int]) -> None:
        """Run the loop in a thread until `stop`; reports the bound port when serving."""
        token = trio.lowlevel.current_trio_token()

        def started(port: int) -> None:
            task_status.started(port)

        def main() -> None:
            asyncio.run(self._serve(lambda port: token.run_sync_soon(started, port)))

        await trio.to_thread.run_sync(main)

    async def _serve(self, started: Callable[[int], None]) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        limit = self.max_message_size
        grpc_server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", limit),
                ("grpc.max_send_message_length", limit),
                ("grpc.so_reuseport", 0),
            ]
        )
        grpc_server.add_generic_rpc_handlers((_handlers(self.service),))
        try:
            port = grpc_server.add_insecure_port(self.address)
        except RuntimeError as exc:
            raise OSError(f"{self.address} cannot be bound ({exc})") from None
        if port == 0:
            raise OSError(f"{self.address} cannot be bound")
        await grpc_server.start()
        started(port)
        try:
            await self._stop.wait()
        finally:
            await grpc_server.stop(self._grace)

    def stop(self, grace: float) -> None:
        """Stop the server (from the trio thread): RPCs in flight get ``grace`` seconds."""
        loop, event = self._loop, self._stop
        if loop is None or event is None:
            return
        self._grace = grace

        def set_stop() -> None:
            self._grace = min(self._grace, grace)
            event.set()

        with contextlib.suppress(RuntimeError):  # the loop has already ended
            loop.call_soon_threadsafe(set_stop)
