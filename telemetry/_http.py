"""The ``/metrics`` endpoint: Prometheus scrapes it over HTTP, served from inside trio.

`serve_metrics_endpoint` runs hypercorn (an ASGI server that runs on trio) with a tiny ASGI
app until cancelled; `open_metrics_endpoint` runs it for the duration of a block, which
``open_server`` holds open, so the endpoint lives and dies with the server: no daemon thread.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from typing import Any

import trio
from hypercorn.config import Config
from hypercorn.trio import serve
from prometheus_client.registry import CollectorRegistry

from ..protocols import ConfigError, os_error_in, ungrouped
from ._metrics import CONTENT_TYPE, metrics_text

_log = logging.getLogger("orchestrion.telemetry")

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


def metrics_app(
    registry: CollectorRegistry, source: Callable[[], Awaitable[str]] | None = None
) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
    """An ASGI app answering ``GET /metrics`` with the registry's text, or what ``source``
    gives when there is one (404 elsewhere)."""

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
            text = await source() if source is not None else metrics_text(registry)
            status, body, kind = 200, text.encode(), CONTENT_TYPE
        headers = [(b"content-type", kind.encode()), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send(
            {"type": "http.response.body", "body": b"" if scope["method"] == "HEAD" else body}
        )

    return app


async def serve_metrics_endpoint(
    registry: CollectorRegistry,
    host: str,
    port: int,
    source: Callable[[], Awaitable[str]] | None = None,
    *,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``/metrics`` on ``host:port`` until cancelled; reports the URL it listens on
    through ``task_status``. ``source``: where the text comes from instead of ``registry``
    (the supervisor of ``serve --workers`` adds up its workers').

    ``url = await nursery.start(serve_metrics_endpoint, registry, host, port)``: ``port=0``
    picks a free port (the URL says which).

    Raises:
        ConfigError: the address cannot be bound (the port is taken, say), before it reports.
    """
    if not 0 <= port <= 65535:
        raise ConfigError(f"metrics port {port} is not a TCP port (0-65535; 0: any free port)")
    config = Config()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.accesslog = None
    config.errorlog = _log
    config.graceful_timeout = 1.0
    app: Any = metrics_app(registry, source)
    async with ungrouped(trio.open_nursery()) as nursery:
        try:
            binds = await nursery.start(functools.partial(serve, app, config, mode="asgi"))
        except BaseException as exc:  # hypercorn's own nurseries wrap a bind error
            bind_error = os_error_in(exc)
            if bind_error is None:
                raise
            raise ConfigError(
                f"cannot serve metrics on {host}:{port}: {bind_error.strerror or bind_error}"
            ) from bind_error
        task_status.started(f"{binds[0]}/metrics")


@contextlib.asynccontextmanager
async def open_metrics_endpoint(
    registry: CollectorRegistry, host: str = "127.0.0.1", port: int = 8002
) -> AsyncIterator[str]:
    """`serve_metrics_endpoint` for the duration of the block (for an exit stack); yields
    the URL it listens on. Errors, its own and the block's, leave as themselves.

    Raises:
        ConfigError: the address cannot be bound (the port is taken, say).
    """
    async with ungrouped(trio.open_nursery()) as nursery:
        yield await nursery.start(serve_metrics_endpoint, registry, host, port)
        nursery.cancel_scope.cancel()
