"""The benchmarks still run (tiny sizes; nothing about speed is asserted here)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.mark.parametrize(
    ("command", "expected"),
    [
        (
            [
                "pipeline.py",
                "--requests",
                "40",
                "--warmup",
                "10",
                "--repeats",
                "1",
                "--concurrency",
                "1,4",
            ],
            ["µs"],
        ),
        (["step_costs.py", "--requests", "40"], ["µs"]),
        (["python_calls.py", "--requests", "5", "--warmup", "2"], ["Python calls per request"]),
        (
            ["control_flow.py", "--rounds", "1", "--requests", "5", "--items", "8"],
            ["skipped step", "map item", "loop iteration", "declared ÷ hand-written"],
        ),
        (
            ["on_demand.py", "--models", "3", "--room", "2", "--rounds", "1"],
            ["first request ms", "room for 2 req/s"],
        ),
        # Starts its own redis-server, prints its three tables, stops it.
        (["cache.py", "--quick"], ["µs", "GB/s", "lookups/s"]),
        # Starts its own OTLP receiver; telemetry off, metrics, tracing at 100% and 1%.
        (["telemetry.py", "--quick"], ["Spans per request", "µs", "req/s", "tracing 1%"]),
        # No batching and three queue delays, plain JAX at batch 1 and 64; answers checked.
        (["batching.py", "--quick"], ["req/s", "mean batch", "plain JAX", "target"]),
        # Without a GPU, the GPU script's dry run on the CPU.
        (["gpu.py", "--allow-cpu", "--quick"], ["rows/s", "served by orchestrion"]),
        (["memory.py", "--quick"], ["peak chunks at consumer", "correct: True"]),
        (["bridge.py", "--calls", "400"], ["TrioBridge.call, x16", "µs per call"]),
        (
            ["asyncio_api.py", "--requests", "100", "--concurrency", "1,4"],
            ["orchestrion.aio", "asyncio.to_thread(Server.infer)", "aio ÷ this"],
        ),
        (
            ["triton_python.py", "--seconds", "0.1"],
            ["Triton python model (unchanged)", "bls -> add_sub", "INT64 (x64 scoped)"],
        ),
        (["vs_triton/inprocess.py", "--requests", "300"], ["no batching", "CPU µs/request"]),
        (["soak.py", "--quick"], ["RSS slope after warm-up", "RSS MiB"]),
        (["large_requests.py", "--quick"], ["peak / size", "slowest probe ms"]),
        # The in-process parts only: Ray Serve and the perf_analyzer runs need downloads.
        (
            ["compare.py", "--quick", "--skip", "ray,network", "--no-docs"],
            ["floor (hand-written trio)", "direct calls (no server, serial)", "peak RSS MiB"],
        ),
        # One network as ONNX Runtime and jitted JAX, in orchestrion and called directly.
        (
            ["onnx_models.py", "--quick", "--batches", "1,4", "--clients", "1,4"],
            ["One client", "orchestrion ONNX", "ONNX Runtime, direct", "mean batch"],
        ),
        # The canned gRPC servers answer perf_analyzer's RPCs with orchestrion's own bytes.
        (
            ["grpc_ceiling.py", "--check"],
            [
                "grpcio asyncio, canned: answers as orchestrion",
                "grpcio sync (1 thread), canned: answers as orchestrion",
                "grpcio sync (8 threads), canned: answers as orchestrion",
            ],
        ),
    ],
    ids=[
        "pipeline",
        "step_costs",
        "python_calls",
        "control_flow",
        "on_demand",
        "cache",
        "telemetry",
        "batching",
        "gpu",
        "memory",
        "bridge",
        "asyncio_api",
        "triton_python",
        "vs_triton_inprocess",
        "soak",
        "large_requests",
        "compare",
        "onnx_models",
        "grpc_ceiling",
    ],
)
def test_benchmark_runs(command: list[str], expected: list[str]) -> None:
    """Each benchmark script completes and prints its tables."""
    result = subprocess.run(
        [sys.executable, str(BENCH / command[0]), *command[1:]],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    for text in expected:
        assert text in result.stdout


def test_replicas_benchmark_runs() -> None:
    """bench/replicas.py builds its hosts, prints its tables and removes them (root only)."""
    from orchestrion.testing import haproxy_unavailable, netns_unavailable

    why = netns_unavailable() or haproxy_unavailable()
    if why:
        pytest.skip(why)
    result = subprocess.run(
        [sys.executable, str(BENCH / "replicas.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    for text in ("req/s", "gRPC p99 ms", "errors seen by clients"):
        assert text in result.stdout
