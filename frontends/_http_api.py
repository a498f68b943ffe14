"""The KServe v2 HTTP/REST front end (Triton's routes and binary tensor extension).

How this works: `HttpApi.handle` answers one complete request (method, path, headers, body);
`orchestrion.frontends._http_server` (trio and h11) owns the sockets, reads bodies within their size
limit, and cancels the work of a client that disconnects. An infer request goes straight from
its connection's task into ``AsyncServer.infer``, with no thread or queue in between. The
bodies are encoded and decoded by `orchestrion.protocols._kserve_http` (pure code); this module
routes, inflates compressed bodies and maps errors to Triton's status codes.
"""

from __future__ import annotations

import gzip
import json
import logging
import re
import zlib
from collections.abc import Callable
from typing import Any

import attrs
import trio

from .._server import AsyncServer
from ..protocols import (
    HEADER_LENGTH,
    ConfigError,
    InferResponse,
    InvalidRequestError,
    ModelConfig,
    OrchestrionError,
    RegionNotFoundError,
    UnsupportedError,
    WireRequest,
    decode_http_request,
    decode_raw_request,
    encode_http_response,
    error_body,
    error_message,
    http_status,
    load_json_object,
    load_override_from_http,
    model_config_json,
    model_metadata,
    model_statistics_json,
    parse_version,
    repository_index,
    server_metadata,
)
from ._control import DEFAULT_EXIT_TIMEOUT, ModelControl, Shutdown
from ._http_generate import Generate
from ._http_server import (
    DEFAULT_BODY_MIN_RATE,
    DEFAULT_BODY_TIMEOUT,
    DEFAULT_HEADER_TIMEOUT,
    Answer,
    Headers,
    HttpRequest,
    HttpServer,
    StreamedAnswer,
    default_max_connections,
)
from ._logging import logging_extension
from ._offload import off_loop
from ._on_demand import OnDemand
from ._restricted import Restrictions
from ._shared_memory import CUDA_UNSUPPORTED, SharedMemory
from ._wire_infer import WireInfer

_log = logging.getLogger("orchestrion.http")


DEFAULT_MAX_INPUT_SIZE = 64 * 1024 * 1024
"""Triton's ``--http-max-input-size`` default: the largest request body accepted (bytes)."""

_MODEL_ROUTE = re.compile(
    r"^/v2/models/(?P<model>[^/]+)(?:/versions/(?P<version>[^/]+))?"
    r"(?:/(?P<action>ready|config|stats|infer|generate|generate_stream))?/?$"
)
_SHARED_MEMORY_ROUTE = re.compile(
    r"^/v2/(?P<kind>system|cuda)sharedmemory(?:/region/(?P<region>[^/]+))?"
    r"/(?P<action>status|register|unregister)/?$"
)
_REPOSITORY_ROUTE = re.compile(
    r"^/v2/repository/models/(?P<model>[^/]+)/(?P<action>load|unload)/?$"
)
_JSON = [(b"content-type", b"application/json")]


