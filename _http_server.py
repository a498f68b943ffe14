"""A lean HTTP/1.1 server on trio, with h11 for the protocol: the transport of the HTTP API.

How this works: one task per connection reads with h11 (which does all the parsing, framing
and keep-alive rules), hands each complete request to the handler, and writes the answer in
one ``send_all``. While a POST is being handled, a watcher reads the socket: end-of-file means
the client went away, and the handler's work is cancelled (its model slots freed at once).
A graceful stop closes the listeners and the idle keep-alive connections at once, lets
requests being handled finish (then closes their connections), and after ``exit_timeout``
cancels what is left.

Why not hypercorn (which serves /metrics): its layers (a task per request, ASGI messages
through channels, timers per request) cost ~270 µs of CPU for ``GET /v2/health/live`` here;
this loop costs a fraction of that (bench/network.py measures both).
"""

from __future__ import annotations

import contextlib
import http
import logging
import urllib.parse
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import attrs
import h11
import trio

_log = logging.getLogger("orchestrion.http")

Headers = list[tuple[bytes, bytes]]
Answer = tuple[int, Headers, list[bytes | memoryview]]

MAX_HEADER_SIZE = 64 * 1024
"""The largest request line plus headers accepted (larger: 431/400 and close)."""
_JOIN_LIMIT = 1 << 20
"""Answers up to this size go out in one ``send_all`` (one syscall)."""
_READ_SIZE = 65536
_HEAD_READ_SIZE = 8192
_LINGER_SECONDS = 2.0
_LINGER_BYTES = 4 << 20
"""After refusing a request: how long and how much to read before closing anyway."""
_REASONS = {status.value: status.phrase.encode() for status in http.HTTPStatus}


@attrs.frozen
class HttpRequest:
    """One complete HTTP request."""

    method: str
    path: str
    """Percent-decoded (tritonclient quotes model names), without the query string."""
    headers: dict[bytes, bytes]
    """Lower-case names; a repeated header keeps its last value."""
    body: bytes


Handler = Callable[[HttpRequest], Awaitable[Answer]]


class BodyTooLarge(Exception):
    """The request body exceeds the server's limit."""


