"""Memory under backpressure: a fast decoupled producer feeding a slow consumer.

Run: ``.venv/bin/python bench/memory.py [--quick] [--chunks K]``. ``--quick`` uses K=8 and
the limits {0, 4} and writes no file; otherwise the plot goes to ``docs/memory.png``.

The ensemble ``pipe`` has two steps. ``producer`` is a decoupled plain Python generator
(``jit=False``, run inline) that yields K responses per request, each a fresh 1 MiB float32
chunk (256×1024) filled with one value. ``consumer`` is an async model that awaits
``trio.sleep(CONSUMER_S)`` (2 ms; filling a chunk takes ~0.03 ms, so the producer is ≥10×
faster) and returns the chunk's value and its sum. The ensemble's ``max_inflight_requests``
takes each value of {0, 1, 4, 16, 64}.

For each limit a fresh subprocess (the same script with ``--one LIMIT``, so that resident
memory is comparable) opens the server, runs one warm-up stream, takes the baseline VmRSS,
then runs 4 concurrent streams of K responses each and consumes them all, while a trio task
polls ``/proc/self/status`` VmRSS and ``server.step_statistics("pipe")`` every 5 ms (the
consumer step's ``in_flight + queued``). It prints one JSON line: peak RSS growth over the
baseline, ``ru_maxrss`` growth, peak intermediates at the consumer step, responses/s and
whether every response arrived with the right value.

Expectation: with limit N the intermediates buffered at a step stay ≤ N and the RSS growth
≤ N × 1 MiB plus a constant. Orchestrion runs one iteration of a decoupled step at a time
per stream (the producer is resumed only once its previous response was handed on), so even
with limit 0 (unbounded) at most the number of streams is buffered, not ∝ K as in Triton.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import trio
from _common import table

import orchestrion
from orchestrion.protocols import ModelTransactionPolicy
from orchestrion.testing import ensemble, model, step, tensor

STREAMS = 4
CHUNK_SHAPE = (256, 1024)  # 1 MiB of float32
CONSUMER_S = 0.002
POLL_S = 0.005
LIMITS = (0, 1, 4, 16, 64)
QUICK_LIMITS = (0, 4)
MIB = 1024 * 1024


def produce(N: Any) -> Any:
    """N = [K, stream]: K fresh 1 MiB chunks, chunk i filled with stream * K + i."""
    k, stream = int(N[0]), int(N[1])
    for i in range(k):
        yield {"CHUNK": np.full(CHUNK_SHAPE, stream * k + i, np.float32)}


async def consume(CHUNK: Any) -> dict[str, Any]:
    """Slow: sleeps, then returns (the chunk's value, its sum)."""
    await trio.sleep(CONSUMER_S)
    chunk = np.asarray(CHUNK)
    return {"SUMMARY": np.array([chunk[0, 0], chunk.sum(dtype=np.float64)], np.float32)}


def models(limit: int) -> list[orchestrion.Model]:
    producer = model(
        "producer",
        produce,
        [tensor("N", "INT32", dims=(2,))],
        [tensor("CHUNK", dims=CHUNK_SHAPE)],
        jit=False,
    )
    policy = ModelTransactionPolicy(decoupled=True)
    producer = attrs.evolve(
        producer, config=attrs.evolve(producer.config, model_transaction_policy=policy)
    )
    consumer = model(
        "consumer",
        consume,
        [tensor("CHUNK", dims=CHUNK_SHAPE)],
        [tensor("SUMMARY", dims=(2,))],
        jit=False,
    )
    pipe = ensemble(
        "pipe",
        [tensor("IN", "INT32", dims=(2,))],
        [tensor("OUT", dims=(2,))],
        [
            step("producer", {"N": "IN"}, {"CHUNK": "chunk"}),
            step("consumer", {"CHUNK": "chunk"}, {"SUMMARY": "OUT"}),
        ],
        max_inflight_requests=limit,
    )
    return [producer, consumer, pipe]


def vm_rss() -> int:
    """Resident memory of this process in bytes."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


async def collect(server: orchestrion.AsyncServer, k: int, index: int) -> list[np.ndarray]:
    responses = server.stream_infer("pipe", {"IN": np.array([k, index], np.int32)})
    try:
        return [np.asarray(r.outputs["OUT"]) async for r in responses]
    finally:
        await responses.aclose()


async def measure(limit: int, k: int) -> dict[str, Any]:
    async with orchestrion.open_server(models=models(limit)) as server:
        await collect(server, 2, 0)  # warm-up
        baseline = vm_rss()
        maxrss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        peak_rss = baseline
        peak_mid = 0
        done = trio.Event()

        async def poll() -> None:
            nonlocal peak_rss, peak_mid
            while not done.is_set():
                peak_rss = max(peak_rss, vm_rss())
                consumer_step = server.step_statistics("pipe")[1]
                peak_mid = max(peak_mid, consumer_step.in_flight + consumer_step.queued)
                with trio.move_on_after(POLL_S):
                    await done.wait()

        results: dict[int, list[np.ndarray]] = {}

        async def one(index: int) -> None:
            results[index] = await collect(server, k, index)

        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(poll)
            async with trio.open_nursery() as streams:
                for index in range(STREAMS):
                    streams.start_soon(one, index)
            took = time.perf_counter() - start
            done.set()
        peak_rss = max(peak_rss, vm_rss())
        maxrss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    correct = all(
        len(results[s]) == k
        and sorted(float(r[0]) for r in results[s]) == [float(s * k + i) for i in range(k)]
        and all(float(r[1]) == float(r[0]) * CHUNK_SHAPE[0] * CHUNK_SHAPE[1] for r in results[s])
        for s in range(STREAMS)
    )
    return {
        "limit": limit,
        "chunks": k,
        "rss_growth_mib": (peak_rss - baseline) / MIB,
        "maxrss_growth_mib": (maxrss_after - maxrss_before) / MIB,
        "peak_intermediates": peak_mid,
        "responses_per_s": STREAMS * k / took,
        "responses": sum(len(r) for r in results.values()),
        "correct": correct,
    }


def run_fresh(limit: int, k: int) -> dict[str, Any]:
    """One measurement in a fresh interpreter; its last stdout line is the JSON result."""
    done = subprocess.run(
        [sys.executable, __file__, "--one", str(limit), "--chunks", str(k)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [str(r["limit"]) for r in results]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.bar(labels, [r["rss_growth_mib"] for r in results], color="tab:blue")
    left.set_xlabel("max_inflight_requests (0 = unbounded)")
    left.set_ylabel("peak RSS growth (MiB)")
    left.set_title("Peak resident memory over baseline")
    right.bar(labels, [r["peak_intermediates"] for r in results], color="tab:orange")
    right.axhline(STREAMS, color="grey", linestyle="--", label=f"{STREAMS} streams")
    right.set_xlabel("max_inflight_requests (0 = unbounded)")
    right.set_ylabel("peak chunks at consumer step")
    right.set_title("Intermediates buffered (in flight + queued)")
    right.legend()
    k = results[0]["chunks"]
    fig.suptitle(f"{STREAMS} streams × {k} chunks of 1 MiB, producer ≥10× faster than consumer")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="K=8, limits {0, 4}, no file")
    parser.add_argument("--chunks", type=int, default=None, help="responses per stream (64)")
    parser.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    k = args.chunks or (8 if args.quick else 64)
    if args.one is not None:
        print(json.dumps(trio.run(measure, args.one, k)))
        return
    limits = QUICK_LIMITS if args.quick else LIMITS
    results = [run_fresh(limit, k) for limit in limits]
    rows = [
        [
            str(r["limit"]) if r["limit"] else "0 (unbounded)",
            f"{r['rss_growth_mib']:.1f}",
            f"{r['maxrss_growth_mib']:.1f}",
            str(r["peak_intermediates"]),
            f"{r['responses_per_s']:.0f}",
            f"{r['responses']}/{STREAMS * k}",
            "yes" if r["correct"] else "NO",
        ]
        for r in results
    ]
    header = [
        "max_inflight",
        "peak RSS +MiB",
        "ru_maxrss +MiB",
        "peak chunks at consumer",
        "responses/s",
        "arrived",
        "correct",
    ]
    print(
        f"{STREAMS} concurrent streams × {k} responses of 1 MiB; consumer {CONSUMER_S * 1e3:g} ms"
    )
    print(table(header, rows))
    print(
        "\nExpected: with limit N, peak chunks at the consumer step <= N and RSS growth <= "
        f"N x 1 MiB + a constant; with limit 0, <= {STREAMS} (one iteration at a time per "
        "stream, not proportional to K as with Triton's unbounded limit)."
    )
    ok = all(r["correct"] and r["responses"] == STREAMS * k for r in results)
    bounded = all(
        r["peak_intermediates"] <= (r["limit"] or STREAMS) and r["peak_intermediates"] <= STREAMS
        for r in results
    )
    print(f"all responses arrived and correct: {ok}; intermediates within bound: {bounded}")
    if not args.quick:
        path = Path(__file__).resolve().parent.parent / "docs" / "memory.png"
        plot(results, path)
        print(f"plot: {path}")
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
