"""A cached stream under ``orchestrion serve --cache-config local``: the decoupled model
``letters`` (tests/generate_models) streams once, and an identical request replays the same
responses with the same final flags, over a gRPC stream (tritonclient) and over HTTP's
``/generate_stream``; the statistics and Prometheus count the hits."""

from __future__ import annotations

import http.client
import json
import queue
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from orchestrion.testing import Served, get
from support.served import MODELS, start_server

GENERATE_MODELS = MODELS.parent / "generate_models"


@pytest.fixture(scope="module")
def server() -> Iterator[Served]:
    served = start_server("--cache-config", "local,size=1048576", repository=GENERATE_MODELS)
    yield served
    assert served.stop() == 0, served.text()


def _cache_counts(served: Served) -> tuple[int, int, int]:
    """``letters``' cache hits and misses, and its executions, from its statistics."""
    document = json.loads(get(served.http, "/v2/models/letters/stats")[1])
    stats = document["model_stats"][0]
    inference = stats["inference_stats"]
    return (
        int(inference["cache_hit"]["count"]),
        int(inference["cache_miss"]["count"]),
        int(stats["execution_count"]),
    )


def _grpc_stream(served: Served, prompt: str) -> list[tuple[str, bool]]:
    """The letters and final flags of one request on a gRPC stream."""
    received: queue.Queue[Any] = queue.Queue()
    with grpcclient.InferenceServerClient(served.grpc) as client:
        client.start_stream(callback=lambda result, error: received.put((result, error)))
        text = grpcclient.InferInput("PROMPT", [1], "BYTES")
        text.set_data_from_numpy(np.array([prompt.encode()], dtype=object))
        client.async_stream_infer("letters", [text], enable_empty_final_response=True)
        client.stop_stream()
    got = []
    while not received.empty():
        result, error = received.get()
        assert error is None, error
        response = result.get_response()
        final = response.parameters["triton_final_response"].bool_param
        letter = result.as_numpy("LETTER")
        got.append((letter[0].decode() if letter is not None else "", final))
    return got


def _sse(served: Served, prompt: str) -> bytes:
    connection = http.client.HTTPConnection(served.http, timeout=30)
    try:
        connection.request(
            "POST", "/v2/models/letters/generate_stream", json.dumps({"PROMPT": prompt})
        )
        response = connection.getresponse()
        assert response.status == 200
        return response.read()
    finally:
        connection.close()


def test_a_cached_stream_replays_identically_over_grpc(server: Served) -> None:
    before = _cache_counts(server)
    first = _grpc_stream(server, "abc")
    assert first == [("a", False), ("b", False), ("c", True)]
    assert _grpc_stream(server, "abc") == first
    hits, misses, executions = _cache_counts(server)
    assert (hits - before[0], misses - before[1], executions - before[2]) == (1, 1, 1)


def test_a_cached_stream_replays_identically_over_http(server: Served) -> None:
    before = _cache_counts(server)
    first = _sse(server, "hey")
    assert first.count(b"data: ") == 3
    assert _sse(server, "hey") == first
    hits, misses, executions = _cache_counts(server)
    assert (hits - before[0], misses - before[1], executions - before[2]) == (1, 1, 1)
    # The same entry answers the other protocol.
    assert [letter for letter, _ in _grpc_stream(server, "hey")] == ["h", "e", "y"]
    assert _cache_counts(server)[2] - before[2] == 1


def test_an_empty_stream_is_cached_too(server: Served) -> None:
    """A final flag alone (no response): replayed as the same empty stream, whose empty
    final response the client asked for."""
    before = _cache_counts(server)
    assert _grpc_stream(server, "") == [("", True)]
    assert _grpc_stream(server, "") == [("", True)]
    assert _cache_counts(server)[2] - before[2] == 1