@attrs.define(eq=False)
class HttpServer:
    """Serves ``handler`` on listeners until `stop`; see the module docstring."""

    handler: Handler
    max_body: int
    on_error: Callable[[HttpRequest | None, int, str], Answer]
    """Makes the answer for a request the server refuses itself (status, message)."""
    keep_alive: float = 75.0
    """Seconds an idle connection is kept open."""
    _stopping: bool = False
    _idle: set[trio.CancelScope] = attrs.field(factory=set)
    _accepting: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    _active: int = 0
    _drained: trio.Event = attrs.field(factory=trio.Event)

    async def serve(self, listeners: Sequence[trio.SocketListener], exit_timeout: float) -> None:
        """Accept connections until `stop`, then drain them (at most ``exit_timeout`` s)."""
        async with trio.open_nursery() as connections:
            try:
                with self._accepting:
                    await trio.serve_listeners(
                        self._connection, list(listeners), handler_nursery=connections
                    )
            finally:
                for listener in listeners:
                    await listener.aclose()
            with trio.move_on_after(exit_timeout):
                await self._drained.wait()
            if self._active:
                _log.warning(
                    "%d HTTP connections still busy after %s s: cancelled",
                    self._active,
                    exit_timeout,
                )
            connections.cancel_scope.cancel()

    def stop(self) -> None:
        """Stop accepting and close idle connections; busy ones close after their answer."""
        self._stopping = True
        self._accepting.cancel()
        for scope in list(self._idle):
            scope.cancel()
        if self._active == 0:
            self._drained.set()

    async def _connection(self, stream: trio.SocketStream) -> None:
        self._active += 1
        try:
            await self._converse(stream)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the client went away
        finally:
            self._active -= 1
            if self._stopping and self._active == 0:
                self._drained.set()
            await trio.aclose_forcefully(stream)

    async def _converse(self, stream: trio.SocketStream) -> None:
        connection = h11.Connection(
            h11.SERVER, max_incomplete_event_size=MAX_HEADER_SIZE - _HEAD_READ_SIZE
        )
        while not self._stopping:
            try:
                request = await self._read_request(stream, connection)
            except h11.RemoteProtocolError as exc:
                status = exc.error_status_hint
                await self._refuse(stream, connection, None, status, f"bad request: {exc}")
                return
            except BodyTooLarge as exc:
                await self._refuse(stream, connection, None, 413, str(exc))
                return
            if request is None:
                return
            answer = await self._handle(stream, connection, request)
            if answer is None:
                return  # the client went away mid-request
            await self._send(stream, connection, request, answer)
            if connection.our_state is h11.MUST_CLOSE or self._stopping:
                return
            try:
                connection.start_next_cycle()
            except h11.LocalProtocolError:
                return

    async def _next_event(
        self, stream: trio.SocketStream, connection: h11.Connection, *, idle: bool
    ) -> Any:
        while True:
            event = connection.next_event()
            if event is not h11.NEED_DATA:
                return event
            if idle:
                # Waiting for the next request: a stop (or the keep-alive limit) ends it.
                with trio.move_on_after(self.keep_alive) as scope:
                    self._idle.add(scope)
                    try:
                        # Small reads while a head arrives: h11 refuses an incomplete head
                        # over its limit, so a head is at most MAX_HEADER_SIZE bytes.
                        data = await stream.receive_some(_HEAD_READ_SIZE)
                    finally:
                        self._idle.discard(scope)
                if scope.cancelled_caught:
                    return None
            else:
                data = await stream.receive_some(_READ_SIZE)
            connection.receive_data(data)

    async def _read_request(
        self, stream: trio.SocketStream, connection: h11.Connection
    ) -> HttpRequest | None:
        event = await self._next_event(stream, connection, idle=True)
        if event is None or isinstance(event, h11.ConnectionClosed):
            return None
        assert isinstance(event, h11.Request)
        headers = {name: value for name, value in event.headers}
        declared = headers.get(b"content-length")
        if declared is not None and int(declared) > self.max_body:
            raise BodyTooLarge(self._too_large(int(declared)))
        if connection.they_are_waiting_for_100_continue:
            await stream.send_all(
                connection.send(h11.InformationalResponse(status_code=100, headers=[])) or b""
            )
        parts: list[bytes] = []
        size = 0
        while True:
            part = await self._next_event(stream, connection, idle=False)
            if isinstance(part, h11.Data):
                size += len(part.data)
                if size > self.max_body:
                    raise BodyTooLarge(self._too_large(size))
                parts.append(bytes(part.data))
            elif isinstance(part, h11.EndOfMessage):
                break
            elif isinstance(part, h11.ConnectionClosed):
                return None
        return HttpRequest(
            method=event.method.decode("ascii", "replace"),
            path=urllib.parse.unquote(event.target.decode("latin-1").split("?", 1)[0]),
            headers=headers,
            body=parts[0] if len(parts) == 1 else b"".join(parts),
        )

    def _too_large(self, size: int) -> str:
        return (
            f"request body of {size} bytes exceeds the maximum input size of "
            f"{self.max_body} bytes (--http-max-input-size)"
        )

    async def _handle(
        self, stream: trio.SocketStream, connection: h11.Connection, request: HttpRequest
    ) -> Answer | None:
        if request.method in ("GET", "HEAD"):
            return await self.handler(request)
        # A POST may run long: watch the socket, and cancel the work if the client leaves.
        answer: Answer | None = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._watch, stream, connection, nursery.cancel_scope)
            answer = await self.handler(request)
            nursery.cancel_scope.cancel()
        return answer if not self._gone(connection) else None

    async def _watch(
        self, stream: trio.SocketStream, connection: h11.Connection, scope: trio.CancelScope
    ) -> None:
        while True:
            data = await stream.receive_some(_READ_SIZE)
            connection.receive_data(data)  # a pipelined request waits in h11's buffer
            if not data:
                scope.cancel()
                return
            if len(connection.trailing_data[0]) > self.max_body + MAX_HEADER_SIZE:
                return  # stop reading: TCP holds the rest back until this answer is sent

    @staticmethod
    def _gone(connection: h11.Connection) -> bool:
        return connection.their_state is h11.CLOSED or (
            connection.their_state is h11.DONE and connection.trailing_data[1]
        )

    async def _send(
        self,
        stream: trio.SocketStream,
        connection: h11.Connection,
        request: HttpRequest | None,
        answer: Answer,
    ) -> None:
        status, headers, chunks = answer
        length = sum(len(c) for c in chunks)
        head_only = request is not None and request.method == "HEAD"
        out: list[Any] = []
        extra: Headers = [(b"content-length", str(length).encode())]
        if self._stopping:
            extra.append((b"connection", b"close"))
        reason = _REASONS.get(status, b"")
        out.append(
            connection.send(
                h11.Response(status_code=status, headers=headers + extra, reason=reason)
            )
        )
        if not head_only:
            for chunk in chunks:
                if len(chunk):
                    data: Any = chunk  # h11 passes buffers through untouched
                    out.extend(connection.send_with_data_passthrough(h11.Data(data=data)) or ())
        out.append(connection.send(h11.EndOfMessage()))
        if length <= _JOIN_LIMIT or head_only:
            await stream.send_all(b"".join(out))
        else:
            for part in out:
                await stream.send_all(part)

    async def _refuse(
        self,
        stream: trio.SocketStream,
        connection: h11.Connection,
        request: HttpRequest | None,
        status: int,
        message: str,
    ) -> None:
        """Answer an error the server decides itself, then close the connection."""
        if connection.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            return
        status, headers, chunks = self.on_error(request, status, message)
        with contextlib.suppress(h11.LocalProtocolError):
            await self._send(
                stream, connection, request, (status, [*headers, (b"connection", b"close")], chunks)
            )
        # A lingering close: the client may still be sending (a body or head we refused);
        # closing now would reset the connection before it reads the answer.
        await stream.send_eof()
        with trio.move_on_after(_LINGER_SECONDS):
            drained = 0
            while drained < _LINGER_BYTES and (data := await stream.receive_some(_READ_SIZE)):
                drained += len(data)
