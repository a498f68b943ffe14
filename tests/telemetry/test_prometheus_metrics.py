"""Prometheus metrics: Triton's names, labels, types and values after known traffic, the
/metrics endpoint, and a real Prometheus server scraping it."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

import orchestrion
from orchestrion.protocols import ConfigError, InferenceError, InvalidRequestError
from orchestrion.testing import cached, chain, gated, model, tensor
from support.metrics import metric_value
from support.prometheus import PrometheusServer, wait_for

X = np.arange(16, dtype=np.float32)
LOCAL = "local,size=1048576"


def families(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def type_lines(text: str) -> dict[str, str]:
    lines = [line.split() for line in text.splitlines() if line.startswith("# TYPE ")]
    return {parts[2]: parts[3] for parts in lines}


def traffic_models() -> list[orchestrion.Model]:
    def flaky(X: Any) -> dict[str, Any]:
        if X[0] < 0:
            raise RuntimeError("negative")
        return {"Y": X + 1}

    return [
        cached(model("a", flaky, [tensor("X")], [tensor("Y")], jit=False)),
        model("b", lambda X: {"Y": X * 2}, [tensor("X")], [tensor("Y")], jit=False),
        chain("pipe", "a", "b"),
    ]


async def known_traffic(server: orchestrion.AsyncServer) -> None:
    """3 pipe requests (a: 1 miss, 2 hits), 1 backend failure, 1 rejected request."""
    for _ in range(3):
        await server.infer("pipe", {"IN": X})
    with pytest.raises(InferenceError):
        await server.infer("pipe", {"IN": -(X + 1)})
    with pytest.raises(InvalidRequestError):
        await server.infer("b", {"X": X.astype(np.float64)})


async def test_triton_metrics_after_known_traffic() -> None:
    """Names, labels, types and values are Triton's; hits are successes, not inferences."""
    async with orchestrion.open_server(models=traffic_models(), cache_config=LOCAL) as server:
        await known_traffic(server)
        text = server.metrics_text()
    types = type_lines(text)
    for name in (
        "nv_inference_request_success",
        "nv_inference_request_failure",
        "nv_inference_count",
        "nv_inference_exec_count",
        "nv_inference_request_duration_us",
        "nv_inference_queue_duration_us",
        "nv_inference_compute_input_duration_us",
        "nv_inference_compute_infer_duration_us",
        "nv_inference_compute_output_duration_us",
        "nv_cache_num_hits_per_model",
        "nv_cache_num_misses_per_model",
        "nv_cache_hit_duration_per_model",
        "nv_cache_miss_duration_per_model",
    ):
        assert types[name] == "counter", name  # exactly Triton's name: no _total
    for name in ("nv_inference_pending_request_count", "nv_cache_num_entries", "nv_cache_util"):
        assert types[name] == "gauge", name
    assert metric_value(text, "nv_inference_request_success", model="pipe", version="1") == 3
    assert metric_value(text, "nv_inference_request_success", model="a") == 3
    assert metric_value(text, "nv_inference_count", model="a") == 1  # the miss (not hits, failures)
    assert metric_value(text, "nv_inference_exec_count", model="a") == 2
    assert metric_value(text, "nv_inference_exec_count", model="b") == 3
    assert metric_value(text, "nv_inference_exec_count", model="pipe") == 0
    assert metric_value(text, "nv_inference_request_failure", model="a", reason="BACKEND") == 1
    assert metric_value(text, "nv_inference_request_failure", model="pipe", reason="BACKEND") == 1
    assert metric_value(text, "nv_inference_request_failure", model="b", reason="REJECTED") == 1
    assert metric_value(text, "nv_inference_request_failure", model="b", reason="CANCELED") == 0
    assert metric_value(text, "nv_cache_num_hits_per_model", model="a") == 2
    assert metric_value(text, "nv_cache_num_misses_per_model", model="a") == 2
    assert metric_value(text, "nv_cache_hit_duration_per_model", model="a") >= 0
    # Per-model cache metrics only for models with the cache enabled.
    assert 'nv_cache_num_hits_per_model{model="b"' not in text
    assert metric_value(text, "nv_cache_num_entries") == 1
    assert metric_value(text, "nv_cache_num_lookups") == 4
    assert metric_value(text, "nv_cache_num_hits") == 2
    assert metric_value(text, "nv_cache_num_evictions") == 0
    assert 0 < metric_value(text, "nv_cache_util") < 1
    assert metric_value(text, "nv_inference_request_duration_us", model="pipe") > 0
    assert metric_value(text, "orchestrion_model_load_seconds", model="b") > 0
    assert metric_value(text, "orchestrion_step_queue_depth", ensemble="pipe", step="0") == 0
    assert types["orchestrion_step_blocked_seconds_total"] == "counter"
    assert metric_value(text, "orchestrion_cache_round_trips_total", cache="local") == 0


