"""A full Redis under ``orchestrion serve``: at ``maxmemory`` with the policy noeviction (Redis's
default once a limit is set), Redis refuses every write with OOM and still answers reads. That
is not an outage: the entries stored before are still served as hits, new inputs are answered
uncached, one warning is logged, and writes resume by themselves once memory is freed."""

from __future__ import annotations

import http.client
import json
import time
from typing import Any

import numpy as np
import redis

from orchestrion.testing import RedisServer, Served, get
from support.reliability_report import SIZE, record
from support.served import cache_hits, start_server

STORED = 20
"""Inputs cached before Redis fills up."""


def _input(seed: int) -> np.ndarray[Any, Any]:
    return np.random.default_rng(seed).standard_normal((1, 16)).astype(np.float32)


def _infer(connection: http.client.HTTPConnection, x: np.ndarray[Any, Any]) -> None:
    """One request to the cached ``pipeline`` ensemble, its answer checked."""
    body = {
        "inputs": [
            {"name": "INPUT", "datatype": "FP32", "shape": [1, 16], "data": x.ravel().tolist()}
        ]
    }
    connection.request("POST", "/v2/models/pipeline/infer", json.dumps(body))
    response = connection.getresponse()
    data = response.read()
    assert response.status == 200, data
    outputs = {
        o["name"]: np.array(o["data"]).reshape(o["shape"]) for o in json.loads(data)["outputs"]
    }
    pre = x * 2 + 1
    np.testing.assert_allclose(
        outputs["CLASS"], np.stack([pre[:, :8].sum(1), pre[:, 8:].sum(1)], 1), rtol=1e-5, atol=1e-5
    )
    np.testing.assert_allclose(outputs["SEG"], -pre, rtol=1e-5, atol=1e-5)


def _metric(served: Served, name: str) -> float:
    for line in get(served.metrics, "/metrics")[1].decode().splitlines():
        if line.startswith((name + "{", name + " ")):
            return float(line.split()[-1])
    raise AssertionError(f"no {name} in the metrics")


def _entries(client: redis.Redis) -> int:
    return sum(1 for _ in client.scan_iter("orchestrion:*", count=1000))


def _wait_for_entries(client: redis.Redis, count: int, limit: float = 30.0) -> None:
    # Inserts are written after the response: poll Redis (another process) with a deadline.
    deadline = time.monotonic() + limit
    while (found := _entries(client)) < count:
        assert time.monotonic() < deadline, f"{found} entries stored, not {count}"
        time.sleep(0.02)


def test_a_full_redis_refuses_writes_without_an_outage(redis_server: RedisServer) -> None:
    """Redis at maxmemory (noeviction) refuses every write: the entries stored before it filled
    up are still hits, new inputs are answered right and uncached, the server logs one warning
    and no error; once memory is freed, a new input is stored and hits on its next request."""
    served = start_server(
        *(f"--cache-config={value}" for value in redis_server.cache_config),
        "--exit-timeout-secs=30",
    )
    client = redis.Redis(host="127.0.0.1", port=redis_server.port)
    connection = http.client.HTTPConnection(served.http, timeout=30)
    rounds = max(300, SIZE // 10)
    try:
        for seed in range(STORED):
            _infer(connection, _input(seed))
        _wait_for_entries(client, STORED)
        fillers = redis_server.fill()
        hits_before = cache_hits(served)
        failures_before = _metric(served, "orchestrion_cache_insert_failures_total")
        for i in range(rounds):  # every other request a stored input, the others new ones
            _infer(connection, _input(i // 2 % STORED if i % 2 == 0 else 10_000 + i))
        hits = cache_hits(served) - hits_before
        # The last inserts may still be on their way to Redis: wait (bounded) for them.
        deadline = time.monotonic() + 30
        while (
            refused := _metric(served, "orchestrion_cache_insert_failures_total") - failures_before
        ) < rounds // 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        available = _metric(served, "orchestrion_cache_available")
        stored_while_full = _entries(client)
        expected_hits = (rounds + 1) // 2
        assert hits >= 0.95 * expected_hits, f"{hits} hits of {expected_hits} stored inputs"

        client.config_set("maxmemory", 0)  # memory freed: writes are accepted again
        hits_before = cache_hits(served)
        _infer(connection, _input(99_999))
        _wait_for_entries(client, STORED + 1)
        _infer(connection, _input(99_999))
        hit_after = cache_hits(served) - hits_before
    finally:
        connection.close()
        client.close()
        assert served.stop() == 0, served.text()
    assert available == 1
    assert stored_while_full == STORED  # nothing new stored while full
    assert refused >= rounds // 2, refused  # each new input's write counted as not stored
    assert hit_after == 1
    errors = [line for line in served.output if " ERROR " in line]
    assert errors == [], "\n".join(errors)
    warnings = [line for line in served.output if " WARNING orchestrion" in line]
    assert len(warnings) == 1, "\n".join(warnings)
    assert "redis cache refused to store responses" in warnings[0], warnings[0]
    assert "OOM command not allowed" in warnings[0], warnings[0]
    record(
        "Faults",
        "Redis full (maxmemory reached, policy noeviction): every write refused with OOM",
        f"{rounds:,} requests over HTTP, half of them for the {STORED} inputs stored before "
        f"Redis filled up ({fillers} filler keys), half new",
        f"{hits} of {expected_hits} requests for stored inputs served as hits "
        f"({100 * hits / expected_hits:.0f}%), every new input answered right and uncached "
        f"({refused:.0f} writes counted as not stored), the cache never marked down, one "
        "WARNING and no ERROR line; after raising maxmemory a new input was stored and hit "
        "on its second request",
    )
