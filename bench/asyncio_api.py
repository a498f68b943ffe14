"""An asyncio application calling orchestrion: the asyncio API against a thread per request.

Two ways an asyncio program (FastAPI, aiohttp) can call the same server, side by side in one
run, on the tiny pipeline of bench/pipeline.py (three jitted steps, fused):

- ``orchestrion.aio``: ``await server.infer(...)`` on the application's loop; each call crosses
  to the server's trio thread through the bridge, no thread per request;
- ``asyncio.to_thread(server.infer, ...)`` with the blocking `orchestrion.Server`: each call
  takes a thread from asyncio's default pool, which blocks in the server's portal.

C asyncio tasks call in a loop for N requests; the table shows requests per second and the
p50 and p99 latency at each concurrency, and the ratio of the two.

    .venv/bin/python bench/asyncio_api.py [--requests 3000] [--concurrency 1,16,64]
"""

from __future__ import annotations

import argparse
import asyncio
import runpy
import statistics
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
from _common import table

import orchestrion
import orchestrion.aio

HERE = Path(__file__).resolve().parent
X = np.arange(16, dtype=np.float32).reshape(1, 16)


def _models() -> list[orchestrion.Model]:
    models: list[orchestrion.Model] = runpy.run_path(str(HERE / "pipeline.py"))[
        "orchestrion_models"
    ]()
    return models


async def _drive(
    call: Callable[[], Awaitable[Any]], n: int, concurrency: int
) -> tuple[float, float, float]:
    for _ in range(100):
        await call()
    latencies: list[float] = []
    left = n

    async def client() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            start = time.perf_counter()
            await call()
            latencies.append(time.perf_counter() - start)

    began = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    took = time.perf_counter() - began
    latencies.sort()
    p99 = latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))]
    return n / took, statistics.median(latencies) * 1e6, p99 * 1e6


async def main(requests: int, concurrencies: list[int]) -> None:
    models = _models()
    rows: list[tuple[str, ...]] = []
    results: dict[tuple[str, int], float] = {}
    async with orchestrion.aio.open_server(models=models) as server:
        for concurrency in concurrencies:
            rate, p50, p99 = await _drive(
                lambda: server.infer("pipeline", {"INPUT": X}), requests, concurrency
            )
            results["aio", concurrency] = rate
            rows.append(
                (
                    "orchestrion.aio",
                    str(concurrency),
                    f"{rate:,.0f}",
                    f"{p50:,.0f}",
                    f"{p99:,.0f}",
                    "",
                )
            )
    blocking = await asyncio.to_thread(orchestrion.Server(models=models).open)
    try:
        for concurrency in concurrencies:
            rate, p50, p99 = await _drive(
                lambda: asyncio.to_thread(blocking.infer, "pipeline", {"INPUT": X}),
                requests,
                concurrency,
            )
            ratio = results["aio", concurrency] / rate
            rows.append(
                (
                    "asyncio.to_thread(Server.infer)",
                    str(concurrency),
                    f"{rate:,.0f}",
                    f"{p50:,.0f}",
                    f"{p99:,.0f}",
                    f"{ratio:.2f}",
                )
            )
    finally:
        await asyncio.to_thread(blocking.close)
    header = ("calling from asyncio", "concurrency", "req/s", "p50 µs", "p99 µs", "aio ÷ this")
    print(f"{requests} requests per row after 100 warm-up, the tiny pipeline (fused)")
    print(table(header, sorted(rows, key=lambda r: (int(r[1]), r[0] != "orchestrion.aio"))))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=3000, help="timed requests per row")
    parser.add_argument(
        "--concurrency",
        type=lambda text: [int(c) for c in text.split(",")],
        default=[1, 16, 64],
        help="comma-separated concurrencies",
    )
    args = parser.parse_args()
    asyncio.run(main(args.requests, args.concurrency))
