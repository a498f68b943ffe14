"""The native front end: HTTP/1.1, HTTP/2 and gRPC served by compiled code, answered on trio.

How this works: `orchestrion_native.Frontend` (Rust: hyper on threads of its own, package
``native/``) accepts connections, frames requests and enforces the transport's limits,
without the interpreter. Requests reach the trio thread as events: `serve_native`'s
dispatcher waits on the front end's eventfd, takes every event that arrived at once, and
starts one task per request in its nursery. Each task answers through the same
transport-free code the Python front ends use (`HttpApi.handle` for HTTP, the
`InferenceService` methods for gRPC, `Stream` for ModelStreamInfer), and hands the bytes
back (`respond`, `reply`, `stream_send`, `stream_close`). A client that goes away cancels
its task. There is no second event loop and no thread handoff on the way.

The native part is optional: `native_available()` says whether it is installed (``orchestrion
serve --frontend python`` and a missing build use `_http_server` and `_grpc_service`).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import urllib.parse
from collections.abc import Callable
from typing import Any

import attrs
import grpc
import trio

from ..protocols import ConfigError, OrchestrionError, error_message, grpc_status
from ._control import Shutdown
from ._grpc_handlers import Method, methods
from ._grpc_service import InferenceService, status_on_error
from ._grpc_streams import END, Stream
from ._http_api import HttpApi
from ._http_server import HttpRequest, StreamedAnswer, _Episode
from ._native_cache import CacheTier, open_cache_tier

_log = logging.getLogger("orchestrion.native")

_native: Any
try:  # the optional native build (package orchestrion-native)
    from orchestrion_native import _native
except ImportError:  # pragma: no cover - depends on the installation
    _native = None

HTTP_STREAM_CREDITS = 4
"""Parts of a streamed HTTP answer handed to the front end and not yet taken by its
connection: what a slow reader lets the producer run ahead (beyond the socket's buffers)."""
_CLOSE_TIMEOUT = 1.0
"""Seconds the front end's connections get to send what was answered, once stopped."""
_UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]
_INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT.value[0]
_UNIMPLEMENTED = grpc.StatusCode.UNIMPLEMENTED.value[0]


def native_available() -> bool:
    """Whether the native front end is installed."""
    return _native is not None


