"""Hostile HTTP clients against `orchestrion serve`, with raw sockets: more connections than
the process has descriptors, heads and bodies that trickle or never come, Content-Length with
Transfer-Encoding, absurd ``Inference-Header-Content-Length`` values, compressed bodies with
something after their end, and a request cut off by the exit timeout. Each gets a clear HTTP
answer (503, 408 or 400, with Triton's JSON error body), and the server keeps serving."""

from __future__ import annotations

import contextlib
import gzip
import json
import signal
import socket
import statistics
import threading
import time
import zlib
from collections.abc import Iterator

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from orchestrion.testing import Served, get, pending, post
from support.raw_http import connect_many, host_port, parse_reply, read_replies, read_until_closed
from support.reliability_report import record
from support.served import start_server, wait_until_live

_LIVE = b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n"


# -- helpers -------------------------------------------------------------------------------


def _log_problems(served: Served) -> list[str]:
    return [
        line
        for line in served.output
        if "EMFILE" in line or "Traceback" in line or "failed unexpectedly" in line
    ]


def _assert_all_408(
    sockets: list[socket.socket], replies: dict[socket.socket, bytes], flag: str
) -> None:
    """Each of ``sockets`` got a JSON 408 naming ``flag``, with ``connection: close``."""
    for sock in sockets:
        status, headers, body = parse_reply(replies[sock])
        assert status == 408, replies[sock][:200]
        assert headers.get("connection") == "close"
        assert flag in json.loads(body)["error"]


@pytest.fixture(scope="module")
def server() -> Iterator[Served]:
    """A server whose head and body deadlines are 1 s, so the slow clients are cut quickly."""
    served = start_server("--http-header-timeout", "1", "--http-body-timeout", "1")
    yield served
    assert served.stop() == 0, served.text()


# -- descriptors and connections -----------------------------------------------------------


def test_silent_connections_past_the_limit_make_room_for_new_clients() -> None:
    """With 1,024 descriptors (the connection limit then defaults to 512), 1,100 HTTP
    connections that never send a byte: each one over the limit takes the place of the oldest
    silent one, which is closed without a word (as nginx does), so health probes from new
    clients 3 s and 10 s later are answered 200; gRPC, an open keep-alive connection and
    /metrics are served meanwhile; one warning line, no 503, no EMFILE."""
    files, flood = 1024, 1100
    limit = files // 2
    served = start_server(files=files)
    silent: list[socket.socket] = []
    probes: list[tuple[float, int]] = []
    try:
        with socket.create_connection(host_port(served.http), timeout=10) as keeper:
            keeper.sendall(_LIVE)
            assert parse_reply(keeper.recv(65536))[0] == 200
            started = time.monotonic()
            silent = connect_many(served.http, flood)
            for sock in silent:
                sock.setblocking(False)
            replies = dict.fromkeys(silent, b"")
            closed: dict[socket.socket, float] = {}
            expected = flood - (limit - 1)  # the keep-alive connection holds one place
            read_replies(silent, replies, closed, until=time.monotonic() + 30, wanted=expected)
            made_room_in = time.monotonic() - started
            assert len(closed) == expected, (len(closed), expected)
            assert all(replies[sock] == b"" for sock in closed), "a silent one got an answer"
            # Oldest first: the kernel hands connections over in the order they came.
            assert set(closed) == set(silent[:expected])

            began = time.monotonic()
            with grpcclient.InferenceServerClient(served.grpc) as client:
                assert client.is_server_live()
            grpc_seconds = time.monotonic() - began
            keeper.sendall(_LIVE)
            assert parse_reply(keeper.recv(65536))[0] == 200
            assert get(served.metrics, "/metrics")[0] == 200
            for at in (3.0, 10.0):  # new clients, while the flood holds every place
                time.sleep(max(0.0, started + at - time.monotonic()))
                probes.append((time.monotonic() - started, get(served.http, "/v2/health/live")[0]))
            keeper.sendall(_LIVE)  # a connection that spoke is never closed for newcomers
            assert parse_reply(keeper.recv(65536))[0] == 200
    finally:
        for sock in silent:
            sock.close()
        code = served.stop()
    assert code == 0, served.text()
    assert [status for _, status in probes] == [200, 200], probes
    warnings = [line for line in served.output if "sent nothing closed" in line]
    assert len(warnings) == 1, warnings
    assert not any("503" in line or "limit reached (" in line for line in served.output)
    assert not _log_problems(served), _log_problems(served)
    record(
        "Security",
        f"{flood} HTTP connections that never send a byte, to a server with {files} "
        f"descriptors (RLIMIT_NOFILE; the connection limit defaults to half of it)",
        f"{flood} connections, 2 probes",
        f"the {expected} oldest closed without a word within {made_room_in:.1f} s, each for a "
        f"newer one; health probes from new clients at +{probes[0][0]:.0f} s and "
        f"+{probes[1][0]:.0f} s answered 200; gRPC ServerLive in {grpc_seconds * 1000:.0f} ms, "
        "the open keep-alive connection and /metrics served; 1 warning line, no EMFILE",
    )


