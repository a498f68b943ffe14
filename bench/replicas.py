"""Replicas across hosts: throughput and latency through HAProxy with 1, 2 and 3 orchestrion
replicas sharing a Redis Cluster, and what clients see when replicas fail.

The site is `orchestrion.testing.ReplicaSite`: hosts made of network namespaces (root
needed), a 3-primary, 3-replica Redis Cluster on two of them, three replicas of
``orchestrion serve`` on three more, HAProxy in front (health checks, retries). The model
waits 5 ms per request, one request at a time per replica (a model holding its device);
HAProxy is given 1, 2 or 3 replicas (the others are disabled in it). Two loads:

- ``new inputs``: every request a new input, so every one runs the model (cache misses);
- ``repeated inputs``: 200 inputs in turn, so nearly every request is a cache hit, answered
  by whichever replica gets it from the shared cache.

Then the fault run of tests/reliability/test_replicas_across_hosts.py: one replica SIGKILLed
and restarted, another drained at HAProxy, SIGTERMed and restarted (a rolling deploy),
under load; what the clients saw.

    sudo .venv/bin/python bench/replicas.py [--seconds 5] [--clients 8] [--quick]
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path

from _common import table

from orchestrion.testing import (
    ReplicaLoad,
    ReplicaSite,
    haproxy_unavailable,
    netns_unavailable,
    percentile,
)


def _admin(site: ReplicaSite, command: str) -> None:
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(str(site.stats_socket))
        sock.sendall(command.encode() + b"\n")
        sock.recv(65536)


def _use(site: ReplicaSite, count: int) -> None:
    """Let HAProxy send to the first ``count`` replicas only."""
    for i, host in enumerate(site.app_hosts):
        verb = "enable" if i < count else "disable"
        for backend in ("replicas_http", "replicas_grpc"):
            _admin(site, f"{verb} server {backend}/{host}")
    site.wait_balanced(set(site.app_hosts[:count]))


def _measure(
    site: ReplicaSite, seconds: float, clients: int, distinct: int | None, first: int
) -> list[str]:
    half = max(1, clients // 2)
    load = ReplicaLoad(
        site.http, site.grpc, http_clients=half, grpc_clients=half, distinct=distinct, first=first
    ).start()
    time.sleep(min(1.0, seconds / 4))  # warm: connections made, first requests done
    start_count, start = load.count(), time.monotonic()
    time.sleep(seconds)
    window = time.monotonic() - start
    outcomes = load.stop()[start_count:]
    errors = sum(o.error is not None for o in outcomes)
    row = [f"{len(outcomes) / window:,.0f}"]
    for protocol in ("http", "grpc"):
        latencies = [o.latency for o in outcomes if o.protocol == protocol]
        row += [
            f"{percentile(latencies, 0.5) * 1000:.1f}",
            f"{percentile(latencies, 0.99) * 1000:.1f}",
        ]
    return [*row, str(errors)]


def _faults(site: ReplicaSite, phase: float) -> list[list[str]]:
    app1, app2, _ = site.app_hosts
    before = site.retries()
    load = ReplicaLoad(site.http, site.grpc).start()
    events = []
    try:
        time.sleep(phase)
        events.append(("SIGKILL app1", load.count()))
        site.kill_replica(app1, signal.SIGKILL)
        time.sleep(phase)
        site.start_replica(app1)
        site.wait_balanced(set(site.app_hosts))
        events.append(("app1 restarted", load.count()))
        time.sleep(phase)
        events.append(("app2 drained at HAProxy, then SIGTERM", load.count()))
        site.drain_replica(app2)
        code = site.kill_replica(app2, signal.SIGTERM)
        time.sleep(phase)
        site.start_replica(app2)
        site.wait_balanced(set(site.app_hosts))
        events.append((f"app2 restarted (it exited {code})", load.count()))
        time.sleep(phase)
    finally:
        outcomes = load.stop()
    after = site.retries()
    errors = [o for o in outcomes if o.error]
    rows = [[what, f"{at:,}"] for what, at in events]
    rows.append(["requests in all", f"{len(outcomes):,}"])
    rows.append(["answered right", f"{len(outcomes) - len(errors):,}"])
    rows.append(["errors seen by clients", str(len(errors))])
    for key in ("retried", "redispatched", "connect_errors", "response_errors"):
        rows.append([f"HAProxy: {key.replace('_', ' ')}", str(after[key] - before[key])])
    latencies = [o.latency for o in outcomes]
    rows.append(
        [
            "p99 / slowest (ms)",
            f"{percentile(latencies, 0.99) * 1000:.0f} / {max(latencies) * 1000:.0f}",
        ]
    )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="measured time per row")
    parser.add_argument("--clients", type=int, default=8, help="client threads (half gRPC)")
    parser.add_argument("--quick", action="store_true", help="1 s rows (a smoke run)")
    args = parser.parse_args()
    why = netns_unavailable() or haproxy_unavailable()
    if why:
        print(f"bench/replicas.py cannot run here: {why}")
        return 0
    seconds = 1.0 if args.quick else args.seconds
    header = [
        "replicas",
        "req/s",
        "HTTP p50 ms",
        "HTTP p99 ms",
        "gRPC p50 ms",
        "gRPC p99 ms",
        "errors",
    ]
    with tempfile.TemporaryDirectory() as folder:
        site = ReplicaSite(Path(folder))
        started = time.monotonic()
        try:
            site.open()
            print(
                f"site up in {time.monotonic() - started:.1f} s "
                f"({os.cpu_count()} cores for everything)\n"
            )
            for title, distinct in (
                ("new inputs (every request runs the model)", None),
                ("repeated inputs (200 in turn: cache hits)", 200),
            ):
                rows = []
                for count in (1, 2, 3):
                    _use(site, count)
                    first = count * 1_000_000  # new inputs: none met in an earlier row
                    measured = _measure(site, seconds, args.clients, distinct, first)
                    rows.append([str(count), *measured])
                print(f"{title}, {args.clients} clients, {seconds:g} s a row")
                print(table(header, rows), "\n")
            _use(site, 3)
            print("faults under load (8 clients): when each event happened, in requests")
            print(table(["", "value"], _faults(site, seconds / 2)))
        finally:
            site.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
