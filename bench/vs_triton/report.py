"""Prints the tables of bench/vs_triton.sh from perf_analyzer's CSV files (standard library only).

    python bench/vs_triton/report.py RESULTS_DIR [--servers "triton orchestrion"] ...

RESULTS_DIR/<server>/<protocol>_cache-<off|on>_c<concurrency>.csv, one perf_analyzer `-f` file
per run. Cache "on" rows are labelled "hits": perf_analyzer's random input is one buffer, so
every request after the first is a cache hit.
"""

from __future__ import annotations

import argparse
import csv
import re
from pathlib import Path

# infer/s, p50 µs, p99 µs, stable; an unstable run has its last window's throughput only.
Row = tuple[float, float | None, float | None, bool]

_PASS = re.compile(r"Pass \[\d+\] throughput: ([\d.]+) infer/sec")


def read(stem: Path) -> Row | None:
    csv_path, log_path = stem.with_suffix(".csv"), stem.with_suffix(".log")
    if csv_path.is_file():
        with csv_path.open(newline="") as f:
            rows = list(csv.DictReader(f))
        if rows:
            r = rows[-1]
            return (
                float(r["Inferences/Second"]),
                float(r["p50 latency"]),
                float(r["p99 latency"]),
                True,
            )
    if log_path.is_file():  # no stable measurement: perf_analyzer -v logged each window
        passes = _PASS.findall(log_path.read_text(errors="replace"))
        if passes:
            return float(passes[-1]), None, None, False
    return None


def cache_label(cache: str) -> str:
    return "hits" if cache == "on" else "off"


def fmt(value: float | None, digits: int = 0, stable: bool = True) -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}" + ("" if stable else "*")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("results", type=Path)
    parser.add_argument("--servers", default="triton orchestrion")
    parser.add_argument("--protocols", default="grpc http")
    parser.add_argument("--cache", default="off on")
    parser.add_argument("--concurrency", default="1 4 8")
    parser.add_argument(
        "--min-ratio",
        type=float,
        default=None,
        help="exit 1 when a row's throughput ratio (orchestrion / Triton) is below this: "
        "the regression check (a ratio, since the machines are shared and noisy)",
    )
    args = parser.parse_args()
    servers = args.servers.split()
    keys = [
        (proto, cache, int(c))
        for proto in args.protocols.split()
        for cache in args.cache.split()
        for c in args.concurrency.split()
    ]
    data = {
        (s, k): read(args.results / s / f"{k[0]}_cache-{k[1]}_c{k[2]}")
        for s in servers
        for k in keys
    }

    head = f"{'protocol':<8} {'cache':<5} {'conc':>4}"
    for s in servers:
        startup = {c: (args.results / s / f"startup_cache-{c}.txt") for c in args.cache.split()}
        ready = ", ".join(
            f"cache {c}: {p.read_text().strip()} s" for c, p in startup.items() if p.is_file()
        )
        print(f"\n{s} (ready in {ready or '?'})")
        print(f"{head} {'infer/s':>10} {'p50 µs':>9} {'p99 µs':>9}")
        for k in keys:
            row = data[(s, k)]
            t, p50, p99, stable = row if row else (None, None, None, True)
            print(
                f"{k[0]:<8} {cache_label(k[1]):<5} {k[2]:>4} "
                f"{fmt(t, stable=stable):>10} {fmt(p50):>9} {fmt(p99):>9}"
            )

    unstable = any(row and not row[3] for row in data.values())
    note = "\n* no stable measurement: the last window's throughput, no percentiles"
    if len(servers) < 2:
        if unstable:
            print(note)
        return
    a, b = servers[1], servers[0]  # orchestrion / triton with the default order
    print(f"\nside by side: {a} / {b}")
    print(
        f"{head} {b + ' inf/s':>14} {a + ' inf/s':>17} {'ratio':>6}"
        f" {b + ' p50':>11} {a + ' p50':>15} {b + ' p99':>11} {a + ' p99':>15}"
    )
    below = []
    for k in keys:
        rb, ra = data[(b, k)], data[(a, k)]
        ratio = ra[0] / rb[0] if ra and rb and rb[0] else None
        if args.min_ratio is not None and (ratio is None or ratio < args.min_ratio):
            below.append(f"{k[0]} cache {cache_label(k[1])} c={k[2]}: {fmt(ratio, 2)}")
        both_stable = bool(ra and rb and ra[3] and rb[3])
        print(
            f"{k[0]:<8} {cache_label(k[1]):<5} {k[2]:>4} "
            f"{fmt(rb[0] if rb else None, stable=not rb or rb[3]):>14} "
            f"{fmt(ra[0] if ra else None, stable=not ra or ra[3]):>17} "
            f"{fmt(ratio, 2, stable=both_stable or ratio is None):>6} "
            f"{fmt(rb[1] if rb else None):>11} {fmt(ra[1] if ra else None):>15} "
            f"{fmt(rb[2] if rb else None):>11} {fmt(ra[2] if ra else None):>15}"
        )
    print("(latencies in µs; cache 'hits': one repeated input with the response cache on)")
    if unstable:
        print(note)
    if below:
        print(f"\nbelow the ratio {args.min_ratio:g}: " + "; ".join(below))
        raise SystemExit(1)


if __name__ == "__main__":
    main()