def test_connections_that_all_spoke_past_the_limit_get_503() -> None:
    """With --http-max-connections 8 held by keep-alive connections that have each sent a
    request, a ninth gets a JSON 503 and a close (no connection that spoke is closed for it);
    the eight are still served, and the ninth is once one of them leaves."""
    served = start_server("--http-max-connections", "8")
    held: list[socket.socket] = []
    try:
        for _ in range(8):
            sock = socket.create_connection(host_port(served.http), timeout=10)
            sock.sendall(_LIVE)
            assert parse_reply(sock.recv(65536))[0] == 200
            held.append(sock)
        with socket.create_connection(host_port(served.http), timeout=10) as late:
            reply, closed = read_until_closed(late, 10)
        status, headers, body = parse_reply(reply)
        assert (status, closed) == (503, True), reply[:200]
        assert headers.get("connection") == "close"
        assert "--http-max-connections" in json.loads(body)["error"]
        for sock in held:
            sock.sendall(_LIVE)
            assert parse_reply(sock.recv(65536))[0] == 200
        held.pop().close()
        wait_until_live(served)
    finally:
        for sock in held:
            sock.close()
        code = served.stop()
    assert code == 0, served.text()
    record(
        "Security",
        "Eight keep-alive HTTP connections that each sent a request hold --http-max-connections "
        "8; a ninth connects",
        "9 connections",
        "the ninth a JSON 503 + close; the eight served on; a new one served once one left",
    )


def test_accept_failures_are_logged_once_per_episode() -> None:
    """With --http-max-connections above the descriptors there are (128), 200 silent
    connections make accept fail with EMFILE: one warning line, no traceback, and the server
    serves again once they close."""
    files, flood = 128, 200
    served = start_server("--http-max-connections", "1000", files=files)
    silent: list[socket.socket] = []
    try:
        silent = connect_many(served.http, flood)
        deadline = time.monotonic() + 10
        while not any("cannot accept" in line for line in served.output):
            assert time.monotonic() < deadline, "no accept failure reported"
            time.sleep(0.05)
        time.sleep(1.0)  # the attack goes on: ten retries of accept, at least
        for sock in silent:
            sock.close()
        wait_until_live(served)
    finally:
        for sock in silent:
            sock.close()
        code = served.stop()
    assert code == 0, served.text()
    failures = [line for line in served.output if "cannot accept" in line]
    assert len(failures) == 1, failures
    assert "EMFILE" in failures[0], failures
    tracebacks = [line for line in served.output if "Traceback" in line]
    assert not tracebacks, served.text()[-3000:]
    record(
        "Security",
        f"{flood} silent HTTP connections with --http-max-connections 1000 above the "
        f"{files} descriptors (RLIMIT_NOFILE): accept fails with EMFILE",
        f"{flood} connections, over 1 s",
        f"{len(failures)} warning line for the episode (no traceback, no line per retry); "
        "HTTP served again once the connections closed",
    )


# -- slow clients --------------------------------------------------------------------------


