"""Prints the table of bench/vs_mlserver.sh from perf_analyzer's files (standard library only).

    python bench/vs_mlserver/report.py RESULTS_DIR [--servers "mlserver mlserver-lean orchestrion"]

RESULTS_DIR/<server>/<protocol>_cache-off_c<concurrency>.csv (perf_analyzer's ``-f`` file, or
its ``-v`` log when no window was stable), startup_cache-off.txt and rss_cache-off.txt, as
written by bench/vs_mlserver.sh. The ratio columns divide orchestrion's throughput by each
MLServer variant's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "vs_triton"))
from report import fmt, read


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path)
    parser.add_argument("--servers", default="mlserver mlserver-lean orchestrion")
    parser.add_argument("--protocols", default="grpc http")
    parser.add_argument("--concurrency", default="1 4 16")
    parser.add_argument("--mlserver-version", default="?")
    args = parser.parse_args()
    servers = args.servers.split()
    peers = [s for s in servers if s != "orchestrion"]
    keys = [(p, int(c)) for p in args.protocols.split() for c in args.concurrency.split()]
    data = {
        (s, k): read(args.results / s / f"{k[0]}_cache-off_c{k[1]}") for s in servers for k in keys
    }

    print(f"\nMLServer {args.mlserver_version}; latencies in µs; * no stable window")
    for s in servers:
        started = args.results / s / "startup_cache-off.txt"
        rss = args.results / s / "rss_cache-off.txt"
        ready = started.read_text().strip() if started.is_file() else "?"
        kib, processes = rss.read_text().split() if rss.is_file() else ("0", "?")
        print(
            f"{s}: model ready in {ready} s,"
            f" peak RSS {int(kib) / 1024:,.0f} MiB ({processes} processes)"
        )

    head = f"{'protocol':<8} {'conc':>4}"
    for s in servers:
        head += f" {s + ' inf/s':>20}"
    if "orchestrion" in servers:
        for p in peers:
            head += f" {'orch/' + p:>18}"
    for s in servers:
        head += f" {s + ' p50':>18} {s + ' p99':>18}"
    print("\n" + head)
    for k in keys:
        line = f"{k[0]:<8} {k[1]:>4}"
        for s in servers:
            row = data[(s, k)]
            line += f" {fmt(row[0] if row else None, stable=not row or row[3]):>20}"
        if "orchestrion" in servers:
            mine = data[("orchestrion", k)]
            for p in peers:
                theirs = data[(p, k)]
                ratio = mine[0] / theirs[0] if mine and theirs and theirs[0] else None
                stable = bool(mine and theirs and mine[3] and theirs[3]) or ratio is None
                line += f" {fmt(ratio, 2, stable=stable):>18}"
        for s in servers:
            row = data[(s, k)]
            line += f" {fmt(row[1] if row else None):>18} {fmt(row[2] if row else None):>18}"
        print(line)


if __name__ == "__main__":
    main()