class _HttpError(Exception):
    """An answer other than 200 decided while routing (405, 413, ...)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@attrs.define(eq=False)
class HttpApi:
    """Triton's HTTP routes over one `AsyncServer`."""

    server: AsyncServer
    control: ModelControl
    version: str
    max_input_size: int = DEFAULT_MAX_INPUT_SIZE
    shared_memory: SharedMemory = attrs.field(factory=SharedMemory)
    """The registered shared memory regions (`serve` shares one with the gRPC front end)."""
    restrictions: Restrictions = attrs.field(factory=Restrictions)
    """Endpoint groups that need a header (``--http-restricted-api``)."""
    name: str = attrs.field(default="orchestrion", kw_only=True)
    """The server's name in its metadata (``--id``)."""
    on_demand: OnDemand | None = attrs.field(default=None, kw_only=True)
    """Loads a model on its first request (``--model-load-on-demand``)."""
    _wire: WireInfer = attrs.field(init=False)
    _generate: Generate = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._wire = WireInfer(self.server, self.shared_memory, self.on_demand)
        self._generate = Generate(self.server, self._wire, self.max_input_size)

    async def handle(self, request: HttpRequest) -> Answer | StreamedAnswer:
        """Answer one request; every error becomes Triton's JSON error body (a streamed
        answer reports its later errors in its own body)."""
        refusal = self.restrictions.refusal(_category(request.path), _header_of(request))
        if refusal is not None:
            return 403, _JSON, [json.dumps({"error": refusal}).encode()]
        try:
            return await self._route(request)
        except _HttpError as exc:
            return exc.status, _JSON, [json.dumps({"error": str(exc)}).encode()]
        except Exception as exc:
            return _error_answer(exc, request)

    def refuse(self, request: HttpRequest | None, status: int, message: str) -> Answer:
        """The answer for a request the HTTP server refuses (malformed, too large)."""
        return status, _JSON, [error_body(InvalidRequestError(message))]

    async def _route(self, request: HttpRequest) -> Answer | StreamedAnswer:
        path, method = request.path, request.method
        if path.startswith("/v2/models/"):
            if path.rstrip("/") == "/v2/models/stats":
                _expect(method, "GET")
                return _json(model_statistics_json(self.server.model_statistics()))
            match = _MODEL_ROUTE.match(path)
            if match is None:
                raise _HttpError(404, f"no route for {path}")
            if self.on_demand is None or match["action"] == "stats":
                return await self._model(match, request)
            async with self._wire.holding(match["model"]):  # a streamed answer holds its own
                return await self._model(match, request)
        if path.startswith("/v2/repository/"):
            return await self._repository(request)
        route = path.rstrip("/")
        if route.startswith(("/v2/systemsharedmemory", "/v2/cudasharedmemory")):
            return await self._shared_memory(request)
        if route == "/v2/health/live":
            _expect(method, "GET")
            return 200, [], []
        if route == "/v2/health/ready":
            _expect(method, "GET")
            return (200 if self.control.ready() else 503), [], []
        if route == "/v2":
            _expect(method, "GET")
            return _json(server_metadata(self.version, self.name))
        if route == "/v2/logging":
            if method not in ("GET", "POST"):
                raise _HttpError(405, f"method {method} not allowed: GET or POST")
            changes = await self._json_body(request) if method == "POST" else None
            return _json(logging_extension(changes))
        raise _HttpError(404, f"no route for {path}")

    async def _shared_memory(self, request: HttpRequest) -> Answer:
        match = _SHARED_MEMORY_ROUTE.match(request.path)
        if match is None:
            raise _HttpError(404, f"no route for {request.path}")
        region, action = match["region"] or "", match["action"]
        _expect(request.method, "GET" if action == "status" else "POST")
        memory = self.shared_memory
        if match["kind"] == "cuda":
            # None registered: status lists none and unregistering is done (client scripts
            # unregister CUDA regions before they start); registering is refused.
            if action == "status":
                if region:
                    raise RegionNotFoundError(
                        f"Unable to find cuda shared memory region: '{region}'"
                    )
                return _json([])
            if action == "unregister":
                return 200, _JSON, [b"{}"]
            raise UnsupportedError(CUDA_UNSUPPORTED)
        if action == "status":
            return _json(memory.status(region))
        if action == "unregister":
            memory.unregister(region)
            return 200, _JSON, [b"{}"]
        document = await self._json_body(request)
        if "key" not in document:
            raise InvalidRequestError("Shared memory register request has no 'key' field")
        if "byte_size" not in document:
            raise InvalidRequestError("Shared memory register request has no 'byte_size' field")
        memory.register(region, document["key"], document.get("offset", 0), document["byte_size"])
        return 200, _JSON, [b"{}"]

    async def _model(self, match: re.Match[str], request: HttpRequest) -> Answer | StreamedAnswer:
        name, action = match["model"], match["action"]
        version = parse_version(match["version"] or "")
        if action == "infer":
            _expect(request.method, "POST")
            return await self._infer(name, match["version"] or "", request)
        if action in ("generate", "generate_stream"):
            _expect(request.method, "POST")
            streaming = action == "generate_stream"
            return await self._generate.answer(
                name, match["version"] or "", request, streaming=streaming
            )
        _expect(request.method, "GET")
        if action == "ready":
            return (200 if await self.server.model_ready(name, version) else 400), [], []
        if action == "stats":
            statistics = self.server.model_statistics(name, version if version > 0 else None)
            return _json(model_statistics_json(statistics))
        config = self.server.model_config(name, version)
        if action == "config":
            return _json(model_config_json(config))
        versions = self.server.model_versions(name)
        return _json(model_metadata(config, versions if version < 1 else [version]))

    async def _infer(self, name: str, version: str, request: HttpRequest) -> Answer:
        config = self.server.model_config(name, parse_version(version))  # 404 before the body
        if self.server.is_decoupled(name):
            raise InvalidRequestError(
                f"model '{name}' is decoupled (zero or many responses per request): HTTP infer "
                f"gives one response; use POST /v2/models/{name}/generate_stream (server-sent "
                "events) or gRPC ModelStreamInfer"
            )
        headers = request.headers
        # A compressed body inflates to up to --http-max-input-size: count it larger.
        compressed = headers.get(b"content-encoding", b"identity").lower() != b"identity"
        size = len(request.body) * (32 if compressed else 1)
        wire = await off_loop(size, self._decoded_request, config, version, request)
        traceparent = headers.get(b"traceparent")
        response = await self._wire.infer(
            wire, traceparent.decode("latin-1") if traceparent else None
        )
        size = sum(int(a.nbytes) for a in response.outputs.values())
        return await off_loop(size, self._encoded_response, response, wire, headers)

    def _decoded_request(
        self, config: ModelConfig, version: str, request: HttpRequest
    ) -> WireRequest:
        """The request in the body (inflated, its header length checked; a header length of
        0 makes it Triton's raw binary request): CPU work."""
        headers = request.headers
        body = self._decoded_body(request)
        length = headers.get(HEADER_LENGTH.encode())
        header_length = None
        if length is not None:
            # Digits only, and no more of them than the body's size has: int() of a huge
            # value is slow, and past 4,300 digits raises ValueError.
            if not length.isdigit() or len(length.lstrip(b"0")) > len(str(len(body))):
                shown = length[:40] + b"..." if len(length) > 40 else length
                raise InvalidRequestError(
                    f"invalid Inference-Header-Content-Length {shown.decode('latin-1')!r}: "
                    f"expected the byte length of the JSON header, at most the body's "
                    f"{len(body)} bytes"
                )
            header_length = int(length)
            if header_length == 0:
                return decode_raw_request(config, version, body)
        return decode_http_request(config.name, version, body, header_length)

    @staticmethod
    def _encoded_response(
        response: InferResponse, wire: WireRequest, headers: dict[bytes, bytes]
    ) -> Answer:
        """The answer to an infer request (compressed if the client accepts it): CPU work."""
        chunks, json_length = encode_http_response(response, wire)
        answer = list(_JSON)
        if json_length is not None:
            answer = [
                (b"content-type", b"application/octet-stream"),
                (HEADER_LENGTH.encode(), str(json_length).encode()),
            ]
        return _compressed(200, answer, chunks, headers.get(b"accept-encoding", b""))

    async def _repository(self, request: HttpRequest) -> Answer:
        _expect(request.method, "POST")
        document = await self._json_body(request)
        path = request.path
        if path.rstrip("/") == "/v2/repository/index":
            ready = document.get("ready", False)
            if not isinstance(ready, bool):
                raise InvalidRequestError("Invalid value for 'ready': expected a boolean")
            loaded = {n: self.server.model_versions(n) for n in self.server.model_names()}
            available, failed = self.control.available(), self.control.failures()
            return _json(repository_index(loaded, available, ready_only=ready, failed=failed))
        match = _REPOSITORY_ROUTE.match(path)
        if match is None:
            raise _HttpError(404, f"no route for {path}")
        parameters = document.get("parameters", {})
        if not isinstance(parameters, dict):
            raise InvalidRequestError("'parameters' must be an object")
        if match["action"] == "load":
            override = await off_loop(len(request.body), load_override_from_http, parameters)
            await self.control.load(match["model"], override)
        else:
            await self.control.unload(match["model"], parameters)
        return 200, _JSON, [b"{}"]

    def _decoded_body(self, request: HttpRequest) -> bytes | bytearray:
        encoding = request.headers.get(b"content-encoding", b"identity").lower()
        if encoding in (b"gzip", b"deflate"):
            return self._inflate(request.body, encoding)
        if encoding != b"identity":
            raise _HttpError(415, f"unsupported Content-Encoding {encoding.decode('latin-1')!r}")
        return request.body

    def _inflate(self, body: bytes | bytearray, encoding: bytes) -> bytes:
        wbits = 16 + zlib.MAX_WBITS if encoding == b"gzip" else zlib.MAX_WBITS
        inflater = zlib.decompressobj(wbits)
        try:
            data = inflater.decompress(body, self.max_input_size + 1)
        except zlib.error as exc:
            raise InvalidRequestError(f"the {encoding.decode()} body is corrupt: {exc}") from None
        if len(data) > self.max_input_size or inflater.unconsumed_tail:
            raise _HttpError(
                413,
                f"request body inflates to more than the maximum input size of "
                f"{self.max_input_size} bytes (--http-max-input-size)",
            )
        if not inflater.eof:
            raise InvalidRequestError(f"the {encoding.decode()} body is truncated")
        if inflater.unused_data:
            # A second gzip member, or garbage: refused rather than silently dropped.
            raise InvalidRequestError(
                f"the {encoding.decode()} body has {len(inflater.unused_data)} bytes after "
                "the end of its compressed data (a second gzip member or trailing garbage); "
                "send one compressed stream"
            )
        return data

    async def _json_body(self, request: HttpRequest) -> dict[str, Any]:
        body = self._decoded_body(request)
        return await off_loop(len(body), load_json_object, body) if body else {}


