"""The benchmarks still run (tiny sizes; nothing about speed is asserted here)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.mark.parametrize(
    "command",
    [
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
        ["step_costs.py", "--requests", "40"],
    ],
    ids=["pipeline", "step_costs"],
)
def test_benchmark_runs(command: list[str]) -> None:
    """Each benchmark script completes and prints its table."""
    result = subprocess.run(
        [sys.executable, str(BENCH / command[0]), *command[1:]],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "µs" in result.stdout


def test_cache_benchmark_runs() -> None:
    """bench/cache.py --quick starts its own redis-server, prints its three tables, stops it."""
    result = subprocess.run(
        [sys.executable, str(BENCH / "cache.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "µs" in result.stdout
    assert "GB/s" in result.stdout
    assert "lookups/s" in result.stdout
