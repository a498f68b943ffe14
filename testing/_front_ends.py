"""The HTTP and gRPC front ends around an in-process server, for tests in trio."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from orchestrion import AsyncServer, open_server
from orchestrion.frontends._control import ModelControl
from orchestrion.frontends._grpc_service import open_grpc_api
from orchestrion.frontends._http_api import HttpApi, open_http_api


@contextlib.asynccontextmanager
async def front_ends(
    repository: Path, **server_options: Any
) -> AsyncIterator[tuple[AsyncServer, str, str]]:
    """A server on ``repository`` with both front ends on free loopback ports: the server,
    the HTTP address and the gRPC address."""
    async with open_server(repository, **server_options) as server:
        control = ModelControl(server)
        api = HttpApi(server, control, "test")
        async with (
            open_http_api(api, port=0, exit_timeout=5) as (http_address, _),
            open_grpc_api(server, control, "test", port=0, exit_timeout=5) as (grpc_address, _),
        ):
            yield server, http_address, grpc_address
