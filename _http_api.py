"""The KServe v2 HTTP/REST front end (Triton's routes and binary tensor extension).

How this works: hypercorn (an HTTP server that runs on trio) serves a small ASGI application
in a task of the caller's nursery, so every connection and request is a trio task under the
server; an infer request goes straight from its connection's task into ``AsyncServer.infer``,
with no thread or queue in between. The bodies are encoded and decoded by
`orchestrion.protocols._kserve` (pure code); this module only routes, reads bodies within
their size limit and writes answers.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import logging
import re
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from typing import Any

import attrs
import trio
from hypercorn.config import Config
from hypercorn.trio import serve

from ._control import ModelControl
from ._server import AsyncServer
from .protocols import ConfigError, InferResponse, InvalidRequestError, OrchestrionError
from .protocols._kserve import (
    HEADER_LENGTH,
    decode_http_request,
    encode_http_response,
    error_body,
    error_message,
    http_status,
    model_config_json,
    model_metadata,
    model_statistics_json,
    parse_version,
    repository_index,
    server_metadata,
)

_log = logging.getLogger("orchestrion.http")

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

DEFAULT_MAX_INPUT_SIZE = 64 * 1024 * 1024
"""Triton's ``--http-max-input-size`` default: the largest request body accepted (bytes)."""

_MODEL_ROUTE = re.compile(
    r"^/v2/models/(?P<model>[^/]+)(?:/versions/(?P<version>[^/]+))?"
    r"(?:/(?P<action>ready|config|stats|infer))?/?$"
)
_REPOSITORY_ROUTE = re.compile(
    r"^/v2/repository/models/(?P<model>[^/]+)/(?P<action>load|unload)/?$"
)
_JSON = [(b"content-type", b"application/json")]


class _Disconnected(Exception):
    """The client went away: there is nobody to answer."""


