"""The tests' model repository (``tests/kserve_models``) served by ``orchestrion serve`` in a
child process or by both front ends in-process, and small requests to it."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import trio

from orchestrion import AsyncServer, testing
from orchestrion.testing import Served, get

MODELS = Path(__file__).resolve().parent.parent / "kserve_models"


def serve_command(*flags: str, repository: Path = MODELS) -> list[str]:
    """`orchestrion.testing.serve_command`, on the tests' repository by default."""
    return testing.serve_command(*flags, repository=repository)


def start_server(*flags: str, repository: Path = MODELS, **options: Any) -> Served:
    """`orchestrion.testing.start_server`, on the tests' repository by default."""
    return testing.start_server(*flags, repository=repository, **options)


def front_ends(
    **server_options: Any,
) -> AbstractAsyncContextManager[tuple[AsyncServer, str, str]]:
    """`orchestrion.testing.front_ends` on the tests' repository."""
    return testing.front_ends(MODELS, **server_options)


def pipeline_body(value: float = 1.0, **parameters: Any) -> bytes:
    """A JSON infer request of ``pipeline``: INPUT, FP32 [1, 16], all ``value``; with
    ``parameters`` when given."""
    document: dict[str, Any] = {
        "inputs": [{"name": "INPUT", "datatype": "FP32", "shape": [1, 16], "data": [value] * 16}]
    }
    if parameters:
        document["parameters"] = parameters
    return json.dumps(document).encode()


def cache_hits(served: Served, model: str = "pipeline") -> int:
    """The cache hits of ``model``, from its statistics over HTTP."""
    stats = json.loads(get(served.http, f"/v2/models/{model}/stats")[1])
    return int(stats["model_stats"][0]["inference_stats"]["cache_hit"]["count"])


def wait_until_live(served: Served, limit: float = 10.0) -> None:
    """Ask ``/v2/health/live`` until it answers 200, for at most ``limit`` seconds."""
    deadline = time.monotonic() + limit
    while (status := get(served.http, "/v2/health/live")[0]) != 200:
        assert time.monotonic() < deadline, status


async def wait_until(condition: Callable[[], bool], limit: float = 30.0) -> None:
    """Poll ``condition`` every 10 ms until it holds, for at most ``limit`` seconds."""
    # Polls: the state changes in reaction to sockets and threads, not to a trio event.
    with trio.fail_after(limit):
        while not condition():  # noqa: ASYNC110
            await trio.sleep(0.01)
