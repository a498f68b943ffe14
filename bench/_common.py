"""What the benchmarks share: text tables and call-count calibration."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence


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
