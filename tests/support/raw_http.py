"""HTTP/1.1 over raw sockets, for clients no library would be: silent, trickling, flooding,
or sending what a parser must refuse. Every read is bounded in time."""

from __future__ import annotations

import contextlib
import selectors
import socket
import time
from collections.abc import Iterable


def host_port(address: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[V6]:PORT`` too) as a (host, port) pair."""
    host, port = address.rsplit(":", 1)
    return host.strip("[]"), int(port)


def connect_many(address: str, count: int) -> list[socket.socket]:
    """``count`` connections to ``address`` that send nothing (yet)."""
    return [socket.create_connection(host_port(address), timeout=10) for _ in range(count)]


def read_until_closed(sock: socket.socket, limit: float) -> tuple[bytes, bool]:
    """Everything ``sock`` receives within ``limit`` seconds; and whether the peer closed."""
    reply = b""
    deadline = time.monotonic() + limit
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            return reply, False
        except ConnectionResetError:
            return reply, True
        if not chunk:
            return reply, True
        reply += chunk
    return reply, False


def read_replies(
    sockets: Iterable[socket.socket],
    replies: dict[socket.socket, bytes],
    closed: dict[socket.socket, float],
    *,
    until: float,
    wanted: int,
    began: float = 0.0,
    close: bool = False,
) -> None:
    """Read what each of ``sockets`` not in ``closed`` yet receives into ``replies``, until the
    monotonic time ``until`` or until ``closed`` holds ``wanted`` sockets. Each one the server
    closes goes into ``closed`` (with the seconds since ``began``), and with ``close`` it is
    closed here at once, as a client does after ``connection: close``."""
    selector = selectors.DefaultSelector()
    try:
        for sock in sockets:
            if sock not in closed:
                selector.register(sock, selectors.EVENT_READ)
        while (left := until - time.monotonic()) > 0 and len(closed) < wanted:
            for key, _ in selector.select(timeout=left):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                try:
                    chunk = sock.recv(65536)
                except ConnectionResetError:
                    chunk = b""
                if chunk:
                    replies[sock] = replies.get(sock, b"") + chunk
                    continue
                closed[sock] = time.monotonic() - began
                selector.unregister(sock)
                if close:
                    sock.close()
    finally:
        selector.close()


def exchange(address: str, data: bytes, timeout: float = 10.0) -> bytes:
    """Send ``data`` on a fresh connection; what comes back until the server closes (or
    ``timeout`` seconds pass)."""
    with socket.create_connection(host_port(address), timeout=timeout) as sock:
        # Refused before the whole request was sent: read the answer anyway.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(data)
        return read_until_closed(sock, timeout)[0]


def parse_reply(reply: bytes) -> tuple[int, dict[str, str], bytes]:
    """The status, headers (lower-case) and body of the one HTTP answer in ``reply``."""
    head, _, body = reply.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    assert lines[0].startswith("HTTP/1.1 "), reply[:200]
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split(" ", 2)[1]), headers, body


def status_of(reply: bytes) -> int:
    """The status code of the HTTP answer that ``reply`` starts with."""
    assert reply.startswith(b"HTTP/1.1 "), reply[:100]
    return int(reply.split(b" ", 2)[1])
