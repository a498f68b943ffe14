"""The HTTP and gRPC front ends around an in-process server, for tests in trio."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import trio

from orchestrion import AsyncServer, open_server
from orchestrion.frontends._control import ModelControl, Shutdown
from orchestrion.frontends._grpc_service import serve_grpc_api
from orchestrion.frontends._http_api import HttpApi, serve_http_api
from orchestrion.protocols._errors import ungrouped


@contextlib.asynccontextmanager
async def front_ends(
    repository: Path, **server_options: Any
) -> AsyncIterator[tuple[AsyncServer, str, str]]:
    """A server on ``repository`` with both front ends on free loopback ports: the server,
    the HTTP address and the gRPC address. They stop gracefully when the block ends (at once
    when it raises, the error as itself)."""
    async with open_server(repository, **server_options) as server:
        control = ModelControl(server)
        api = HttpApi(server, control, "test")
        shutdown = Shutdown()
        async with ungrouped(trio.open_nursery()) as nursery:
            http_address = await nursery.start(
                functools.partial(
                    serve_http_api, api, "127.0.0.1", 0, shutdown=shutdown, exit_timeout=5
                )
            )
            grpc_address = await nursery.start(
                functools.partial(
                    serve_grpc_api,
                    server,
                    control,
                    "test",
                    "127.0.0.1",
                    0,
                    shutdown=shutdown,
                    exit_timeout=5,
                )
            )
            yield server, http_address, grpc_address
            shutdown.request()
