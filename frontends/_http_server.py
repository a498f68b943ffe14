"""A lean HTTP/1.1 server on trio, with h11 for the protocol: the transport of the HTTP API.

How this works: one task per connection reads with h11 (which does all the parsing, framing
and keep-alive rules), hands each complete request to the handler, and writes the answer in
one ``send_all``. While a POST is being handled, a watcher reads the socket: end-of-file means
the client went away, and the handler's work is cancelled (its model slots freed at once).
A graceful stop closes the listeners and the idle keep-alive connections at once, lets
requests being handled finish (then closes their connections), and after ``exit_timeout``
cancels what is left, answering each request it cuts off with a 503.

Limits, so that slow or silent clients cannot hold the server: at most ``max_connections``
connections at once (by default half the open-file limit, so descriptors remain for gRPC,
metrics, Redis and model files). At the limit, a newcomer first takes the place of the oldest
connection that has not sent a byte yet (closed without a word, as nginx does: such a
connection costs its client nothing to reopen, and the newcomer may be real); only when none
is left is the newcomer accepted, answered 503 and closed. A request head must arrive whole
within ``header_timeout`` (counted from the connection's start for its first request, from
the head's first byte for later ones); a body must make progress every ``body_timeout``
seconds and arrive whole by ``body_timeout`` seconds plus one second per ``body_min_rate``
bytes received (Apache's ``mod_reqtimeout`` ``body=...,MinRate=...``), so that a body
trickled a byte at a time cannot hold a connection for ever. Either way a 408 answers, the
connection closes, and one line is logged per episode of such clients. An idle keep-alive
connection closes silently after ``keep_alive``. A request with both
Content-Length and Transfer-Encoding is read as chunked (as RFC 9112 §6.1 allows), then its
connection is closed (as it requires), so nothing after its body is ever read as a request.
Running out of descriptors or connection slots logs one line per episode, not one per accept.

Why not hypercorn (which serves /metrics): its layers (a task per request, ASGI messages
through channels, timers per request) cost 273 µs of server CPU per ``GET /v2/health/live``
under perf_analyzer at concurrency 4; this loop costs 107 µs (docs/performance-history.md,
"The network front ends against Triton, before fusion", item 1; no script in bench/
measures it).

`HttpServer.serve` runs until `HttpServer.stop`; `orchestrion.frontends._http_api.serve_http_api`
binds the listeners and ties that stop to a `Shutdown`.
"""

from __future__ import annotations

import contextlib
import errno
import http
import logging
import math
import urllib.parse
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from typing import Any

import attrs
import h11
import trio

_log = logging.getLogger("orchestrion.http")

Headers = list[tuple[bytes, bytes]]
Answer = tuple[int, Headers, list[bytes | memoryview]]

MAX_HEADER_SIZE = 64 * 1024
"""The largest request line plus headers accepted (larger: 431/400 and close)."""
DEFAULT_HEADER_TIMEOUT = 60.0
"""Seconds a request head may take to arrive whole (nginx's ``client_header_timeout``)."""
DEFAULT_BODY_TIMEOUT = 60.0
"""Seconds a request body may go without progress (nginx's ``client_body_timeout``), and
the start of its whole deadline."""
DEFAULT_BODY_MIN_RATE = 500.0
"""Bytes per second a body must average: each extends its deadline by ``1 / rate`` seconds
(Apache's ``MinRate`` default)."""
MAX_DEFAULT_CONNECTIONS = 4096
"""The most connections `default_max_connections` allows, however high the file limit."""
_JOIN_LIMIT = 1 << 20
"""Answers up to this size go out in one ``send_all`` (one syscall)."""
_READ_SIZE = 65536
_HEAD_READ_SIZE = 8192
_LINGER_SECONDS = 2.0
_LINGER_BYTES = 4 << 20
"""After refusing a request: how long and how much to read before closing anyway."""
_TURN_AWAY_SECONDS = 1.0
_TURN_AWAY_QUIET = 0.05
"""How long a connection over the limit is kept for its 503 (sending, then lingering), and
how long the linger waits for a first byte from a client that has sent none."""
_EXPIRED_GRACE = 1.0
"""After the exit timeout: how long the 503s of the requests cut off may take to go out."""
_EVICTING = 32
"""Connections closed for newcomers that may be closing at once (their descriptors are still
open until their tasks run); more newcomers wait in the kernel's backlog meanwhile."""
_ACCEPT_RETRY = 0.1
_CAPACITY_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})
"""Errors of accept(2) that mean the process or system is out of something: retry later."""
_EPISODE_QUIET = 10.0
"""Seconds without accept failures after which the next failure is a new episode (logged)."""
_REASONS = {status.value: status.phrase.encode() for status in http.HTTPStatus}