class _Aborted(Exception):
    """A servicer method ended its call with a status (``context.abort``)."""

    def __init__(self, code: int, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


@attrs.frozen
class _Context:
    """What a servicer method reads of its call: the metadata, and ``abort``."""

    metadata: list[tuple[str, str]]

    def invocation_metadata(self) -> list[tuple[str, str]]:
        """The call's metadata (lower-case keys)."""
        return self.metadata

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        """End the call with ``code`` and ``details``."""
        raise _Aborted(code.value[0], details)


def _metadata(headers: list[tuple[bytes, bytes]]) -> list[tuple[str, str]]:
    return [
        (name.decode("latin-1"), value.decode("latin-1"))
        for name, value in headers
        if not name.endswith(b"-bin")
    ]


def _troubles() -> dict[int, _Episode]:
    """The log lines of the front end's troubles, by the kind the native side reports (one
    line per episode, in the Python front end's words)."""
    return {
        _native.TROUBLE_SLOW: _Episode(
            "HTTP clients too slow: a request head or body cut off, 408"
        ),
        _native.TROUBLE_EVICTED: _Episode(
            "HTTP connection limit reached: connections that sent nothing closed, oldest "
            "first, to serve new ones"
        ),
        _native.TROUBLE_ACCEPT: _Episode("cannot accept HTTP connections (retrying every 0.1 s)"),
        _native.TROUBLE_TURNED_AWAY: _Episode(
            "HTTP connection limit reached: new connections get 503 while it is "
            "(--http-max-connections)"
        ),
    }


@attrs.define(eq=False)
class _Dispatcher:
    """Takes the native front end's events on the trio thread and starts their tasks."""

    frontend: Any
    http: HttpApi | None
    service: InferenceService | None
    nursery: trio.Nursery
    tier: CacheTier | None = None
    """The response cache's first tier in the front end (None: off)."""
    _methods: dict[str, Method] = attrs.field(factory=dict)
    _scopes: dict[int, trio.CancelScope] = attrs.field(factory=dict)
    """The task of each request or stream in flight, by id."""
    _streams: dict[int, _NativeStream] = attrs.field(factory=dict)
    _http_credits: dict[int, trio.Semaphore] = attrs.field(factory=dict)
    """The credits of each streamed HTTP answer being sent, by request id."""
    _idle: trio.Event = attrs.field(factory=trio.Event)
    _troubles: dict[int, _Episode] = attrs.field(factory=_troubles)

    def __attrs_post_init__(self) -> None:
        if self.service is not None:
            self._methods = methods(self.service)

    async def run(self) -> None:
        """Dispatch events until cancelled."""
        frontend = self.frontend
        fd = frontend.wake_fd
        handlers: dict[int, Callable[[tuple[Any, ...]], None]] = {
            _native.HTTP: self._on_http,
            _native.UNARY: self._on_unary,
            _native.STREAM_OPEN: self._on_stream_open,
            _native.STREAM_MESSAGE: self._on_stream_message,
            _native.STREAM_END: self._on_stream_end,
            _native.CANCEL: self._on_cancel,
            _native.CREDIT: self._on_credit,
            _native.TROUBLE: self._on_trouble,
        }
        while True:
            await trio.lowlevel.wait_readable(fd)
            for event in frontend.take():
                handlers[event[0]](event)

    async def wait_idle(self) -> None:
        """Wait until no request or stream is in flight."""
        while self._scopes:
            self._idle = trio.Event()
            await self._idle.wait()

    def _start(self, id_: int, fn: Callable[..., Any], *args: Any) -> None:
        scope = self._scopes[id_] = trio.CancelScope()
        self.nursery.start_soon(self._guarded, id_, scope, fn, *args)

    async def _guarded(
        self, id_: int, scope: trio.CancelScope, fn: Callable[..., Any], *args: Any
    ) -> None:
        try:
            with scope:
                await fn(id_, *args)
        finally:
            self._scopes.pop(id_, None)
            if not self._scopes:
                self._idle.set()

    def _on_trouble(self, event: tuple[Any, ...]) -> None:
        _, kind, detail = event
        self._troubles[kind].happened(detail)

    def _on_cancel(self, event: tuple[Any, ...]) -> None:
        scope = self._scopes.get(event[1])
        if scope is not None:
            scope.cancel()

    # HTTP

    def _on_http(self, event: tuple[Any, ...]) -> None:
        _, id_, method, target, headers, body = event
        if self.http is None:  # pragma: no cover - the front end listens for HTTP only with one
            self.frontend.respond(id_, 404, [], b"")
            return
        self._start(id_, self._answer_http, method, target, headers, body)

    async def _answer_http(
        self, id_: int, method: str, target: str, headers: list[tuple[bytes, bytes]], body: Any
    ) -> None:
        assert self.http is not None
        generation = self.tier.generation() if self.tier is not None else 0
        request = HttpRequest(
            method=method,
            path=urllib.parse.unquote(target.split("?", 1)[0]),
            headers=dict(headers),
            body=await _bytes(body),
        )
        answer = await self.http.handle(request)
        if isinstance(answer, StreamedAnswer):
            await self._stream_http(id_, answer)
            return
        status, answer_headers, chunks = answer
        cache = None
        if self.tier is not None and status == 200:
            cache = self.tier.storing(generation)
        await _handed_back(self.frontend.respond, id_, status, answer_headers, chunks, cache)

    async def _stream_http(self, id_: int, answer: StreamedAnswer) -> None:
        """Send a streamed answer's parts as they come, at most `HTTP_STREAM_CREDITS` ahead
        of what the connection has taken (each part taken returns a credit)."""
        frontend = self.frontend
        credits = self._http_credits[id_] = trio.Semaphore(HTTP_STREAM_CREDITS)
        try:
            async with contextlib.aclosing(answer.parts) as parts:
                if not frontend.respond_stream(id_, answer.status, answer.headers):
                    return  # the client has gone
                async for part in parts:
                    await credits.acquire()
                    if not frontend.stream_send(id_, part):
                        return
        finally:
            del self._http_credits[id_]
            # Ends the body (whatever ended the parts; nothing when the client has gone), so
            # no answer is left open in the hub.
            frontend.stream_close(id_, 0, "")

    # gRPC, unary

    def _on_unary(self, event: tuple[Any, ...]) -> None:
        _, id_, name, headers, message = event
        method = self._methods.get(name)
        if method is None or method.streaming:
            self.frontend.reply(
                id_, _UNIMPLEMENTED, f"Method not found: inference.GRPCInferenceService/{name}"
            )
            return
        self._start(id_, self._answer_unary, method, headers, message)

    async def _answer_unary(
        self, id_: int, method: Method, headers: list[tuple[bytes, bytes]], message: bytes
    ) -> None:
        context = _Context(_metadata(headers))
        generation = self.tier.generation() if self.tier is not None else 0
        try:
            message = await _bytes(message)
            response = await method.behaviour(method.deserialize(message), context)
            body = method.serialize(response)
        except _Aborted as aborted:
            self.frontend.reply(id_, aborted.code, aborted.details)
            return
        except Exception as exc:
            if not isinstance(exc, OrchestrionError):
                _log.error("gRPC call %s failed unexpectedly", method.name, exc_info=exc)
            code = grpc.StatusCode[grpc_status(exc)].value[0]
            self.frontend.reply(id_, code, error_message(exc))
            return
        cache = self.tier.storing(generation) if self.tier is not None else None
        await _handed_back(self.frontend.reply, id_, 0, "", body, cache)

    # gRPC, streams

    def _on_stream_open(self, event: tuple[Any, ...]) -> None:
        _, id_, name, headers = event
        method = self._methods.get(name)
        if method is None or not method.streaming or self.service is None:
            self.frontend.stream_close(
                id_, _UNIMPLEMENTED, f"Method not found: inference.GRPCInferenceService/{name}"
            )
            return
        metadata = _metadata(headers)
        header = _header_of(metadata)
        refusal = self.service.restrictions.refusal(method.category, header)
        if refusal is not None:
            self.frontend.stream_close(id_, _UNAVAILABLE, refusal)
            return
        stream = _NativeStream(self, id_, method, header("traceparent"), status_on_error(metadata))
        self._streams[id_] = stream
        self._start(id_, stream.run)

    def _on_stream_message(self, event: tuple[Any, ...]) -> None:
        stream = self._streams.get(event[1])
        if stream is not None:
            stream.arrived(event[2])

    def _on_stream_end(self, event: tuple[Any, ...]) -> None:
        stream = self._streams.get(event[1])
        if stream is not None:
            stream.input_ended(event[2])

    def _on_credit(self, event: tuple[Any, ...]) -> None:
        stream = self._streams.get(event[1])
        if stream is not None:
            stream.stream.credit.release()
            return
        credits = self._http_credits.get(event[1])
        if credits is not None:
            credits.release()

    def stop_streams(self) -> None:
        """A graceful stop of every open stream (see `InferenceService.stop_streams`)."""
        if self.service is not None:
            self.service.stop_streams()


_LARGE = 1024 * 1024
"""Bodies larger than this cross between the front end and Python in a worker thread: the
copy of tens of MiB (whose fresh pages a VM backs slowly) must not hold the event loop."""


async def _bytes(data: Any) -> bytes:
    """A request's body or message as bytes: a large one (the front end's ``Body``) is
    copied out in a worker thread."""
    if isinstance(data, bytes):
        return data
    taken: bytes = await trio.to_thread.run_sync(data.take)
    return taken


async def _handed_back(hand: Callable[..., Any], *args: Any) -> None:
    """``hand(*args)``: an answer handed to the front end, in a worker thread when large."""
    answer = args[3]  # respond's chunks, reply's message
    if answer is None:
        size = 0
    elif isinstance(answer, bytes | bytearray | memoryview):
        size = memoryview(answer).nbytes
    else:
        size = sum(memoryview(chunk).nbytes for chunk in answer)
    if size > _LARGE:
        await trio.to_thread.run_sync(hand, *args)
    else:
        hand(*args)


def _header_of(metadata: list[tuple[str, str]]) -> Callable[[str], str | None]:
    def header(name: str) -> str | None:
        for key, value in metadata:
            if key == name:
                return value
        return None

    return header


@attrs.define(eq=False)
class _NativeStream:
    """One ModelStreamInfer stream: the front end's messages fed to a `Stream`, its
    responses sent back as they come."""

    dispatcher: _Dispatcher
    id: int
    method: Method
    traceparent: str | None
    status_on_error: bool
    stream: Stream = attrs.field(init=False)
    _arrived: collections.deque[bytes] = attrs.field(factory=collections.deque)
    """Messages handed over and not yet submitted (at most the front end's read-ahead)."""
    _more: trio.Event = attrs.field(factory=trio.Event)
    _ended: bool = False
    _error: str | None = None

    def __attrs_post_init__(self) -> None:
        service = self.dispatcher.service
        assert service is not None
        self.stream = Stream(
            service.server,
            self._post,
            service._streams,
            service._wire,
            status_on_error=self.status_on_error,
        )

    def _post(self, item: Any) -> None:
        frontend = self.dispatcher.frontend
        if item is END:
            ending = self.stream.ending()  # a graceful stop; triton_grpc_error's first error
            if ending is None and self._error is not None:
                ending = ("INTERNAL", self._error)  # the client's framing broke
            code, message = ending or ("OK", "")
            frontend.stream_close(self.id, getattr(grpc.StatusCode, code).value[0], message)
            return
        frontend.stream_send(self.id, item.SerializeToString())

    def arrived(self, message: bytes) -> None:
        """A message of the stream arrived."""
        self._arrived.append(message)
        self._more.set()

    def input_ended(self, error: str | None) -> None:
        """The client half-closed the stream (``error``: its framing broke)."""
        self._ended = True
        self._error = error
        self._more.set()

    async def run(self, id_: int) -> None:
        """Serve the stream until its input ends and every answer is out."""
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._read)
                await self.stream.run()
        finally:
            self.dispatcher._streams.pop(self.id, None)

    async def _read(self) -> None:
        try:
            while True:
                while self._arrived:
                    message = self.method.deserialize(self._arrived.popleft())
                    await self.stream.submit(message, self.traceparent)
                    # Taken up: the front end may read one more (memory stays bounded, and
                    # a client that sends faster than the stream runs meets flow control).
                    self.dispatcher.frontend.stream_read(self.id, 1)
                    if self.stream.stopping:
                        self._arrived.clear()
                        break
                if self._ended or self.stream.stopping:
                    break
                self._more = trio.Event()
                await self._more.wait()
        finally:
            await self.stream.close_input()


