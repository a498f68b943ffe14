"""`HttpServer` (the HTTP/1.1 loop under the inference API) over trio's in-memory streams, with
a virtual clock: request parsing, keep-alive and pipelining, Content-Length and chunked bodies,
the refusals it answers itself (400, 408, 413, 431, 503), its timeouts, the connection limit,
a client leaving mid-request, and the graceful stop. No socket, no child process: each test
takes milliseconds, and a hang is a virtual timeout (`trio.fail_after` under the autojump
clock), never a stuck run."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import attrs
import pytest
import trio
import trio.testing

from orchestrion.frontends._http_server import MAX_HEADER_SIZE, Answer, HttpRequest, HttpServer

GET = b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n"


@attrs.define(eq=False)
class MemoryListener(trio.abc.Listener[trio.abc.Stream]):
    """A listener whose connections are in-memory stream pairs: `connect` makes one and hands
    its server end to the server's next ``accept``."""

    _send: trio.MemorySendChannel[trio.abc.Stream]
    _receive: trio.MemoryReceiveChannel[trio.abc.Stream]

    @classmethod
    def open(cls) -> MemoryListener:
        """A listener that nobody has connected to yet."""
        send, receive = trio.open_memory_channel[trio.abc.Stream](100)
        return cls(send, receive)

    async def connect(self) -> Client:
        """A new connection; the server accepts it when it next accepts."""
        client, server = trio.testing.memory_stream_pair()
        await self._send.send(server)
        return Client(client)

    async def accept(self) -> trio.abc.Stream:
        return await self._receive.receive()

    async def aclose(self) -> None:
        await self._receive.aclose()


@attrs.frozen
class Reply:
    """One HTTP answer as the client read it."""

    status: int
    reason: bytes
    headers: dict[bytes, bytes]
    """Lower-case names."""
    body: bytes

    def error(self) -> str:
        """The message of the JSON error body that `refuse` makes."""
        return str(json.loads(self.body)["error"])


@attrs.define(eq=False)
class Client:
    """The client end of one in-memory connection, reading answers with their framing."""

    stream: trio.abc.HalfCloseableStream
    _buffer: bytearray = attrs.field(factory=bytearray)

    async def send(self, data: bytes) -> None:
        """Send ``data`` (not necessarily a whole request)."""
        await self.stream.send_all(data)

    async def _more(self) -> bool:
        data = await self.stream.receive_some()
        self._buffer += data
        return bool(data)

    async def reply(self, *, head: bool = False) -> Reply:
        """The next answer (its head only, for a HEAD request: its body is never sent).

        Raises:
            AssertionError: the server closed the connection before a whole answer.
        """
        while b"\r\n\r\n" not in self._buffer:
            assert await self._more(), f"closed before an answer: {bytes(self._buffer)!r}"
        end = self._buffer.index(b"\r\n\r\n")
        lines = bytes(self._buffer[:end]).split(b"\r\n")
        del self._buffer[: end + 4]
        version, status, reason = lines[0].split(b" ", 2)
        assert version == b"HTTP/1.1", lines[0]
        headers = {}
        for line in lines[1:]:
            name, value = line.split(b":", 1)
            headers[name.strip().lower()] = value.strip()
        length = 0 if head or int(status) < 200 else int(headers[b"content-length"])
        while len(self._buffer) < length:
            assert await self._more(), f"closed mid-body: {bytes(self._buffer)!r}"
        body = bytes(self._buffer[:length])
        del self._buffer[:length]
        return Reply(int(status), reason, headers, body)

    async def closed(self) -> bool:
        """Whether the server closes the connection with nothing (more) sent."""
        more = await self._more()
        return not more and not self._buffer

    async def aclose(self) -> None:
        """Close both directions, as a client that goes away."""
        await self.stream.aclose()