class _Prober:
    """A thread that times ``GET /v2/health/live`` on fresh connections until stopped."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.latencies: list[float] = []
        self.statuses: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            began = time.monotonic()
            status, _ = get(self.address, "/v2/health/live")
            self.latencies.append(time.monotonic() - began)
            self.statuses.append(status)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)


def test_slow_heads_and_missing_bodies_get_408(server: Served) -> None:
    """Heads sent a byte every 0.2 s and a POST declaring 100 bytes that never come get a
    408 and a close within the 1 s deadline (plus slack); a connection that sends nothing is
    closed silently; a health probe meanwhile is answered promptly."""
    address = host_port(server.http)
    head = b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100
    attackers = 10
    prober = _Prober(server.http)
    try:
        began = time.monotonic()
        trickling = connect_many(server.http, attackers)
        sent = dict.fromkeys(trickling, 0)
        replies = dict.fromkeys(trickling, b"")
        cut: dict[socket.socket, float] = {}
        deadline = began + 10
        while len(cut) < attackers and time.monotonic() < deadline:
            for sock in trickling:
                if sock not in cut and sent[sock] < len(head):
                    with contextlib.suppress(OSError):
                        sock.send(head[sent[sock] : sent[sock] + 1])
                    sent[sock] += 1
            # Paces the trickle (one byte each per 0.2 s) and reads the answers meanwhile.
            until = time.monotonic() + 0.2
            read_replies(trickling, replies, cut, until=until, wanted=attackers, began=began)
        for sock in trickling:
            sock.close()
        assert len(cut) == attackers, f"{attackers - len(cut)} trickling heads still open"
        _assert_all_408(trickling, replies, "--http-header-timeout")
        head_seconds = max(cut.values())
        assert head_seconds < 1 + 1.5, cut
        assert max(sent.values()) < len(head) // 2, "the trickle ran to its end uncut"

        with socket.create_connection(address, timeout=10) as sock:
            began = time.monotonic()
            sock.sendall(
                b"POST /v2/models/sleepy/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n"
            )
            reply, closed = read_until_closed(sock, 10)
            body_seconds = time.monotonic() - began
        status, _headers, body = parse_reply(reply)
        assert (status, closed) == (408, True), reply[:200]
        assert "--http-body-timeout" in json.loads(body)["error"]
        assert body_seconds < 1 + 1.5, body_seconds

        with socket.create_connection(address, timeout=10) as sock:
            began = time.monotonic()
            reply, closed = read_until_closed(sock, 10)
            silent_seconds = time.monotonic() - began
        assert (reply, closed) == (b"", True)
        assert silent_seconds < 1 + 1.5, silent_seconds
    finally:
        prober.stop()
    assert prober.statuses, "no probe finished"
    assert set(prober.statuses) == {200}, set(prober.statuses)
    worst = max(prober.latencies)
    median = statistics.median(prober.latencies)
    assert worst < 1.0, prober.latencies
    assert not _log_problems(server), _log_problems(server)
    record(
        "Security",
        f"Slowloris: {attackers} request heads sent one byte per 0.2 s "
        "(--http-header-timeout 1); a POST declaring 100 bytes and sending none "
        "(--http-body-timeout 1); a connection sending nothing",
        f"{attackers + 2} connections, {len(prober.latencies)} probes",
        f"each head a JSON 408 + close by {head_seconds:.2f} s, the body {body_seconds:.2f} s; "
        f"the silent connection closed without a word at {silent_seconds:.2f} s; health probes "
        f"meanwhile all 200, median {median * 1000:.1f} ms, worst {worst * 1000:.1f} ms",
    )


def test_bodies_trickled_below_the_minimum_rate_get_408(server: Served) -> None:
    """Four POST bodies sent a byte every 0.25 s (never a second without progress, so the
    1 s body timeout alone would never fire) are cut at their deadline, 1 s plus a second per
    500 bytes received (--http-body-min-rate's default): a JSON 408 naming the flag and a
    close each, one log line for the episode, health probes answered meanwhile."""
    declared = 1000
    trickling = connect_many(server.http, 4)
    prober = _Prober(server.http)
    before = sum("too slow" in line for line in server.output)
    try:
        began = time.monotonic()
        for sock in trickling:
            sock.sendall(
                b"POST /v2/models/identity_plain/infer HTTP/1.1\r\nHost: x\r\n"
                + f"Content-Length: {declared}\r\n\r\n".encode()
            )
            sock.setblocking(False)
        replies = dict.fromkeys(trickling, b"")
        cut: dict[socket.socket, float] = {}
        sent = 0
        while len(cut) < len(trickling) and sent < 40:  # 10 s at most
            for sock in trickling:
                if sock not in cut:
                    with contextlib.suppress(OSError):
                        sock.send(b" ")
            sent += 1
            until = time.monotonic() + 0.25
            read_replies(trickling, replies, cut, until=until, wanted=len(trickling), began=began)
    finally:
        prober.stop()
        for sock in trickling:
            sock.close()
    assert len(cut) == len(trickling), f"{len(trickling) - len(cut)} trickles still open"
    _assert_all_408(trickling, replies, "--http-body-min-rate")
    seconds = max(cut.values())
    assert seconds < 1 + 1.5, cut
    assert set(prober.statuses) == {200}, set(prober.statuses)
    # One line per episode: an earlier test's slow heads may have started this one.
    deadline = time.monotonic() + 10
    while not any("too slow" in line for line in server.output):
        assert time.monotonic() < deadline, "no log line for the slow clients"
        time.sleep(0.05)
    assert sum("too slow" in line for line in server.output) <= before + 1
    record(
        "Security",
        "Four POST bodies declaring 1,000 bytes, sent a byte every 0.25 s (so never 1 s "
        "without progress: --http-body-timeout 1 alone would never fire)",
        f"4 connections, {len(prober.statuses)} probes",
        f"each a JSON 408 naming --http-body-min-rate + close by {seconds:.2f} s (1 s plus a "
        "second per 500 bytes received); at most one log line for the episode; probes all 200",
    )


# -- framing -------------------------------------------------------------------------------


def test_content_length_with_transfer_encoding_is_answered_then_closed(server: Served) -> None:
    """A POST with both Content-Length and Transfer-Encoding is read as chunked, answered with
    ``connection: close``, and its connection closed: the request hidden after its chunked body
    is never answered (RFC 9112 §6.1)."""
    with socket.create_connection(host_port(server.http), timeout=10) as sock:
        sock.sendall(
            b"POST /v2/repository/index HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n" + _LIVE
        )
        reply, closed = read_until_closed(sock, 5)
    assert reply.count(b"HTTP/1.1 ") == 1, reply
    status, headers, body = parse_reply(reply)
    assert status == 200, reply[:300]
    assert isinstance(json.loads(body), list)
    assert headers.get("connection") == "close"
    assert closed, "the connection stayed open"
    assert get(server.http, "/v2/health/live")[0] == 200
    record(
        "Security",
        "A POST with Content-Length and Transfer-Encoding: chunked, a second request "
        "smuggled after its chunked body",
        "1 connection",
        "read as chunked, answered 200 with connection: close, then closed; the smuggled "
        "request got no answer",
    )


def _infer_document() -> bytes:
    return json.dumps(
        {"inputs": [{"name": "IN_FP32", "datatype": "FP32", "shape": [2, 1], "data": [1, 2]}]}
    ).encode()


def test_absurd_inference_header_content_length_is_400(server: Served) -> None:
    """``Inference-Header-Content-Length`` of 5,000 digits, of 30 digits, or signed: a JSON 400
    naming the header (no 500, no traceback), and the server keeps serving."""
    path = "/v2/models/identity_plain/infer"
    body = _infer_document()
    values = ["9" * 5000, "1" * 30, "+5", "-1", "0x10"]
    for value in values:
        status, answer = post(server.http, path, body, {"Inference-Header-Content-Length": value})
        assert status == 400, (value[:20], status, answer[:300])
        assert "Inference-Header-Content-Length" in json.loads(answer)["error"], answer[:300]
    status, answer = post(
        server.http, path, body, {"Inference-Header-Content-Length": str(len(body))}
    )
    assert status == 200, answer[:300]
    assert get(server.http, "/v2/health/live")[0] == 200
    assert not _log_problems(server), _log_problems(server)
    record(
        "Bad input",
        "Inference-Header-Content-Length of 5,000 digits, 30 digits, +5, -1, 0x10",
        f"{len(values)} requests",
        "each a JSON 400 naming the header, no traceback logged; the same body with its "
        "true length then answered 200",
    )


def test_compressed_bodies_with_something_after_their_end_are_400(server: Served) -> None:
    """A gzip body with a second member or trailing garbage, and a deflate body with trailing
    garbage, get a JSON 400 saying so (instead of the rest being silently dropped)."""
    path = "/v2/models/identity_plain/infer"
    document = _infer_document()
    cases = {
        "gzip, a second member": (gzip.compress(document) + gzip.compress(b"{}"), "gzip"),
        "gzip, trailing garbage": (gzip.compress(document) + b"garbage", "gzip"),
        "deflate, trailing garbage": (zlib.compress(document) + b"garbage", "deflate"),
    }
    for name, (body, encoding) in cases.items():
        status, answer = post(server.http, path, body, {"Content-Encoding": encoding})
        assert status == 400, (name, status, answer[:300])
        assert "after the end of its compressed data" in json.loads(answer)["error"], answer
    status, answer = post(server.http, path, gzip.compress(document), {"Content-Encoding": "gzip"})
    assert status == 200, answer[:300]
    record(
        "Bad input",
        "Compressed bodies with more after their end: a second gzip member, garbage after "
        "gzip, garbage after deflate",
        f"{len(cases)} requests",
        "each a JSON 400 saying bytes follow the compressed data; a plain gzip body then "
        "answered 200",
    )


def test_an_input_with_json_and_binary_data_is_400(server: Served) -> None:
    """An input carrying both JSON ``data`` and ``binary_data_size`` gets a JSON 400 naming
    it (instead of the JSON values being silently ignored)."""
    path = "/v2/models/identity_plain/infer"
    values = np.array([[5.0], [6.0]], dtype=np.float32).tobytes()
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "IN_FP32",
                    "datatype": "FP32",
                    "shape": [2, 1],
                    "data": [1, 2],
                    "parameters": {"binary_data_size": len(values)},
                }
            ]
        }
    ).encode()
    status, answer = post(
        server.http,
        path,
        header + values,
        {"Inference-Header-Content-Length": str(len(header))},
    )
    assert status == 400, answer[:300]
    error = json.loads(answer)["error"]
    assert "IN_FP32" in error, error
    assert "Input must set only one of the following fields" in error, error  # Triton's words
    assert "But set 'data' 'binary_data_size'" in error, error
    assert get(server.http, "/v2/health/live")[0] == 200
    record(
        "Bad input",
        "An infer input with both JSON data and binary_data_size (with its binary bytes)",
        "1 request",
        "a JSON 400 naming the input and the two fields set, in Triton's words",
    )


# -- shutdown ------------------------------------------------------------------------------


def test_request_cut_off_at_the_exit_timeout_gets_503() -> None:
    """A request still running when the exit timeout (1 s) passes is answered with a JSON 503
    saying the server is shutting down, not with a bare close; the server then exits 0."""
    served = start_server("--exit-timeout-secs", "1")
    signalled = False
    try:
        body = json.dumps(
            {"inputs": [{"name": "DELAY", "datatype": "FP32", "shape": [1], "data": [30.0]}]}
        ).encode()
        with socket.create_connection(host_port(served.http), timeout=10) as sock:
            sock.sendall(
                b"POST /v2/models/sleepy/infer HTTP/1.1\r\nHost: x\r\nContent-Type: "
                b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body
            )
            deadline = time.monotonic() + 20
            while pending(served, "sleepy") < 1:
                assert time.monotonic() < deadline, "the request never started"
            served.process.send_signal(signal.SIGTERM)
            signalled = True
            began = time.monotonic()
            reply, closed = read_until_closed(sock, 20)
            answered = time.monotonic() - began
    finally:
        code = served.stop(how=None if signalled else signal.SIGTERM)
    exited = time.monotonic() - began
    assert code == 0, served.text()
    assert reply, "a bare close"
    status, headers, answer = parse_reply(reply)
    assert status == 503, reply[:300]
    assert headers.get("connection") == "close"
    assert "shutting down" in json.loads(answer)["error"], answer
    assert closed
    assert answered < 1 + 3, answered
    record(
        "Faults",
        "SIGTERM with --exit-timeout-secs 1 while an HTTP request sleeps 30 s in its model",
        "1 request",
        f"answered a JSON 503 (shutting down) + close {answered:.2f} s after SIGTERM; "
        f"exit 0 at {exited:.1f} s",
    )
