"""The KServe v2 gRPC front end: Triton's ``inference.GRPCInferenceService``.

How this works: grpcio's asyncio server (its C core does HTTP/2) runs on an asyncio event loop
in one worker thread that a trio task owns (`_LoopThread`); each RPC crosses to trio through
`orchestrion.backends._asyncio_bridge.TrioBridge`, and a stream (ModelStreamInfer) is one trio
task of `orchestrion.frontends._grpc_streams`. Messages that protobuf cannot decode become that
request's INVALID_ARGUMENT, not grpcio's UNKNOWN for the whole call.

The message classes come from tritonclient's generated modules (never re-generated here).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import Any, Protocol, TypeVar

import attrs
import grpc
import trio
from tritonclient.grpc import service_pb2, service_pb2_grpc

from .._server import AsyncServer
from ..backends import TrioBridge, call_sync
from ..protocols import (
    ConfigError,
    InvalidRequestError,
    OrchestrionError,
    RegionNotFoundError,
    UnsupportedError,
    WireRequest,
    declared_size,
    decode_grpc_request,
    error_message,
    grpc_status,
    load_override_from_grpc,
    model_config_response,
    model_metadata_message,
    model_statistics_message,
    os_error_in,
    parameter_value,
    parse_version,
    repository_index_message,
    serialized_grpc_response,
    server_metadata_message,
    ungrouped,
)
from ._control import DEFAULT_EXIT_TIMEOUT, ModelControl, Shutdown
from ._grpc_handlers import method_handlers
from ._grpc_streams import END, OpenStreams, Stream
from ._logging import grpc_log_changes, grpc_log_settings, logging_extension
from ._offload import off_loop
from ._on_demand import OnDemand
from ._restricted import Restrictions
from ._shared_memory import CUDA_UNSUPPORTED, SharedMemory
from ._wire_infer import WireInfer

_log = logging.getLogger("orchestrion.grpc")
T = TypeVar("T")

DEFAULT_MAX_MESSAGE_SIZE = 256 * 1024 * 1024
"""The largest gRPC message accepted or sent by default: 256 MiB. Triton raises gRPC's 4 MiB
limit to 2 GiB - 1, but a request costs the server 6-7 times its size in memory at its peak
(the message as gRPC received it, as protobuf parsed it, its tensor, the answer on its way
out), and grpcio's copies hold the GIL (about 1.8 s per 256 MiB): one 2 GiB request could get
the server killed for memory, and stalls every other client for seconds."""


def status_on_error(metadata: Iterable[tuple[str, Any]]) -> bool:
    """Whether a stream's headers ask for Triton's ``triton_grpc_error: true``: its first
    error ends it with the error's gRPC status."""
    return any(k == "triton_grpc_error" and str(v).lower() == "true" for k, v in metadata)


def _traceparent(context: Any) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key == "traceparent":
            return str(value)
    return None


class Calls(Protocol):
    """How the servicer reaches the trio thread: `TrioBridge` from grpcio's asyncio loop,
    `DirectCalls` when the servicer already runs on trio (the native front end)."""

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``await fn(*args)`` on the trio thread."""
        ...

    def run_soon(self, fn: Callable[[], object]) -> None:
        """``fn()`` on the trio thread, soon."""
        ...


class DirectCalls:
    """`Calls` for a servicer that runs on the trio thread itself."""

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``await fn(*args)``, here."""
        return await fn(*args)

    def run_soon(self, fn: Callable[[], object]) -> None:
        """``fn()``, now."""
        fn()