class _HttpError(Exception):
    """An answer other than 200 decided while routing (405, 413, ...)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@attrs.define(eq=False)
class HttpApi:
    """The ASGI application: Triton's HTTP routes over one `AsyncServer`."""

    server: AsyncServer
    control: ModelControl
    version: str
    max_input_size: int = DEFAULT_MAX_INPUT_SIZE

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Answer one ASGI connection event (``http``; ``lifespan`` is acknowledged)."""
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        try:
            status, headers, chunks = await self._route(scope, receive)
        except _Disconnected:
            return
        except _HttpError as exc:
            status, headers, chunks = exc.status, _JSON, [error_body(exc)]
        except trio.Cancelled:
            raise
        except Exception as exc:
            status, headers, chunks = _error_answer(exc, scope)
        await _answer(scope, send, status, headers, chunks)

    async def _route(
        self, scope: Scope, receive: Receive
    ) -> tuple[int, list[tuple[bytes, bytes]], list[bytes | memoryview]]:
        path: str = scope["path"]
        method: str = scope["method"]
        if path.startswith("/v2/models/"):
            if path.rstrip("/") == "/v2/models/stats":
                _expect(method, "GET")
                return _json(model_statistics_json(self.server.model_statistics()))
            match = _MODEL_ROUTE.match(path)
            if match is None:
                raise _HttpError(404, f"no route for {path}")
            return await self._model(match, method, scope, receive)
        if path.startswith("/v2/repository/"):
            return await self._repository(path, method, scope, receive)
        route = path.rstrip("/")
        if route == "/v2/health/live":
            _expect(method, "GET")
            return 200, [], []
        if route == "/v2/health/ready":
            _expect(method, "GET")
            return (200 if self.control.ready() else 503), [], []
        if route == "/v2":
            _expect(method, "GET")
            return _json(server_metadata(self.version))
        raise _HttpError(404, f"no route for {path}")

    async def _model(
        self, match: re.Match[str], method: str, scope: Scope, receive: Receive
    ) -> tuple[int, list[tuple[bytes, bytes]], list[bytes | memoryview]]:
        name, action = match["model"], match["action"]
        version = parse_version(match["version"] or "")
        if action == "infer":
            _expect(method, "POST")
            return await self._infer(name, match["version"] or "", scope, receive)
        _expect(method, "GET")
        if action == "ready":
            return (200 if self.server.is_model_ready(name, version) else 400), [], []
        if action == "stats":
            statistics = self.server.model_statistics(name, version if version > 0 else None)
            return _json(model_statistics_json(statistics))
        config = self.server.model_config(name, version)
        if action == "config":
            return _json(model_config_json(config))
        versions = self.server.model_versions(name)
        return _json(model_metadata(config, versions if version < 1 else [version]))

    async def _infer(
        self, name: str, version: str, scope: Scope, receive: Receive
    ) -> tuple[int, list[tuple[bytes, bytes]], list[bytes | memoryview]]:
        self.server.model_config(name, parse_version(version))  # 404 before reading the body
        headers = _headers(scope)
        body = await self._body(scope, receive, headers)
        length = headers.get(HEADER_LENGTH.encode())
        header_length = None
        if length is not None:
            if not length.isdigit():
                raise InvalidRequestError(f"invalid Inference-Header-Content-Length {length!r}")
            header_length = int(length)
        request = decode_http_request(name, version, body, header_length)
        traceparent = headers.get(b"traceparent")
        response: InferResponse | None = None
        error: Exception | None = None
        async with trio.open_nursery() as nursery:
            # A client that disconnects cancels its request: its slots are freed at once.
            nursery.start_soon(_cancel_on_disconnect, receive, nursery.cancel_scope)
            try:
                response = await self.server.infer(
                    request.model_name,
                    request.inputs,
                    **request.infer_arguments(),
                    timeout=request.timeout,
                    traceparent=traceparent.decode("latin-1") if traceparent else None,
                )
            except Exception as exc:  # leaves as itself, not in the nursery's group
                error = exc
            nursery.cancel_scope.cancel()
        if error is not None:
            raise error
        if response is None:
            raise _Disconnected
        chunks, json_length = encode_http_response(response, request)
        answer = list(_JSON)
        if json_length is not None:
            answer = [
                (b"content-type", b"application/octet-stream"),
                (HEADER_LENGTH.encode(), str(json_length).encode()),
            ]
        return _compressed(200, answer, chunks, headers.get(b"accept-encoding", b""))

    async def _repository(
        self, path: str, method: str, scope: Scope, receive: Receive
    ) -> tuple[int, list[tuple[bytes, bytes]], list[bytes | memoryview]]:
        _expect(method, "POST")
        document = await self._json_body(scope, receive)
        if path.rstrip("/") == "/v2/repository/index":
            ready = document.get("ready", False)
            if not isinstance(ready, bool):
                raise InvalidRequestError("'ready' must be a boolean")
            loaded = {n: self.server.model_versions(n) for n in self.server.model_names()}
            return _json(repository_index(loaded, self.control.available(), ready_only=ready))
        match = _REPOSITORY_ROUTE.match(path)
        if match is None:
            raise _HttpError(404, f"no route for {path}")
        parameters = document.get("parameters", {})
        if not isinstance(parameters, dict):
            raise InvalidRequestError("'parameters' must be an object")
        if match["action"] == "load":
            await self.control.load(match["model"], parameters)
        else:
            await self.control.unload(match["model"], parameters)
        return 200, _JSON, [b"{}"]

    async def _body(
        self, scope: Scope, receive: Receive, headers: dict[bytes, bytes]
    ) -> bytes | memoryview:
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_input_size:
            raise _HttpError(413, self._too_large(int(declared)))
        parts: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _Disconnected
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_input_size:
                raise _HttpError(413, self._too_large(size))
            parts.append(chunk)
            if not message.get("more_body", False):
                break
        body = parts[0] if len(parts) == 1 else b"".join(parts)
        encoding = headers.get(b"content-encoding", b"identity").lower()
        if encoding in (b"gzip", b"deflate"):
            return self._inflate(body, encoding)
        if encoding != b"identity":
            raise _HttpError(415, f"unsupported Content-Encoding {encoding.decode('latin-1')!r}")
        return body

    def _inflate(self, body: bytes, encoding: bytes) -> bytes:
        wbits = 16 + zlib.MAX_WBITS if encoding == b"gzip" else zlib.MAX_WBITS
        inflater = zlib.decompressobj(wbits)
        try:
            data = inflater.decompress(body, self.max_input_size + 1)
        except zlib.error as exc:
            raise InvalidRequestError(f"the {encoding.decode()} body is corrupt: {exc}") from None
        if len(data) > self.max_input_size or inflater.unconsumed_tail:
            raise _HttpError(413, self._too_large(len(data)))
        if not inflater.eof:
            raise InvalidRequestError(f"the {encoding.decode()} body is truncated")
        return data

    def _too_large(self, size: int) -> str:
        return (
            f"request body of {size} bytes exceeds the maximum input size of "
            f"{self.max_input_size} bytes (--http-max-input-size)"
        )

    async def _json_body(self, scope: Scope, receive: Receive) -> dict[str, Any]:
        body = await self._body(scope, receive, _headers(scope))
        if not body:
            return {}
        try:
            document = json.loads(bytes(body))
        except (ValueError, RecursionError) as exc:
            raise InvalidRequestError(f"failed to parse the request JSON: {exc}") from None
        if not isinstance(document, dict):
            raise InvalidRequestError("the request JSON must be an object")
        return document


async def _cancel_on_disconnect(receive: Receive, scope: trio.CancelScope) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


def _expect(method: str, allowed: str) -> None:
    if method != allowed and not (allowed == "GET" and method == "HEAD"):
        raise _HttpError(405, f"method {method} not allowed here (use {allowed})")


def _headers(scope: Scope) -> dict[bytes, bytes]:
    return {name.lower(): value for name, value in scope["headers"]}


def _json(document: object) -> tuple[int, list[tuple[bytes, bytes]], list[bytes | memoryview]]:
    return 200, _JSON, [json.dumps(document, separators=(",", ":")).encode()]


def _error_answer(
    error: Exception, scope: Scope
) -> tuple[int, list[tuple[bytes, bytes]], list[bytes | memoryview]]:
    status = http_status(error)
    if not isinstance(error, OrchestrionError):
        _log.error("%s %s failed unexpectedly", scope["method"], scope["path"], exc_info=error)
    elif status >= 500:
        _log.warning("%s %s: %s", scope["method"], scope["path"], error_message(error))
    return status, _JSON, [error_body(error)]


def _compressed(
    status: int,
    headers: list[tuple[bytes, bytes]],
    chunks: list[bytes | memoryview],
    accept: bytes,
) -> tuple[int, list[tuple[bytes, bytes]], list[bytes | memoryview]]:
    """Compress the body when the client accepts gzip or deflate (tritonclient's
    ``response_compression_algorithm``)."""
    offered = {item.split(b";")[0].strip() for item in accept.lower().split(b",")}
    if b"gzip" in offered:
        body: bytes = gzip.compress(b"".join(chunks), compresslevel=1)
        encoding = b"gzip"
    elif b"deflate" in offered:
        body = zlib.compress(b"".join(chunks), 1)
        encoding = b"deflate"
    else:
        return status, headers, chunks
    return status, [*headers, (b"content-encoding", encoding)], [body]


async def _answer(
    scope: Scope,
    send: Send,
    status: int,
    headers: list[tuple[bytes, bytes]],
    chunks: list[bytes | memoryview],
) -> None:
    length = sum(len(c) for c in chunks)
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [*headers, (b"content-length", str(length).encode())],
        }
    )
    if scope["method"] == "HEAD" or not chunks:
        await send({"type": "http.response.body", "body": b""})
        return
    last = len(chunks) - 1
    for index, chunk in enumerate(chunks):
        await send({"type": "http.response.body", "body": chunk, "more_body": index < last})


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


@contextlib.asynccontextmanager
async def open_http_api(
    api: HttpApi,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    exit_timeout: float = 30.0,
) -> AsyncIterator[tuple[str, Callable[[], None]]]:
    """Serve ``api`` over HTTP/1.1 (and h2c) for the duration of the block.

    Yields the address it listens on (``host:port``; ``port=0`` picks a free one) and a
    function that starts a graceful stop: no new connections, requests in flight get up to
    ``exit_timeout`` seconds, then the block's end cancels what is left.

    Raises:
        ConfigError: the address cannot be bound.
    """
    if not 0 <= port <= 65535:
        raise ConfigError(f"HTTP port {port} is not a TCP port (0-65535; 0: any free port)")
    config = Config()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.accesslog = None
    config.errorlog = _log
    config.graceful_timeout = exit_timeout
    config.keep_alive_timeout = 75.0
    stopping = trio.Event()
    stopped = trio.Event()

    async def run(task_status: trio.TaskStatus[list[str]]) -> None:
        try:
            await serve(
                app, config, mode="asgi", shutdown_trigger=stopping.wait, task_status=task_status
            )
        finally:
            stopped.set()

    error: BaseException | None = None
    bind_error: OSError | None = None
    async with trio.open_nursery() as nursery:
        app: Any = api
        try:
            binds = await nursery.start(run)
        except BaseException as exc:  # hypercorn's own nurseries wrap a bind error
            bind_error = _os_error(exc)
            if bind_error is None:
                error = exc
        else:
            try:
                yield binds[0].removeprefix("http://"), stopping.set
            except BaseException as exc:  # the caller's: leaves as itself
                error = exc
            else:
                stopping.set()
                # hypercorn ends serve() once its requests have finished (or after
                # graceful_timeout, when it cancels them); this bound is a safety net.
                with trio.move_on_after(exit_timeout + 1.0):
                    await stopped.wait()
        nursery.cancel_scope.cancel()
    if bind_error is not None:
        raise ConfigError(
            f"cannot serve HTTP on {host}:{port}: {bind_error.strerror or bind_error}"
        ) from bind_error
    if error is not None:
        raise error


def _os_error(error: BaseException) -> OSError | None:
    """The OSError inside a (nested) exception group of a failed start, if any."""
    if isinstance(error, OSError):
        return error
    if isinstance(error, BaseExceptionGroup):
        for inner in error.exceptions:
            found = _os_error(inner)
            if found is not None:
                return found
    return None