async def test_no_cache_metrics_without_a_cache() -> None:
    """A server without a cache exports no nv_cache_* metrics at all."""
    async with orchestrion.open_server(models=traffic_models()) as server:
        await server.infer("pipe", {"IN": X})
        text = server.metrics_text()
    assert "nv_cache" not in text
    assert metric_value(text, "nv_inference_exec_count", model="a") == 1


async def test_pending_counts_and_timeouts(autojump_clock: trio.testing.MockClock) -> None:
    """Waiting requests show as pending on the composing model, never on the ensemble; a
    timeout counts as CANCELED."""
    gate, never = trio.Event(), trio.Event()
    models = [
        gated("slow", gate),
        gated("slow2", gate),
        gated("stuck", never),
        chain("pipe", "slow", "slow2"),
    ]
    async with orchestrion.open_server(models=models) as server:
        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(server.infer, "pipe", {"IN": X})
            await trio.testing.wait_all_tasks_blocked()
            text = server.metrics_text()
            gate.set()
        with pytest.raises(orchestrion.InferenceTimeoutError):
            await server.infer("stuck", {"X": X}, timeout=0.5)
        after = server.metrics_text()
    assert metric_value(text, "nv_inference_pending_request_count", model="slow") == 3
    assert metric_value(text, "nv_inference_pending_request_count", model="pipe") == 0
    assert (
        metric_value(after, "nv_inference_request_failure", model="stuck", reason="CANCELED") == 1
    )
    assert metric_value(after, "nv_inference_pending_request_count", model="slow") == 0


async def test_metrics_endpoint_serves_the_same_text() -> None:
    """GET /metrics over a real socket returns the text; other paths are 404."""
    async with orchestrion.open_server(
        models=traffic_models(), cache_config=LOCAL, metrics_port=0
    ) as server:
        await server.infer("pipe", {"IN": X})
        assert server.metrics_url is not None
        assert server.metrics_url.startswith("http://127.0.0.1:")
        url = server.metrics_url

        def get(path: str) -> tuple[int, str, str]:
            try:
                with urllib.request.urlopen(url.replace("/metrics", path), timeout=5) as r:
                    return r.status, r.headers["content-type"], r.read().decode()
            except urllib.error.HTTPError as exc:
                return exc.code, "", ""

        status, kind, body = await trio.to_thread.run_sync(get, "/metrics")
        missing, _, _ = await trio.to_thread.run_sync(get, "/other")
        assert status == 200
        assert kind.startswith("text/plain; version=0.0.4")
        assert metric_value(body, "nv_inference_request_success", model="pipe") == 1
        assert missing == 404
    with pytest.raises(urllib.error.URLError):  # the endpoint closed with the server
        await trio.to_thread.run_sync(get, "/metrics")


async def test_a_taken_metrics_port_is_a_clear_error() -> None:
    """Binding a port that is in use fails at start-up, naming the port."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=f"cannot serve metrics on 127.0.0.1:{port}"):
            async with orchestrion.open_server(models=traffic_models(), metrics_port=port):
                pass


def test_blocking_server_metrics() -> None:
    """The blocking facade exposes metrics_text and metrics_url."""
    with orchestrion.Server(models=traffic_models(), metrics_port=0) as server:
        server.infer("pipe", {"IN": X})
        assert server.metrics_url is not None
        assert metric_value(server.metrics_text(), "nv_inference_exec_count", model="b") == 1


async def test_a_real_prometheus_scrapes_the_endpoint(tmp_path: Path) -> None:
    """Debian's prometheus scrapes /metrics and answers queries with the served values."""
    async with orchestrion.open_server(
        models=traffic_models(), cache_config=LOCAL, metrics_port=0
    ) as server:
        await known_traffic(server)
        assert server.metrics_url is not None
        target = server.metrics_url.removeprefix("http://").removesuffix("/metrics")
        prometheus = PrometheusServer(tmp_path, target)
        try:

            def scraped() -> Any:
                result = prometheus.api(
                    "query", query='nv_inference_request_success{model="pipe"}'
                )["result"]
                return result if result and result[0]["value"][1] == "3" else None

            result = await trio.to_thread.run_sync(wait_for, scraped, 30, "a scrape")
            targets = await trio.to_thread.run_sync(prometheus.api, "targets")
            failures = await trio.to_thread.run_sync(
                lambda: prometheus.api(
                    "query", query='nv_inference_request_failure{model="a",reason="BACKEND"}'
                )["result"]
            )
            metadata = await trio.to_thread.run_sync(
                lambda: prometheus.api("metadata", metric="nv_inference_count")
            )
        finally:
            log = prometheus.stop()
    assert result[0]["metric"]["version"] == "1", log
    assert targets["activeTargets"][0]["health"] == "up"
    assert failures[0]["value"][1] == "1"
    assert metadata["nv_inference_count"][0]["type"] == "counter"