def refuse(request: HttpRequest | None, status: int, message: str) -> Answer:
    """The server's answer to what it refuses itself: a JSON error body."""
    return (
        status,
        [(b"content-type", b"application/json")],
        [json.dumps({"error": message}).encode()],
    )


@attrs.define(eq=False)
class Handler:
    """Records each request and answers ``200`` with ``body`` (by default the request's body)."""

    body: list[bytes | memoryview] | None = None
    gate: trio.Event | None = None
    """When set: each request waits for it before being answered."""
    requests: list[HttpRequest] = attrs.field(factory=list)
    started: trio.Event = attrs.field(factory=trio.Event)
    cancelled: trio.Event = attrs.field(factory=trio.Event)

    async def __call__(self, request: HttpRequest) -> Answer:
        self.requests.append(request)
        self.started.set()
        if self.gate is not None:
            try:
                await self.gate.wait()
            except trio.Cancelled:
                self.cancelled.set()
                raise
        body = self.body if self.body is not None else [request.body]
        return 200, [(b"content-type", b"application/octet-stream")], body


@attrs.define(eq=False)
class Serving:
    """A running `HttpServer` on a `MemoryListener`; ``done`` is set once ``serve`` returns."""

    server: HttpServer
    listener: MemoryListener
    handler: Handler
    done: trio.Event = attrs.field(factory=trio.Event)

    async def connect(self) -> Client:
        """A new connection, accepted by the server before this returns."""
        client = await self.listener.connect()
        await trio.testing.wait_all_tasks_blocked()
        return client


@contextlib.asynccontextmanager
async def serving(
    handler: Handler | None = None, *, exit_timeout: float = 30.0, **options: Any
) -> AsyncIterator[Serving]:
    """An `HttpServer` (``max_body`` 1 MiB unless given) serving until the block ends; every
    test's block must end within 600 virtual seconds."""
    options.setdefault("max_body", 1 << 20)
    handler = handler or Handler()
    state = Serving(
        HttpServer(handler=handler, on_error=refuse, **options), MemoryListener.open(), handler
    )

    async def serve() -> None:
        try:
            # `serve` is typed for socket listeners; it only calls accept() and aclose().
            await state.server.serve([state.listener], exit_timeout)
        finally:
            state.done.set()

    with trio.fail_after(600):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve)
            yield state
            state.server.stop()


# -- parsing -------------------------------------------------------------------------------


async def test_a_request_reaches_the_handler_parsed(autojump_clock: trio.testing.MockClock) -> None:
    """The handler gets the method, the percent-decoded path without its query, lower-case
    header names (a repeated header keeps its last value) and the body; the answer has its
    reason phrase and Content-Length."""
    async with serving() as s:
        client = await s.connect()
        await client.send(
            b"POST /v2/models/a%20b/infer?x=1 HTTP/1.1\r\nHost: x\r\nX-Twice: 1\r\n"
            b"X-Twice: 2\r\nX-Case: MiXed\r\nContent-Length: 5\r\n\r\nhello"
        )
        reply = await client.reply()
    (request,) = s.handler.requests
    assert request.method == "POST"
    assert request.path == "/v2/models/a b/infer"
    assert request.headers[b"x-twice"] == b"2"
    assert request.headers[b"x-case"] == b"MiXed"
    assert request.body == b"hello"
    assert (reply.status, reply.reason) == (200, b"OK")
    assert reply.headers[b"content-length"] == b"5"
    assert reply.body == b"hello"


