"""The ``/metrics`` endpoint: Prometheus scrapes it over HTTP, served from inside trio.

hypercorn (an ASGI server that runs on trio) serves a tiny ASGI app in a task of the server's
own nursery, so the endpoint lives and dies with the server: no daemon thread. The endpoint
binds to loopback unless told otherwise.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from typing import Any

import trio
from hypercorn.config import Config
from hypercorn.trio import serve
from prometheus_client.registry import CollectorRegistry

from ..protocols import ConfigError, os_error_in
from ._metrics import CONTENT_TYPE, metrics_text

_log = logging.getLogger("orchestrion.telemetry")

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


def metrics_app(registry: CollectorRegistry) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
    """An ASGI app answering ``GET /metrics`` with the registry's text (404 elsewhere)."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        if scope["path"].rstrip("/") != "/metrics":
            status, body, kind = 404, b"not found: metrics are at /metrics\n", "text/plain"
        elif scope["method"] not in ("GET", "HEAD"):
            status, body, kind = 405, b"method not allowed\n", "text/plain"
        else:
            status, body, kind = 200, metrics_text(registry).encode(), CONTENT_TYPE
        headers = [(b"content-type", kind.encode()), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send(
            {"type": "http.response.body", "body": b"" if scope["method"] == "HEAD" else body}
        )

    return app


@contextlib.asynccontextmanager
async def open_metrics_endpoint(
    registry: CollectorRegistry, host: str = "127.0.0.1", port: int = 8002
) -> AsyncIterator[str]:
    """Serve ``/metrics`` for the duration of the block; yields the URL it listens on.

    ``port=0`` picks a free port (the URL says which).

    Raises:
        ConfigError: the address cannot be bound (the port is taken, say).
    """
    config = Config()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.accesslog = None
    config.errorlog = _log
    config.graceful_timeout = 1.0
    if not 0 <= port <= 65535:
        raise ConfigError(f"metrics port {port} is not a TCP port (0-65535; 0: any free port)")
    error: BaseException | None = None
    bind_error: OSError | None = None
    async with trio.open_nursery() as nursery:
        app: Any = metrics_app(registry)
        try:
            binds = await nursery.start(
                lambda task_status: serve(app, config, mode="asgi", task_status=task_status)
            )
        except BaseException as exc:  # hypercorn's own nurseries wrap a bind error
            bind_error = os_error_in(exc)
            if bind_error is None:
                error = exc
        else:
            try:
                yield f"{binds[0]}/metrics"
            except BaseException as exc:  # the caller's: leaves as itself
                error = exc
        nursery.cancel_scope.cancel()
    if bind_error is not None:
        raise ConfigError(
            f"cannot serve metrics on {host}:{port}: {bind_error.strerror or bind_error}"
        ) from bind_error
    if error is not None:
        raise error
