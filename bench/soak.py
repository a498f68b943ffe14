"""Soak: does memory grow while the server keeps serving? RSS per round and its slope.

    .venv/bin/python bench/soak.py [--rounds 12] [--requests 4000] [--quick]

One server (tests/kserve_models, a local cache) with its HTTP and gRPC front ends, driven
round after round by the load of tests/reliability/test_load.py: mixed models (a cached
ensemble, a model that fails on some inputs, an identity model, a plain step) through the
embedding API at concurrency 128, and through HTTP. After a warm-up round the process's RSS
is read after each round; the table shows it, and the least-squares slope in KiB per round
and per 1,000 requests. Every answer is checked, and the server must be at rest after each
round. A slope near zero (within the noise of the allocator) means no leak.
"""

from __future__ import annotations

import argparse
import gc
import time
from pathlib import Path

import numpy as np
import trio
from _common import table

from orchestrion.testing import at_rest, check, embedding_round, front_ends, http_call, rss_kib

MODELS = Path(__file__).resolve().parent.parent / "tests" / "kserve_models"


async def main(rounds: int, requests: int) -> None:
    """Run the rounds and print the table."""
    import http.client

    rows = []
    samples: list[tuple[int, int]] = []
    async with front_ends(MODELS, cache_config="local,size=1048576") as (server, http_address, _):
        for number in range(rounds + 1):
            started = time.perf_counter()

            def http_client() -> None:
                connection = http.client.HTTPConnection(http_address, timeout=60)
                for index in range(0, requests // 4):
                    check(index, http_call(http_address, index, connection))
                connection.close()

            answers: dict[int, object] = {}

            async def embedding(answers: dict[int, object] = answers) -> None:
                answers.update(await embedding_round(server, requests))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(embedding)
                nursery.start_soon(trio.to_thread.run_sync, http_client)
            for index, outcome in answers.items():
                check(index, outcome)
            assert len(answers) == requests
            at_rest(server)
            gc.collect()
            rss = rss_kib()
            took = time.perf_counter() - started
            label = "warm-up" if number == 0 else str(number)
            rows.append(
                [label, f"{requests + requests // 4:,}", f"{took:.1f}", f"{rss / 1024:,.1f}"]
            )
            if number:
                samples.append((number, rss))
    x = np.array([n for n, _ in samples], float)
    y = np.array([r for _, r in samples], float)
    slope = float(np.polyfit(x, y, 1)[0]) if len(samples) > 1 else 0.0
    print(table(["round", "requests", "seconds", "RSS MiB"], rows))
    per_thousand = slope / ((requests + requests // 4) / 1000)
    print(
        f"\nRSS slope after warm-up: {slope:+.1f} KiB per round "
        f"({per_thousand:+.2f} KiB per 1,000 requests)"
    )
    print(f"RSS from the first to the last measured round: {(y[-1] - y[0]) / 1024:+.1f} MiB")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--quick", action="store_true", help="3 rounds of 400 requests")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.requests = 3, 400
    trio.run(main, args.rounds, args.requests)
