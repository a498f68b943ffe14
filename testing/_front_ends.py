"""The HTTP and gRPC front ends around an in-process server, for tests in trio."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import trio

from orchestrion import AsyncServer, open_server
from orchestrion.frontends import (
    DirectCalls,
    HttpApi,
    InferenceService,
    ModelControl,
    Shutdown,
    native_available,
    serve_grpc_api,
    serve_http_api,
    serve_native,
)
from orchestrion.protocols import ungrouped

FRONTEND_VARIABLE = "ORCHESTRION_TEST_FRONTEND"
"""Names the front end the test helpers serve with (``native`` or ``python``): `front_ends`
here, and ``--frontend`` in `serve_command`. Unset: native where it is built."""


def frontend_under_test() -> str:
    """The front end the test helpers serve with (see `FRONTEND_VARIABLE`)."""
    chosen = os.environ.get(FRONTEND_VARIABLE, "")
    if chosen:
        return chosen
    return "native" if native_available() else "python"


@contextlib.asynccontextmanager
async def front_ends(
    repository: Path, *, frontend: str | None = None, **server_options: Any
) -> AsyncIterator[tuple[AsyncServer, str, str]]:
    """A server on ``repository`` with both front ends on free loopback ports: the server,
    the HTTP address and the gRPC address. They stop gracefully when the block ends (at once
    when it raises, the error as itself). ``frontend``: ``native`` or ``python`` (default:
    `frontend_under_test`)."""
    frontend = frontend or frontend_under_test()
    async with open_server(repository, **server_options) as server:
        control = ModelControl(server)
        api = HttpApi(server, control, "test")
        shutdown = Shutdown()
        async with ungrouped(trio.open_nursery()) as nursery:
            if frontend == "native":
                service = InferenceService(server, control, DirectCalls(), "test")
                http_address, grpc_address = await nursery.start(
                    functools.partial(
                        serve_native,
                        http=api,
                        http_address=("127.0.0.1", 0),
                        grpc_service=service,
                        grpc_address=("127.0.0.1", 0),
                        max_body=api.max_input_size,
                        body_timeout=60.0,
                        body_min_rate=500.0,
                        header_timeout=60.0,
                        max_connections=1024,
                        max_message_size=256 * 1024 * 1024,
                        shutdown=shutdown,
                        exit_timeout=5,
                    )
                )
            else:
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