async def test_a_body_split_over_many_sends_or_chunked_arrives_whole(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A Content-Length body sent in pieces, then a chunked one on the same connection: the
    handler gets each body whole, de-chunked."""
    async with serving() as s:
        client = await s.connect()
        for piece in (b"POST / HTTP/1.1\r\nHost: x\r\nContent-Le", b"ngth: 6\r\n\r\nab", b"cdef"):
            await client.send(piece)
            await trio.sleep(0.1)
        first = await client.reply()
        await client.send(
            b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"3\r\nxyz\r\n2\r\n12\r\n0\r\n\r\n"
        )
        second = await client.reply()
    assert [r.body for r in s.handler.requests] == [b"abcdef", b"xyz12"]
    assert (first.body, second.body) == (b"abcdef", b"xyz12")


async def test_keep_alive_answers_requests_in_order_pipelined_too(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Three requests sent at once on one connection are answered in order, and the
    connection then serves a fourth."""
    handler = Handler(body=None)
    async with serving(handler) as s:
        client = await s.connect()
        await client.send(
            b"".join(
                b"POST /%d HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\n%d" % (i, i)
                for i in range(3)
            )
        )
        bodies = [(await client.reply()).body for _ in range(3)]
        await client.send(GET)
        last = await client.reply()
    assert bodies == [b"0", b"1", b"2"]
    assert [r.path for r in s.handler.requests] == ["/0", "/1", "/2", "/v2/health/live"]
    assert last.status == 200
    assert b"connection" not in last.headers


@pytest.mark.parametrize(
    "request_head",
    [
        b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        b"GET / HTTP/1.0\r\n\r\n",
    ],
    ids=["connection close", "HTTP/1.0"],
)
async def test_a_client_that_asks_to_close_gets_its_answer_then_a_close(
    autojump_clock: trio.testing.MockClock, request_head: bytes
) -> None:
    """``Connection: close`` or HTTP/1.0: the answer says ``connection: close``, and the
    server closes the connection after it."""
    async with serving() as s:
        client = await s.connect()
        await client.send(request_head)
        reply = await client.reply()
        assert await client.closed()
    assert reply.status == 200
    assert reply.headers[b"connection"] == b"close"


async def test_head_answers_carry_the_length_but_no_body(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """HEAD: the answer's Content-Length is the body's, but no body follows (the next answer
    on the connection starts right after the head)."""
    async with serving(Handler(body=[b"hello"])) as s:
        client = await s.connect()
        await client.send(b"HEAD / HTTP/1.1\r\nHost: x\r\n\r\n" + GET)
        head = await client.reply(head=True)
        after = await client.reply()
    assert (head.status, head.headers[b"content-length"]) == (200, b"5")
    assert after.body == b"hello"


async def test_expect_100_continue_gets_an_interim_answer_first(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A client that waits for ``100 Continue`` gets it before it sends its body."""
    async with serving() as s:
        client = await s.connect()
        await client.send(
            b"POST / HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 3\r\n\r\n"
        )
        interim = await client.reply()
        await client.send(b"abc")
        final = await client.reply()
    assert interim.status == 100
    assert (final.status, final.body) == (200, b"abc")


async def test_large_answers_arrive_whole(autojump_clock: trio.testing.MockClock) -> None:
    """An answer of several chunks over 1 MiB (sent chunk by chunk, a memoryview and an empty
    chunk among them) arrives whole, with the right Content-Length."""
    chunks: list[bytes | memoryview] = [b"a" * (1 << 20), b"", memoryview(b"b" * 700_000), b"c"]
    async with serving(Handler(body=chunks)) as s:
        client = await s.connect()
        await client.send(GET)
        reply = await client.reply()
    assert reply.headers[b"content-length"] == str((1 << 20) + 700_001).encode()
    assert reply.body == b"a" * (1 << 20) + b"b" * 700_000 + b"c"


# -- what the server refuses itself ----------------------------------------------------------


@pytest.mark.parametrize(
    ("request_head", "status"),
    [
        (b"NOT A REQUEST\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\n\r\n", 400),
        (b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: ten\r\n\r\n", 400),
        (b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n", 501),
    ],
    ids=["no request line", "bad header line", "no Host", "bad Content-Length", "unknown TE"],
)
async def test_a_malformed_head_is_refused_then_closed(
    autojump_clock: trio.testing.MockClock, request_head: bytes, status: int
) -> None:
    """A head h11 cannot accept gets its status hint (400; 501 for a transfer coding other than
    chunked) and an error saying ``bad request``, with ``connection: close``; the handler never
    sees it and the connection closes."""
    async with serving() as s:
        client = await s.connect()
        await client.send(request_head)
        reply = await client.reply()
        assert await client.closed()
    assert reply.status == status, reply
    assert reply.error().startswith("bad request: "), reply
    assert reply.headers[b"connection"] == b"close"
    assert s.handler.requests == []


async def test_a_head_over_the_size_limit_is_431(autojump_clock: trio.testing.MockClock) -> None:
    """A request head larger than `MAX_HEADER_SIZE` gets a 431 and a close, before it ends."""
    async with serving() as s:
        client = await s.connect()
        await client.send(b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * MAX_HEADER_SIZE)
        reply = await client.reply()
        await client.aclose()
    assert reply.status == 431, reply
    assert reply.headers[b"connection"] == b"close"
    assert s.handler.requests == []


async def test_a_declared_body_over_the_limit_is_413_before_it_is_sent(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A Content-Length over ``max_body`` gets a 413 naming the limit at once (the body is
    never waited for); a chunked body is refused once it grows over the limit."""
    async with serving(max_body=100) as s:
        declared = await s.connect()
        await declared.send(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 101\r\n\r\n")
        too_long = await declared.reply()
        await declared.aclose()
        chunked = await s.connect()
        await chunked.send(
            b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
            + b"40\r\n"
            + b"x" * 64
            + b"\r\n"
            + b"40\r\n"
            + b"y" * 64
            + b"\r\n"
        )
        grown = await chunked.reply()
        await chunked.aclose()
    assert too_long.status == 413
    assert "101 bytes exceeds the maximum allowed input size of 100" in too_long.error()
    assert "--http-max-input-size" in too_long.error()
    assert grown.status == 413
    assert "bytes exceeds the maximum allowed input size of 100" in grown.error()
    assert s.handler.requests == []


async def test_content_length_with_transfer_encoding_is_read_chunked_then_closed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Both Content-Length and Transfer-Encoding: the body is read as chunked, the answer says
    ``connection: close`` and the connection closes, so the request hidden after the chunked
    body never reaches the handler."""
    async with serving() as s:
        client = await s.connect()
        await client.send(
            b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n" + GET
        )
        reply = await client.reply()
        assert await client.closed()
    assert (reply.status, reply.body) == (200, b"{}")
    assert reply.headers[b"connection"] == b"close"
    assert [r.path for r in s.handler.requests] == ["/"]


# -- timeouts (virtual time) -------------------------------------------------------------------


async def test_a_head_that_trickles_past_the_header_timeout_is_408(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A head sent a byte a second is cut at ``header_timeout`` from the connection's start,
    although bytes keep coming: a 408 naming the flag, then a close."""
    head = b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100
    async with serving(header_timeout=5) as s:
        client = await s.connect()
        began = trio.current_time()
        reply: list[Reply] = []

        async def read() -> None:
            reply.append(await client.reply())
            nursery.cancel_scope.cancel()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(read)
            for byte in head:
                await client.send(bytes([byte]))
                await trio.sleep(1)
        cut_at = trio.current_time() - began
        await client.aclose()
    assert 5 <= cut_at < 6, cut_at
    assert reply[0].status == 408
    assert "--http-header-timeout" in reply[0].error()
    assert reply[0].headers[b"connection"] == b"close"
    assert s.handler.requests == []


async def test_a_silent_connection_closes_without_a_word_at_the_header_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A connection that never sends a byte is closed at ``header_timeout``, with nothing
    sent (no 408: there was no request to answer)."""
    async with serving(header_timeout=5) as s:
        client = await s.connect()
        began = trio.current_time()
        assert await client.closed()
        assert trio.current_time() - began == pytest.approx(5)


async def test_an_idle_keep_alive_connection_closes_after_keep_alive(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """After an answer, a connection that stays silent is closed at ``keep_alive`` seconds
    (not at the shorter header timeout, which counts only once a head starts)."""
    async with serving(header_timeout=5, keep_alive=30) as s:
        client = await s.connect()
        await client.send(GET)
        await client.reply()
        answered = trio.current_time()
        assert await client.closed()
        assert trio.current_time() - answered == pytest.approx(30)


async def test_a_body_without_progress_for_the_body_timeout_is_408(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A body that stops coming gets a 408 ``body_timeout`` after its last byte, saying how
    much arrived; a body that keeps making progress, fast enough for ``body_min_rate``, is
    read, however long it takes."""
    async with serving(body_timeout=3, body_min_rate=1) as s:
        slow = await s.connect()
        await slow.send(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n")
        for _ in range(5):  # 10 bytes every 2 s: 10 s in all, never 3 s without a byte
            await trio.sleep(2)
            await slow.send(b"0123456789")
        served = await slow.reply()

        stalled = await s.connect()
        await stalled.send(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n0123456789")
        began = trio.current_time()
        cut = await stalled.reply()
        cut_after = trio.current_time() - began
        await stalled.aclose()
    assert (served.status, served.body) == (200, b"0123456789" * 5)
    assert cut.status == 408
    assert cut_after == pytest.approx(3)
    assert "10 bytes received" in cut.error()
    assert "--http-body-timeout" in cut.error()


async def test_a_body_trickled_below_the_minimum_rate_is_cut_at_its_deadline(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """A byte every 5 s (never 60 s without progress) is cut at ``body_timeout`` plus one
    second per ``body_min_rate`` bytes received: a 408 naming both flags, a close, and one
    log line for the episode of three such clients; a body at the rate is read whole."""
    async with serving(body_timeout=60, body_min_rate=500) as s:
        trickles = [await s.connect() for _ in range(3)]
        replies: list[Reply] = []
        began = trio.current_time()

        async def trickle(client: Client) -> None:
            await client.send(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n")
            async with trio.open_nursery() as nursery:

                async def read() -> None:
                    replies.append(await client.reply())
                    nursery.cancel_scope.cancel()

                nursery.start_soon(read)
                for _ in range(1000):
                    await trio.sleep(5)
                    await client.send(b"x")

        async with trio.open_nursery() as nursery:
            for client in trickles:
                nursery.start_soon(trickle, client)
        cut_after = trio.current_time() - began
        for client in trickles:
            assert await client.closed()

        steady = await s.connect()  # 500 bytes/s for 4 s: 2,000 bytes, 64 s allowed
        await steady.send(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 2000\r\n\r\n")
        for _ in range(40):
            await trio.sleep(0.1)
            await steady.send(b"y" * 50)
        whole = await steady.reply()
    assert 60 <= cut_after < 61, cut_after  # 12 bytes by then: 60.024 s allowed
    assert [r.status for r in replies] == [408] * 3
    assert "--http-body-min-rate" in replies[0].error()
    assert "12 bytes in 60 s" in replies[0].error(), replies[0].error()
    assert replies[0].headers[b"connection"] == b"close"
    assert (whole.status, len(whole.body)) == (200, 2000)
    lines = [r.getMessage() for r in caplog.records if "too slow" in r.getMessage()]
    assert len(lines) == 1, lines


# -- clients that leave, the connection limit, the stop ----------------------------------------


async def test_a_client_that_leaves_mid_request_cancels_the_handler(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A POST whose client closes while it is handled: the handler's work is cancelled at
    once (no virtual time passes)."""
    handler = Handler(gate=trio.Event())
    async with serving(handler) as s:
        client = await s.connect()
        await client.send(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\nx")
        await handler.started.wait()
        began = trio.current_time()
        await client.aclose()
        await handler.cancelled.wait()
        assert trio.current_time() == began


async def test_connections_over_the_limit_get_503_and_the_others_are_served(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """With ``max_connections`` 2 held by clients that have sent requests, a third connection
    gets a 503 naming the flag and a close; the two open ones are still served, and a new one
    is once one of them leaves."""
    async with serving(max_connections=2) as s:
        first, second = await s.connect(), await s.connect()
        for client in (first, second):
            await client.send(GET)
            assert (await client.reply()).status == 200
        third = await s.connect()
        refused = await third.reply()
        assert await third.closed()
        await third.aclose()
        for client in (first, second):
            await client.send(GET)
            assert (await client.reply()).status == 200
        await first.aclose()
        await trio.testing.wait_all_tasks_blocked()
        fourth = await s.connect()
        await fourth.send(GET)
        assert (await fourth.reply()).status == 200
    assert refused.status == 503
    assert "--http-max-connections" in refused.error()
    assert refused.headers[b"connection"] == b"close"


async def test_at_the_limit_a_newcomer_takes_the_place_of_the_oldest_silent_connection(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """With ``max_connections`` 3: one client that has spoken and two that never send a
    byte; each newcomer closes the oldest silent one (without a word) and is served; the one
    that spoke is never closed for them, a half-sent head is not silent, and one log line
    covers the episode."""
    async with serving(max_connections=3) as s:
        spoke = await s.connect()
        await spoke.send(GET)
        assert (await spoke.reply()).status == 200
        oldest, younger = await s.connect(), await s.connect()
        newcomer = await s.connect()
        assert await oldest.closed()
        await newcomer.send(GET)
        assert (await newcomer.reply()).status == 200
        partial = await s.connect()  # takes younger's place, then sends half a head
        assert await younger.closed()
        await partial.send(b"GET / HTTP/1.1\r\n")
        await trio.testing.wait_all_tasks_blocked()
        late = await s.connect()  # nobody silent is left: a 503
        refused = await late.reply()
        await spoke.send(GET)
        assert (await spoke.reply()).status == 200
        for client in (oldest, younger, late, partial):
            await client.aclose()
    assert refused.status == 503
    lines = [r.getMessage() for r in caplog.records if "sent nothing closed" in r.getMessage()]
    assert len(lines) == 1, lines


async def test_stop_closes_idle_connections_at_once_and_busy_ones_after_their_answer(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """`HttpServer.stop`: an idle keep-alive connection is closed at once; a request being
    handled is answered (``connection: close``), then its connection closes, and ``serve``
    returns."""
    handler = Handler()
    async with serving(handler) as s:
        idle = await s.connect()
        await idle.send(GET)
        await idle.reply()
        handler.gate, handler.started = trio.Event(), trio.Event()
        busy = await s.connect()
        await busy.send(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\nx")
        await handler.started.wait()
        s.server.stop()
        assert await idle.closed()
        await trio.testing.wait_all_tasks_blocked()
        assert not s.done.is_set()
        handler.gate.set()
        reply = await busy.reply()
        assert await busy.closed()
        await s.done.wait()
    assert (reply.status, reply.body) == (200, b"x")
    assert reply.headers[b"connection"] == b"close"
    assert not handler.cancelled.is_set()


async def test_a_request_cut_off_at_the_exit_timeout_gets_503(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A request still handled ``exit_timeout`` seconds after the stop is cancelled and
    answered with a 503 saying the server is shutting down; then ``serve`` returns."""
    handler = Handler(gate=trio.Event())
    async with serving(handler, exit_timeout=5) as s:
        client = await s.connect()
        await client.send(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\nx")
        await handler.started.wait()
        s.server.stop()
        stopped = trio.current_time()
        reply = await client.reply()
        cut_after = trio.current_time() - stopped
        await client.aclose()
        await s.done.wait()
    assert cut_after == pytest.approx(5)
    assert handler.cancelled.is_set()
    assert reply.status == 503
    assert "shutting down" in reply.error()
    assert "--exit-timeout-secs" in reply.error()
    assert reply.headers[b"connection"] == b"close"