def default_max_connections() -> int:
    """Half the soft open-file limit (``ulimit -n``), at most `MAX_DEFAULT_CONNECTIONS`: the
    other half stays for gRPC, metrics, Redis, model files and the refusals themselves."""
    try:
        import resource
    except ImportError:  # not POSIX
        return MAX_DEFAULT_CONNECTIONS
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft < 0:
        return MAX_DEFAULT_CONNECTIONS
    return max(1, min(soft // 2, MAX_DEFAULT_CONNECTIONS))


@attrs.frozen
class HttpRequest:
    """One complete HTTP request."""

    method: str
    path: str
    """Percent-decoded (tritonclient quotes model names), without the query string."""
    headers: dict[bytes, bytes]
    """Lower-case names; a repeated header keeps its last value."""
    body: bytes | bytearray


@attrs.frozen
class StreamedAnswer:
    """An answer whose body goes out in parts as they are made (server-sent events), with
    no length: chunked on HTTP/1.1. The transport that takes it owns ``parts``: it sends
    each part before it asks for the next (a client that reads slowly holds the producer
    back), and closes them when the answer ends or the client goes away."""

    status: int
    headers: Headers
    parts: AsyncGenerator[bytes, None]


Handler = Callable[[HttpRequest], Awaitable[Answer | StreamedAnswer]]


class BodyTooLarge(Exception):
    """The request body exceeds the server's limit."""


class _TooSlow(Exception):
    """The client took longer than its deadline to send a request head or body."""


@attrs.define(eq=False)
class _Episode:
    """Occurrences of one kind of trouble (slow clients, connections closed for newcomers),
    logged once when an episode starts: an episode ends after `_EPISODE_QUIET` quiet
    seconds, and the next line says how many the last one had."""

    what: str
    count: int = 0
    _last: float = -math.inf

    def happened(self, detail: str) -> None:
        """Count one occurrence; log it if it starts an episode."""
        now = trio.current_time()
        if now - self._last > _EPISODE_QUIET:
            before = f" (the last episode: {self.count})" if self.count else ""
            _log.warning("%s: %s; logged once per episode%s", self.what, detail, before)
            self.count = 0
        self.count += 1
        self._last = now


@attrs.define(eq=False)
class HttpServer:
    """Serves ``handler`` on listeners until `stop`; see the module docstring."""

    handler: Handler
    max_body: int
    on_error: Callable[[HttpRequest | None, int, str], Answer]
    """Makes the answer for a request the server refuses itself (status, message)."""
    keep_alive: float = 75.0
    """Seconds an idle connection is kept open."""
    header_timeout: float = DEFAULT_HEADER_TIMEOUT
    """Seconds a request head may take (408 beyond); see the module docstring."""
    body_timeout: float = DEFAULT_BODY_TIMEOUT
    """Seconds a request body may go without receiving a byte (408 beyond); the start of its
    whole deadline."""
    body_min_rate: float = DEFAULT_BODY_MIN_RATE
    """Bytes a second a body must average: each byte received extends its deadline by
    ``1 / body_min_rate`` seconds (408 beyond); 0: no deadline but ``body_timeout``'s."""
    max_connections: int = attrs.field(factory=default_max_connections)
    """Connections served at once; more take the place of silent ones, else get 503."""
    _stopping: bool = False
    _expired: bool = False
    _idle: set[trio.CancelScope] = attrs.field(factory=set)
    _silent: dict[trio.CancelScope, None] = attrs.field(factory=dict)
    """Connections waiting for their first byte, oldest first (an ordered set)."""
    _evicted: set[trio.CancelScope] = attrs.field(factory=set)
    """Silent connections closed for newcomers, not yet gone (counted in ``_active``)."""
    _evictions_done: trio.lowlevel.ParkingLot = attrs.field(factory=trio.lowlevel.ParkingLot)
    _slow: _Episode = attrs.field(
        factory=lambda: _Episode("HTTP clients too slow: a request head or body cut off, 408")
    )
    _evictions: _Episode = attrs.field(
        factory=lambda: _Episode(
            "HTTP connection limit reached: connections that sent nothing closed, oldest "
            "first, to serve new ones"
        )
    )
    _conversations: set[trio.CancelScope] = attrs.field(factory=set)
    _accepting: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    _active: int = 0
    _drained: trio.Event = attrs.field(factory=trio.Event)
    _turning_away: trio.Semaphore = attrs.field(init=False)
    _over_limit_since: float | None = None
    _turned_away: int = 0
    _last_accept_failure: float = -math.inf

    def __attrs_post_init__(self) -> None:
        # Each refusal holds a descriptor for up to _TURN_AWAY_SECONDS: bound them too.
        self._turning_away = trio.Semaphore(min(32, max(1, self.max_connections // 8)))

    async def serve(self, listeners: Sequence[trio.SocketListener], exit_timeout: float) -> None:
        """Accept connections until `stop`, then drain them (at most ``exit_timeout`` s)."""
        async with trio.open_nursery() as connections:
            try:
                with self._accepting:
                    async with trio.open_nursery() as acceptors:
                        for listener in listeners:
                            acceptors.start_soon(self._accept, listener, connections)
            finally:
                for listener in listeners:
                    await listener.aclose()
            with trio.move_on_after(exit_timeout):
                await self._drained.wait()
            if self._active:
                _log.warning(
                    "%d HTTP connections still busy after %s s: cancelled, their requests "
                    "answered 503",
                    self._active,
                    exit_timeout,
                )
                self._expired = True
                for scope in list(self._conversations):
                    scope.cancel()
                with trio.move_on_after(_EXPIRED_GRACE):
                    await self._drained.wait()
            connections.cancel_scope.cancel()

    def stop(self) -> None:
        """Stop accepting and close idle connections; busy ones close after their answer."""
        self._stopping = True
        self._accepting.cancel()
        for scope in list(self._idle):
            scope.cancel()
        if self._active == 0:
            self._drained.set()

    async def _accept(self, listener: trio.SocketListener, connections: trio.Nursery) -> None:
        # trio.serve_listeners, with a connection limit and one log line per episode of
        # accept failures (it logs each retry, with a traceback, ten times a second).
        while True:
            try:
                stream = await listener.accept()
            except OSError as exc:
                if exc.errno not in _CAPACITY_ERRNOS:
                    raise
                now = trio.current_time()
                if now - self._last_accept_failure > _EPISODE_QUIET:
                    _log.warning(
                        "cannot accept HTTP connections: %s (%s); retrying every %g s "
                        "(--http-max-connections is %d; logged once per episode)",
                        errno.errorcode.get(exc.errno or 0, exc.errno),
                        exc.strerror,
                        _ACCEPT_RETRY,
                        self.max_connections,
                    )
                self._last_accept_failure = now
                await trio.sleep(_ACCEPT_RETRY)
                continue
            if self._open() >= self.max_connections and self._silent:
                try:
                    await self._evict_silent()
                except BaseException:
                    await trio.aclose_forcefully(stream)
                    raise
            if self._open() >= self.max_connections:
                try:
                    await self._turning_away.acquire()  # the kernel's backlog holds the rest
                except BaseException:
                    await trio.aclose_forcefully(stream)
                    raise
                if self._open() >= self.max_connections:  # still, after that wait
                    connections.start_soon(self._turn_away, stream)
                    continue
                self._turning_away.release()
            self._active += 1  # now, not in the task: the next accept sees it
            connections.start_soon(self._connection, stream)

    def _open(self) -> int:
        """Connections held, less those closed for newcomers and on their way out."""
        return self._active - len(self._evicted)

    async def _evict_silent(self) -> None:
        """Close the oldest connection that has not sent a byte, for a newcomer (at most
        `_EVICTING` on their way out at once: the next waits for one to be gone)."""
        while len(self._evicted) >= _EVICTING:
            await self._evictions_done.park()
        if not self._silent:  # one spoke meanwhile
            return
        scope = next(iter(self._silent))
        del self._silent[scope]
        self._evicted.add(scope)
        scope.cancel()
        self._evictions.happened(
            f"{self._active} open, --http-max-connections {self.max_connections}"
        )

    def _connection_closed(self) -> None:
        # The episode of refusals ends once a quarter of the connections have closed, so a
        # server hovering at its limit does not log each time one closes and one arrives.
        self._active -= 1
        if self._stopping and self._active == 0:
            self._drained.set()
        if self._over_limit_since is not None and self._active <= self.max_connections * 3 // 4:
            _log.info(
                "HTTP connections back under the limit: %d turned away in %.0f s",
                self._turned_away,
                trio.current_time() - self._over_limit_since,
            )
            self._over_limit_since = None

    async def _turn_away(self, stream: trio.SocketStream) -> None:
        """Answer a connection over the limit with a 503, and close it."""
        if self._over_limit_since is None:  # an episode starts: one line for all of it
            self._over_limit_since = trio.current_time()
            self._turned_away = 0
            _log.warning(
                "HTTP connection limit reached (%d open, --http-max-connections %d): new "
                "connections get 503 while it is (logged once per episode)",
                self._active,
                self.max_connections,
            )
        self._turned_away += 1
        message = (
            f"too many connections: the server already holds {self._active} "
            "(--http-max-connections); retry later"
        )
        try:
            with trio.move_on_after(_TURN_AWAY_SECONDS):
                status, headers, chunks = self.on_error(None, 503, message)
                answer = (status, headers, chunks)
                await self._send(stream, h11.Connection(h11.SERVER), None, answer, close=True)
                await stream.send_eof()
                # Read until the client closes: closing with its request unread would reset
                # the connection before it reads the 503. One that has sent nothing yet is
                # closed sooner, so a flood of silent connections is turned away quickly.
                with trio.move_on_after(_TURN_AWAY_QUIET) as quiet:
                    data = await stream.receive_some(_READ_SIZE)
                drained = 0
                while not quiet.cancelled_caught and data and drained < _LINGER_BYTES:
                    drained += len(data)
                    data = await stream.receive_some(_READ_SIZE)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the client went away
        finally:
            self._turning_away.release()
            await trio.aclose_forcefully(stream)

    async def _connection(self, stream: trio.SocketStream) -> None:
        connection = h11.Connection(
            h11.SERVER, max_incomplete_event_size=MAX_HEADER_SIZE - _HEAD_READ_SIZE
        )
        scope = trio.CancelScope()
        self._conversations.add(scope)
        try:
            with scope:
                await self._converse(stream, connection)
            if scope.cancelled_caught and self._expired and self._cut_off(connection):
                await self._refuse(
                    stream,
                    connection,
                    None,
                    503,
                    "the server is shutting down: the request did not finish within the "
                    "exit timeout (--exit-timeout-secs)",
                )
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the client went away
        finally:
            self._conversations.discard(scope)
            self._connection_closed()
            await trio.aclose_forcefully(stream)

    @staticmethod
    def _cut_off(connection: h11.Connection) -> bool:
        """Whether a request had started (and has no answer yet) on ``connection``."""
        if connection.our_state is h11.SEND_RESPONSE:
            return True
        return connection.our_state is h11.IDLE and bool(
            connection.their_state is not h11.IDLE or connection.trailing_data[0]
        )

    async def _converse(self, stream: trio.SocketStream, connection: h11.Connection) -> None:
        first = True
        while not self._stopping:
            try:
                request = await self._read_request(stream, connection, first=first)
            except h11.RemoteProtocolError as exc:
                status = exc.error_status_hint
                await self._refuse(stream, connection, None, status, f"bad request: {exc}")
                return
            except (BodyTooLarge, _TooSlow) as exc:
                status = 413 if isinstance(exc, BodyTooLarge) else 408
                await self._refuse(stream, connection, None, status, str(exc))
                return
            if request is None:
                return
            first = False
            answer = await self._handle(stream, connection, request)
            if answer is None:
                return  # the client went away mid-request
            # Content-Length and Transfer-Encoding both: answer, then close (RFC 9112 §6.1).
            smuggling = b"transfer-encoding" in request.headers and (
                b"content-length" in request.headers
            )
            if isinstance(answer, StreamedAnswer):
                if smuggling:
                    return
            else:
                await self._send(stream, connection, request, answer, close=smuggling)
            if connection.our_state is h11.MUST_CLOSE or self._stopping or smuggling:
                return
            try:
                connection.start_next_cycle()
            except h11.LocalProtocolError:
                return

    async def _wait_for_request(
        self,
        stream: trio.SocketStream,
        connection: h11.Connection,
        deadline: float,
        *,
        first: bool,
    ) -> bool:
        """Wait (until ``deadline``, a stop, or, for the ``first`` request, a newcomer that
        needs the place) for a request's first bytes; False: none came, and the connection
        closes silently."""
        if connection.trailing_data[0] or connection.trailing_data[1]:
            return True  # pipelined, or end-of-file seen already
        with trio.move_on_at(deadline) as scope:
            self._idle.add(scope)
            if first:
                self._silent[scope] = None
            try:
                data = await stream.receive_some(_HEAD_READ_SIZE)
            finally:
                self._idle.discard(scope)
                self._silent.pop(scope, None)
                if scope in self._evicted:
                    self._evicted.discard(scope)  # its descriptor closes right after this
                    self._evictions_done.unpark()
        if scope.cancelled_caught:
            return False
        connection.receive_data(data)
        return True

    @staticmethod
    async def _next_event(
        stream: trio.SocketStream,
        connection: h11.Connection,
        size: int,
        *,
        deadline: float = math.inf,
        stall: float = math.inf,
    ) -> Any:
        """The next h11 event, reading at most ``size`` bytes at a time.

        Raises:
            _TooSlow: ``deadline`` passed, or a read waited ``stall`` seconds.
        """
        while True:
            event = connection.next_event()
            if event is not h11.NEED_DATA:
                return event
            with trio.move_on_at(min(deadline, trio.current_time() + stall)) as scope:
                data = await stream.receive_some(size)
            if scope.cancelled_caught:
                raise _TooSlow
            connection.receive_data(data)

    async def _read_request(  # noqa: C901 (per request: see docs/architecture.md)
        self, stream: trio.SocketStream, connection: h11.Connection, *, first: bool
    ) -> HttpRequest | None:
        start = trio.current_time()
        wait = self.header_timeout if first else self.keep_alive
        if not await self._wait_for_request(stream, connection, start + wait, first=first):
            return None
        if not first:
            start = trio.current_time()
        try:
            # Small reads while a head arrives: h11 refuses an incomplete head over its
            # limit, so a head is at most MAX_HEADER_SIZE bytes.
            event = await self._next_event(
                stream, connection, _HEAD_READ_SIZE, deadline=start + self.header_timeout
            )
        except _TooSlow:
            message = (
                f"the request head did not arrive within {self.header_timeout:g} s "
                "(--http-header-timeout)"
            )
            self._slow.happened(message)
            raise _TooSlow(message) from None
        if isinstance(event, h11.ConnectionClosed):
            return None
        assert isinstance(event, h11.Request)
        headers = {name: value for name, value in event.headers}
        declared = headers.get(b"content-length")
        if (
            declared is not None
            and b"transfer-encoding" not in headers  # chunked: Content-Length is ignored
            and int(declared) > self.max_body
        ):
            raise BodyTooLarge(self._too_large(int(declared)))
        if connection.they_are_waiting_for_100_continue:
            await stream.send_all(
                connection.send(h11.InformationalResponse(status_code=100, headers=[])) or b""
            )
        body = bytearray()  # grown in place: no join (one long copy) at the end
        size = 0
        body_start = trio.current_time()
        per_byte = 1 / self.body_min_rate if self.body_min_rate > 0 else 0.0
        while True:
            deadline = body_start + self.body_timeout + size * per_byte if per_byte else math.inf
            try:
                part = await self._next_event(
                    stream, connection, _READ_SIZE, deadline=deadline, stall=self.body_timeout
                )
            except _TooSlow:
                raise self._slow_body(size, body_start, deadline) from None
            if isinstance(part, h11.Data):
                size += len(part.data)
                if size > self.max_body:
                    raise BodyTooLarge(self._too_large(size))
                body += part.data
            elif isinstance(part, h11.EndOfMessage):
                break
            elif isinstance(part, h11.ConnectionClosed):
                return None
        return HttpRequest(
            method=event.method.decode("ascii", "replace"),
            path=urllib.parse.unquote(event.target.decode("latin-1").split("?", 1)[0]),
            headers=headers,
            body=body,
        )

    def _slow_body(self, size: int, start: float, deadline: float) -> _TooSlow:
        """The error (and the episode's log line) for a body that came too slowly."""
        now = trio.current_time()
        if now >= deadline:
            message = (
                f"the request body arrived too slowly: {size} bytes in {now - start:.0f} s, "
                f"below {self.body_min_rate:g} bytes/s after the first "
                f"{self.body_timeout:g} s (--http-body-min-rate, --http-body-timeout)"
            )
        else:
            message = (
                f"the request body made no progress for {self.body_timeout:g} s "
                f"({size} bytes received; --http-body-timeout)"
            )
        self._slow.happened(message)
        return _TooSlow(message)

    def _too_large(self, size: int) -> str:
        return (  # Triton's words: clients match on them
            f"request JSON size of {size} bytes exceeds the maximum allowed input size of "
            f"{self.max_body} bytes. Use --http-max-input-size to increase the limit."
        )

    async def _handle(
        self, stream: trio.SocketStream, connection: h11.Connection, request: HttpRequest
    ) -> Answer | StreamedAnswer | None:
        """The answer to ``request`` (a streamed one sent already), or None: the client went
        away."""
        if request.method in ("GET", "HEAD"):
            answer = await self.handler(request)
            if isinstance(answer, StreamedAnswer):
                await self._send_streamed(stream, connection, request, answer)
            return answer
        # A POST may run long: watch the socket, and cancel the work if the client leaves.
        result: Answer | StreamedAnswer | None = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._watch, stream, connection, nursery.cancel_scope)
            result = await self.handler(request)
            if isinstance(result, StreamedAnswer):
                try:
                    await self._send_streamed(stream, connection, request, result)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    result = None  # the client went away mid-answer
            nursery.cancel_scope.cancel()
        return result if not self._gone(connection) else None

    async def _send_streamed(
        self,
        stream: trio.SocketStream,
        connection: h11.Connection,
        request: HttpRequest,
        answer: StreamedAnswer,
    ) -> None:
        """Send ``answer``'s head, then each part as it comes (no length: h11 chunks it for
        an HTTP/1.1 client, and closes after it for an HTTP/1.0 one)."""
        async with contextlib.aclosing(answer.parts) as parts:
            headers = list(answer.headers)
            if self._stopping:
                headers.append((b"connection", b"close"))
            reason = _REASONS.get(answer.status, b"")
            head = h11.Response(status_code=answer.status, headers=headers, reason=reason)
            await stream.send_all(connection.send(head) or b"")
            if request.method != "HEAD":
                async for part in parts:
                    if part:
                        await stream.send_all(connection.send(h11.Data(data=part)) or b"")
            await stream.send_all(connection.send(h11.EndOfMessage()) or b"")

    async def _watch(
        self, stream: trio.SocketStream, connection: h11.Connection, scope: trio.CancelScope
    ) -> None:
        while True:
            try:
                data = await stream.receive_some(_READ_SIZE)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                data = b""  # reset by the client: gone as much as one that closed
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
        *,
        close: bool = False,
    ) -> None:
        status, headers, chunks = answer
        length = sum(len(c) for c in chunks)
        head_only = request is not None and request.method == "HEAD"
        out: list[Any] = []
        extra: Headers = [(b"content-length", str(length).encode())]
        if close or self._stopping:
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
                # At most _JOIN_LIMIT bytes a call: one send of a whole large answer copies
                # as much as the socket takes in one syscall, on the event loop.
                view = memoryview(part).cast("B")
                for start in range(0, len(view), _JOIN_LIMIT):
                    await stream.send_all(view[start : start + _JOIN_LIMIT])

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
            await self._send(stream, connection, request, (status, headers, chunks), close=True)
        # A lingering close: the client may still be sending (a body or head we refused);
        # closing now would reset the connection before it reads the answer.
        await stream.send_eof()
        with trio.move_on_after(_LINGER_SECONDS):
            drained = 0
            while drained < _LINGER_BYTES and (data := await stream.receive_some(_READ_SIZE)):
                drained += len(data)