@attrs.define(eq=False, slots=False)
class InferenceService(service_pb2_grpc.GRPCInferenceServiceServicer):  # type: ignore[misc]
    """The servicer: each RPC of ``GRPCInferenceService`` (runs on the asyncio loop)."""

    server: AsyncServer
    control: ModelControl
    bridge: Calls
    version: str
    shared_memory: SharedMemory = attrs.field(factory=SharedMemory)
    """The registered shared memory regions (`serve` shares one with the HTTP front end)."""
    restrictions: Restrictions = attrs.field(factory=Restrictions)
    """Method groups that need a metadata header (``--grpc-restricted-protocol``)."""
    name: str = attrs.field(default="orchestrion", kw_only=True)
    """The server's name in its metadata (``--id``)."""
    on_demand: OnDemand | None = attrs.field(default=None, kw_only=True)
    """Loads a model on its first request (``--model-load-on-demand``)."""
    _streams: OpenStreams = attrs.field(factory=lambda: OpenStreams(), init=False)
    _wire: WireInfer = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._wire = WireInfer(self.server, self.shared_memory, self.on_demand)

    async def _loaded(self, context: Any, name: str) -> None:
        """Load ``name`` first if models load on demand and it is not loaded (metadata,
        config and readiness then answer as for any loaded model)."""
        if self.on_demand is None:
            return

        async def load() -> None:
            async with self._wire.holding(name):
                pass

        try:
            await self.bridge.call(load)
        except Exception as exc:
            await self._abort(context, exc)
            raise  # abort raises; this line is never reached

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
            result: T = await self.bridge.call(call_sync, fn, *args)
            return result
        except Exception as exc:
            await self._abort(context, exc)
            raise  # abort raises; this line is never reached

    async def ServerReady(self, request: Any, context: Any) -> Any:
        """Whether the server is ready."""
        ready = await self._read(context, self.control.ready)
        return service_pb2.ServerReadyResponse(ready=ready)

    async def ModelReady(self, request: Any, context: Any) -> Any:
        """Whether a model (version) is ready."""

        await self._loaded(context, request.name)

        async def ready() -> bool:
            return await self.server.model_ready(request.name, parse_version(request.version))

        try:
            answer = await self.bridge.call(ready)
        except Exception as exc:
            await self._abort(context, exc)
            raise  # abort raises; this line is never reached
        return service_pb2.ModelReadyResponse(ready=answer)

    async def ServerMetadata(self, request: Any, context: Any) -> Any:
        """Server name, version and extensions."""
        return server_metadata_message(self.version, self.name)

    async def ModelMetadata(self, request: Any, context: Any) -> Any:
        """A model's inputs and outputs (``-1`` for the batch dimension)."""

        await self._loaded(context, request.name)

        def metadata() -> Any:
            version = parse_version(request.version)
            config = self.server.model_config(request.name, version)
            versions = self.server.model_versions(request.name) if version < 1 else [version]
            return model_metadata_message(config, versions)

        return await self._read(context, metadata)

    async def ModelConfig(self, request: Any, context: Any) -> Any:
        """A model's config, in Triton's ``ModelConfig`` message."""

        await self._loaded(context, request.name)

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
            return repository_index_message(
                loaded, available, ready_only=request.ready, failed=self.control.failures()
            )

        return await self._read(context, index)

    async def RepositoryModelLoad(self, request: Any, context: Any) -> Any:
        """Load a model (explicit mode), with Triton's ``config`` and ``file:`` overrides."""
        try:
            override = load_override_from_grpc(request.parameters)
            await self.bridge.call(self.control.load, request.model_name, override)
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
        if self.on_demand is not None:
            async with self._wire.holding(wire.model_name):
                return await self._infer_wire(wire, traceparent)
        return await self._infer_wire(wire, traceparent)

    async def _infer_wire(self, wire: WireRequest, traceparent: str | None) -> Any:
        if self.server.is_decoupled(wire.model_name):
            raise InvalidRequestError(
                f"model '{wire.model_name}' is decoupled (zero or many responses per request): "
                "ModelInfer gives one response; use ModelStreamInfer"
            )
        response = await self._wire.infer(wire, traceparent)
        size = sum(int(a.nbytes) for a in response.outputs.values())
        return await off_loop(size, serialized_grpc_response, response, wire.shared_outputs)

    async def SystemSharedMemoryStatus(self, request: Any, context: Any) -> Any:
        """The registered system shared memory regions, or the one named."""

        def status() -> Any:
            response = service_pb2.SystemSharedMemoryStatusResponse()
            for region in self.shared_memory.status(request.name):
                response.regions[region["name"]].CopyFrom(
                    service_pb2.SystemSharedMemoryStatusResponse.RegionStatus(**region)
                )
            return response

        return await self._read(context, status)

    async def SystemSharedMemoryRegister(self, request: Any, context: Any) -> Any:
        """Register a system shared memory region."""
        await self._read(
            context,
            self.shared_memory.register,
            request.name,
            request.key,
            request.offset,
            request.byte_size,
        )
        return service_pb2.SystemSharedMemoryRegisterResponse()

    async def SystemSharedMemoryUnregister(self, request: Any, context: Any) -> Any:
        """Unregister a region, or all of them (empty name)."""
        await self._read(context, self.shared_memory.unregister, request.name)
        return service_pb2.SystemSharedMemoryUnregisterResponse()

    async def CudaSharedMemoryStatus(self, request: Any, context: Any) -> Any:
        """No CUDA shared memory regions (a named one is not found)."""
        if request.name:
            await self._abort(
                context,
                RegionNotFoundError(f"Unable to find cuda shared memory region: '{request.name}'"),
            )
        return service_pb2.CudaSharedMemoryStatusResponse()

    async def CudaSharedMemoryUnregister(self, request: Any, context: Any) -> Any:
        """Nothing to unregister: done (client scripts unregister before they start)."""
        return service_pb2.CudaSharedMemoryUnregisterResponse()

    async def CudaSharedMemoryRegister(self, request: Any, context: Any) -> Any:
        """Refused: CUDA shared memory is not offered."""
        await self._abort(context, UnsupportedError(CUDA_UNSUPPORTED))

    async def TraceSetting(self, request: Any, context: Any) -> Any:
        """Refused: tracing is configured at start (``--trace-config``)."""
        await context.abort(
            grpc.StatusCode.UNIMPLEMENTED, "trace settings are set at start with --trace-config"
        )

    async def LogSettings(self, request: Any, context: Any) -> Any:
        """Triton's logging extension: the log settings, after the changes asked for."""
        changes = grpc_log_changes(request.settings)
        return grpc_log_settings(await self._read(context, logging_extension, changes))

    async def ModelStreamInfer(self, request_iterator: Any, context: Any) -> AsyncIterator[Any]:
        """A bidirectional stream: decoupled models, sequences, or any model."""
        responses: asyncio.Queue[Any] = asyncio.Queue()  # holds at most STREAM_BUFFER + 1
        loop = asyncio.get_running_loop()
        stream = Stream(
            self.server,
            lambda item: loop.call_soon_threadsafe(responses.put_nowait, item),
            self._streams,
            self._wire,
            status_on_error=status_on_error(context.invocation_metadata() or ()),
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
                if item is END:
                    break
                yield item
                # Sent (grpcio's write waits for HTTP/2 flow control): a credit back to the
                # producers, who wait for one before each response (backpressure).
                self.bridge.run_soon(stream.credit.release)
            ending = stream.ending()
            if ending is not None:
                # After a graceful stop, every request read so far is answered (those after
                # the stop as refusals) and whatever the client still sends is refused by
                # the status; under triton_grpc_error, the first error's status ends it.
                reader.cancel()
                await context.abort(getattr(grpc.StatusCode, ending[0]), ending[1])
            await asyncio.wait([reader])
            reader.result()
            await session
        finally:
            reader.cancel()
            session.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.gather(reader, session, return_exceptions=True)


async def serve_grpc_api(
    server: AsyncServer,
    control: ModelControl,
    version: str,
    host: str,
    port: int,
    *,
    shutdown: Shutdown | None = None,
    exit_timeout: float = DEFAULT_EXIT_TIMEOUT,
    max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE,
    shared_memory: SharedMemory | None = None,
    restrictions: Restrictions | None = None,
    channel_args: Sequence[tuple[str, int]] = (),
    name: str = "orchestrion",
    on_demand: OnDemand | None = None,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``inference.GRPCInferenceService`` on ``host:port`` until cancelled, or until
    ``shutdown`` is requested; reports the address it listens on through ``task_status``.
    ``channel_args``: more of grpcio's server options (``("grpc.keepalive_time_ms",
    60000)``: Triton's keepalive flags), over the defaults.

    ``address = await nursery.start(serve_grpc_api, server, control, version, host, port)``:
    ``port=0`` picks a free port (``address`` says which). Cancelling stops it at once (RPCs
    in flight are cut off). Requesting ``shutdown`` stops it gracefully, then it returns: no
    new RPCs, open streams refuse what they read next, RPCs in flight get up to
    ``exit_timeout`` seconds. ``shared_memory``: the registered regions, shared with the
    HTTP front end (its own when None); ``restrictions``: method groups that need a header
    (``--grpc-restricted-protocol``).

    Raises:
        ConfigError: the address cannot be bound (before it reports).
    """
    if not 0 <= port <= 65535:
        raise ConfigError(f"gRPC port {port} is not a TCP port (0-65535; 0: any free port)")
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    async with ungrouped(trio.open_nursery()) as nursery:
        bridge = TrioBridge(trio.lowlevel.current_trio_token(), nursery)
        service = InferenceService(
            server,
            control,
            bridge,
            version,
            shared_memory or SharedMemory(),
            restrictions or Restrictions(),
            name=name,
            on_demand=on_demand,
        )
        loop_thread = _LoopThread(service, address, max_message_size, tuple(channel_args))
        try:
            bound = await nursery.start(loop_thread.run)
        except BaseException as exc:
            bind_error = os_error_in(exc)
            if bind_error is None:
                raise
            raise ConfigError(f"cannot serve gRPC on {host}:{port}: {bind_error}") from None

        def stop() -> None:
            service.stop_streams()
            loop_thread.stop(exit_timeout)

        with (shutdown or Shutdown()).on_request(stop):
            task_status.started(f"{host}:{bound}")
            try:
                await loop_thread.ended.wait()  # a graceful stop has run its course
            except BaseException:  # cancelled: RPCs in flight are cut off now
                loop_thread.stop(0.0)
                raise


@attrs.define(eq=False)
class _LoopThread:
    """The asyncio loop (in a worker thread) that runs grpcio's server."""

    service: InferenceService
    address: str
    max_message_size: int
    channel_args: tuple[tuple[str, int], ...] = ()
    """grpcio server options over the defaults."""
    _loop: asyncio.AbstractEventLoop | None = None
    _stop: asyncio.Event | None = None
    _grace: float = 0.0
    ended: trio.Event = attrs.field(factory=trio.Event, init=False)
    """Set when the thread has ended (after `stop`, or an error)."""

    async def run(self, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the loop in a thread until `stop`; reports the bound port when serving."""
        token = trio.lowlevel.current_trio_token()

        def started(port: int) -> None:
            task_status.started(port)

        def main() -> None:
            asyncio.run(self._serve(lambda port: token.run_sync_soon(started, port)))

        try:
            await trio.to_thread.run_sync(main)
        finally:
            self.ended.set()

    async def _serve(self, started: Callable[[int], None]) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        limit = self.max_message_size
        options = {
            "grpc.max_receive_message_length": limit,
            "grpc.max_send_message_length": limit,
            "grpc.so_reuseport": 0,
            **dict(self.channel_args),
        }
        grpc_server = grpc.aio.server(options=list(options.items()))
        grpc_server.add_generic_rpc_handlers((method_handlers(self.service),))
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