def _category(path: str) -> str:
    """The restricted-API category of a request path (`orchestrion.frontends._restricted`)."""
    route = path.rstrip("/")
    if route.startswith("/v2/health"):
        return "health"
    if route.startswith(("/v2/systemsharedmemory", "/v2/cudasharedmemory")):
        return "shared-memory"
    if route.startswith("/v2/repository"):
        return "model-repository"
    if route.startswith("/v2/trace"):
        return "trace"
    if route.startswith("/v2/logging"):
        return "logging"
    if route == "/v2/models/stats":
        return "statistics"
    match = _MODEL_ROUTE.match(path)
    action = match["action"] if match is not None else None
    return {
        "infer": "inference",
        "generate": "inference",
        "generate_stream": "inference",
        "ready": "health",
        "config": "model-config",
        "stats": "statistics",
    }.get(action or "", "metadata")


def _header_of(request: HttpRequest) -> Callable[[str], str | None]:
    def header(name: str) -> str | None:
        value = request.headers.get(name.encode("latin-1"))
        return value.decode("latin-1") if value is not None else None

    return header


def _expect(method: str, allowed: str) -> None:
    if method != allowed and not (allowed == "GET" and method == "HEAD"):
        raise _HttpError(405, f"method {method} not allowed here (use {allowed})")