def _listen(
    frontend: Any,
    http_address: tuple[str, int] | None,
    grpc_address: tuple[str, int] | None,
    *,
    max_message_size: int,
    reuse_port: bool,
    **http_limits: Any,
) -> tuple[str | None, str | None]:
    """Bind the listeners; where HTTP and gRPC listen (``host:port``, None: not served).

    Raises:
        ConfigError: an address cannot be bound.
    """
    http_at = grpc_at = None
    if http_address is not None:
        host, port = http_address
        try:
            bound = frontend.listen_http(host, port, reuse_port=reuse_port, **http_limits)
        except OSError as exc:
            raise ConfigError(f"cannot serve HTTP on {host}:{port}: {exc}") from None
        http_at = f"{host}:{bound}"
    if grpc_address is not None:
        host, port = grpc_address
        try:
            bound = frontend.listen_grpc(
                host, port, max_message=max_message_size, reuse_port=reuse_port
            )
        except OSError as exc:
            raise ConfigError(f"cannot serve gRPC on {host}:{port}: {exc}") from None
        grpc_at = f"{host}:{bound}"
    return http_at, grpc_at


async def serve_native(
    *,
    http: HttpApi | None,
    http_address: tuple[str, int] | None,
    grpc_service: InferenceService | None,
    grpc_address: tuple[str, int] | None,
    max_body: int,
    body_timeout: float,
    body_min_rate: float,
    header_timeout: float,
    keep_alive: float = 75.0,
    max_connections: int,
    max_message_size: int,
    cache_tier_size: int = 0,
    threads: int = 2,
    reuse_port: bool = False,
    shutdown: Shutdown | None = None,
    exit_timeout: float = 30.0,
    task_status: trio.TaskStatus[tuple[str | None, str | None]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``http`` and ``grpc_service`` through the native front end until cancelled, or
    until ``shutdown`` is requested; reports ``(http, grpc)`` as ``host:port`` (None where
    not served) through ``task_status``.

    ``cache_tier_size``: bytes of answers the front end keeps and answers itself, for models
    whose responses the server caches (0: none; see `frontends._native_cache`).
    ``reuse_port``: bind with SO_REUSEPORT, to share the ports with other processes that do
    (the workers of ``orchestrion serve --workers``).

    A graceful stop: no new connections, open ones close once answered (HTTP/2: GOAWAY),
    streams refuse what they read next, requests in flight get ``exit_timeout`` seconds.

    Raises:
        ConfigError: an address cannot be bound, or the native front end is not installed.
    """
    if _native is None:
        raise ConfigError(
            "the native front end is not installed (pip install ./native, or --frontend python)"
        )
    frontend = _native.Frontend(threads)
    try:
        http_at, grpc_at = _listen(
            frontend,
            http_address,
            grpc_address,
            max_body=max_body,
            body_timeout=body_timeout,
            body_min_rate=body_min_rate,
            header_timeout=header_timeout,
            keep_alive=keep_alive,
            max_connections=max_connections,
            max_message_size=max_message_size,
            reuse_port=reuse_port,
        )
        server = http.server if http is not None else grpc_service.server if grpc_service else None
        with open_cache_tier(frontend, server, cache_tier_size) as tier:
            async with trio.open_nursery() as requests:
                dispatcher = _Dispatcher(frontend, http, grpc_service, requests, tier)
                requests.start_soon(dispatcher.run)
                stopping = trio.Event()

                def stop() -> None:
                    frontend.stop_accepting()
                    dispatcher.stop_streams()
                    stopping.set()

                with (shutdown or Shutdown()).on_request(stop):
                    task_status.started((http_at, grpc_at))
                    await stopping.wait()
                    # Every request answered, or exit_timeout passed.
                    with trio.move_on_after(exit_timeout if exit_timeout >= 0 else math.inf):
                        await dispatcher.wait_idle()
                    requests.cancel_scope.cancel()
    finally:
        # The answers' last bytes leave on the front end's threads: at most a second more.
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(frontend.close, _CLOSE_TIMEOUT)
