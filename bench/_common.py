"""What the benchmarks share: text tables, call-count calibration, and bench/vs_triton.sh."""

from __future__ import annotations

import os
import runpy
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent


def table(header: Sequence[str], rows: Sequence[Sequence[str]], left: int = 1) -> str:
    """Columns padded to fit; the first ``left`` columns left-aligned, the others right."""
    cells = [list(header), *(list(r) for r in rows)]
    widths = [max(len(line[i]) for line in cells) for i in range(len(header))]
    lines = []
    for number, line in enumerate(cells):
        parts = [
            cell.ljust(width) if i < left else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(line, widths, strict=True))
        ]
        lines.append("  ".join(parts).rstrip())
        if number == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def calibrate(fn: Callable[[], object], batch_seconds: float) -> int:
    """How many calls of ``fn`` take about ``batch_seconds`` (at least one)."""
    fn()
    calls = 1
    while True:
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        took = time.perf_counter() - start
        if took >= batch_seconds or calls >= 1 << 22:
            return calls
        calls = max(calls * 2, int(calls * batch_seconds / max(took, 1e-9)))


def report_reader() -> Callable[[Path], Any]:
    """``read`` of bench/vs_triton/report.py: one perf_analyzer result (its CSV, or its log
    when no window was stable) as (infer/s, p50 µs, p99 µs, stable), or None. The script is
    run from its file (bench/ is no package): nothing is added to ``sys.path``."""
    reader: Callable[[Path], Any] = runpy.run_path(str(BENCH / "vs_triton" / "report.py"))["read"]
    return reader


def run_vs_triton(settings: Mapping[str, str], quick: bool) -> Callable[[Path], Any]:
    """Run bench/vs_triton.sh with ``settings`` (its environment variables; shorter windows
    and fewer trials when ``quick``); returns `report_reader`'s ``read``."""
    env = {**os.environ, **settings}
    if quick:
        env |= {"MEASUREMENT_INTERVAL": "1500", "MAX_TRIALS": "4"}
    subprocess.run(["bash", str(BENCH / "vs_triton.sh")], check=True, env=env)
    return report_reader()