def _json(document: object) -> Answer:
    return 200, _JSON, [json.dumps(document, separators=(",", ":")).encode()]


def _error_answer(error: Exception, request: HttpRequest) -> Answer:
    status = http_status(error)
    if not isinstance(error, OrchestrionError):
        _log.error("%s %s failed unexpectedly", request.method, request.path, exc_info=error)
    elif status >= 500:
        _log.warning("%s %s: %s", request.method, request.path, error_message(error))
    return status, _JSON, [error_body(error)]


def _compressed(
    status: int, headers: Headers, chunks: list[bytes | memoryview], accept: bytes
) -> Answer:
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


async def serve_http_api(
    api: HttpApi,
    host: str,
    port: int,
    *,
    shutdown: Shutdown | None = None,
    exit_timeout: float = DEFAULT_EXIT_TIMEOUT,
    header_timeout: float = DEFAULT_HEADER_TIMEOUT,
    body_timeout: float = DEFAULT_BODY_TIMEOUT,
    body_min_rate: float = DEFAULT_BODY_MIN_RATE,
    max_connections: int | None = None,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``api`` over HTTP/1.1 on ``host:port`` until cancelled, or until ``shutdown``
    is requested; reports the address it listens on through ``task_status``.

    ``address = await nursery.start(serve_http_api, api, host, port)``: ``port=0`` picks a
    free port (``address``, ``host:port``, says which). Cancelling stops it at once.
    Requesting ``shutdown`` stops it gracefully, then it returns: no new connections, idle
    ones closed, requests in flight get up to ``exit_timeout`` seconds, then they are
    cancelled (and answered 503).

    Args:
        header_timeout: seconds a request head may take to arrive (408 beyond).
        body_timeout: seconds a request body may go without progress (408 beyond), and
            the start of its whole deadline.
        body_min_rate: bytes a second a body must average (each extends its deadline by
            ``1 / body_min_rate`` s; 408 beyond); 0: no deadline but ``body_timeout``'s.
        max_connections: connections served at once, more are answered 503; None: half
            the open-file limit, at most 4,096 (`default_max_connections`).

    Raises:
        ConfigError: the address cannot be bound, or a limit is not positive (before it
            reports).
    """
    if not 0 <= port <= 65535:
        raise ConfigError(f"HTTP port {port} is not a TCP port (0-65535; 0: any free port)")
    if not (header_timeout > 0 and body_timeout > 0):
        raise ConfigError("--http-header-timeout and --http-body-timeout must be > 0")
    if not body_min_rate >= 0:
        raise ConfigError(f"--http-body-min-rate must be >= 0, not {body_min_rate}")
    if max_connections is not None and max_connections < 1:
        raise ConfigError(f"--http-max-connections must be >= 1, not {max_connections}")
    server = HttpServer(
        api.handle,
        api.max_input_size,
        api.refuse,
        header_timeout=header_timeout,
        body_timeout=body_timeout,
        body_min_rate=body_min_rate,
        max_connections=max_connections or default_max_connections(),
    )
    try:
        listeners = await trio.open_tcp_listeners(port, host=host)
    except OSError as exc:
        raise ConfigError(f"cannot serve HTTP on {host}:{port}: {exc.strerror or exc}") from exc
    bound = listeners[0].socket.getsockname()
    address = f"[{bound[0]}]:{bound[1]}" if ":" in bound[0] else f"{bound[0]}:{bound[1]}"
    with (shutdown or Shutdown()).on_request(server.stop):
        task_status.started(address)
        await server.serve(listeners, exit_timeout)
