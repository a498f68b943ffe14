"""Exactly one answer per request under load, through the embedding API, HTTP and gRPC.

Mixed models (a cached ensemble with repeated inputs, a model that fails on negative inputs,
an identity model of every type, a plain step), checked against a reference computation;
afterwards every pending count, step, slot and queue is back at rest and no task is left.
The default size fits CI; ``ORCHESTRION_LOAD_REQUESTS=20000`` runs the full size.
"""

from __future__ import annotations

import gc
import http.client
import threading
from typing import Any

import numpy as np
import trio
import trio.testing
import tritonclient.grpc as grpcclient

from orchestrion import InferenceError
from orchestrion.testing import (
    at_rest,
    case,
    check,
    embedding_round,
    grpc_inputs,
    http_call,
    rss_kib,
)
from support.reliability_report import SIZE, record
from support.served import front_ends

REQUESTS = SIZE
CONCURRENCY = 128


async def test_embedding_api_under_load_answers_each_request_once() -> None:
    """REQUESTS mixed requests at concurrency 128: each gets its one right answer or its one
    error, and everything is at rest afterwards, with as many tasks and threads as before."""
    async with front_ends(cache_config="local,size=1048576") as (server, _, _):
        await trio.testing.wait_all_tasks_blocked(0.05)
        tasks_before = trio.lowlevel.current_statistics().tasks_living
        threads_before = threading.active_count()
        answers = await embedding_round(server, REQUESTS, CONCURRENCY)
        await trio.testing.wait_all_tasks_blocked(0.05)
        assert trio.lowlevel.current_statistics().tasks_living == tasks_before
        assert threading.active_count() <= threads_before
        at_rest(server)
        hits = server.model_statistics("pipeline")[0].inference_stats.cache_hit.count
    for index, outcome in answers.items():
        check(index, outcome)
    assert hits > 0
    failed = sum(isinstance(a, InferenceError) for a in answers.values())
    record(
        "Load",
        "Mixed requests through the embedding API at concurrency 128 (a cached ensemble, a "
        "model failing on some inputs, a batching identity model, a plain step)",
        f"{REQUESTS:,} requests ({hits:,} cache hits, {failed:,} model errors)",
        "exactly one answer each, checked against a reference; counts, slots, queues, tasks "
        "and threads back to where they were",
    )


async def test_http_and_grpc_under_load_answer_each_request_once() -> None:
    """REQUESTS mixed requests, half over HTTP (32 keep-alive connections) and half over gRPC
    (64 in flight): every answer arrives once and is right; the server ends at rest."""
    answers: dict[int, Any] = {}
    lock = threading.Lock()

    def keep(index: int, outcome: Any) -> None:
        with lock:
            assert index not in answers
            answers[index] = outcome

    async with front_ends(cache_config="local,size=1048576") as (
        server,
        http_address,
        grpc_address,
    ):
        http_indexes = iter(range(0, REQUESTS, 2))

        def http_worker() -> None:
            connection = http.client.HTTPConnection(http_address, timeout=60)
            for index in http_indexes:  # shared iterator: the GIL hands each index out once
                keep(index, http_call(http_address, index, connection))
            connection.close()

        def grpc_worker() -> None:
            client = grpcclient.InferenceServerClient(grpc_address)
            slots = threading.Semaphore(64)
            done = threading.Event()
            remaining = [len(range(1, REQUESTS, 2))]

            def callback(index: int, result: Any, error: Any) -> None:
                if error is not None:
                    keep(index, error)
                else:
                    keep(index, {n: result.as_numpy(n) for n in case(index)[2]})
                slots.release()
                with lock:
                    remaining[0] -= 1
                    if remaining[0] == 0:
                        done.set()

            for index in range(1, REQUESTS, 2):
                model, items = grpc_inputs(index)
                slots.acquire()
                client.async_infer(
                    model,
                    items,
                    callback=lambda result, error, i=index: callback(i, result, error),
                )
            assert done.wait(300)
            client.close()

        async with trio.open_nursery() as nursery:
            for _ in range(32):
                nursery.start_soon(trio.to_thread.run_sync, http_worker)
            nursery.start_soon(trio.to_thread.run_sync, grpc_worker)
        await trio.testing.wait_all_tasks_blocked(0.05)
        at_rest(server)
        hits = server.model_statistics("pipeline")[0].inference_stats.cache_hit.count
    assert sorted(answers) == list(range(REQUESTS))
    for index, outcome in answers.items():
        check(index, outcome)
    record(
        "Load",
        "The same mix over HTTP (32 keep-alive connections, binary tensors) and gRPC (64 "
        "calls in flight) at once",
        f"{REQUESTS:,} requests ({hits:,} cache hits)",
        "exactly one answer each, checked against a reference; the server at rest afterwards",
    )


async def test_memory_does_not_grow_across_rounds() -> None:
    """After a warm-up round, rounds of the same mixed load leave RSS flat: the least-squares
    slope is reported, and the growth from the first to the last round stays within the
    allocator's noise (a leak of 1 KiB per request would exceed it several times over)."""
    rounds, size = 6, max(1000, REQUESTS // 4)
    samples: list[int] = []
    async with front_ends(cache_config="local,size=1048576") as (server, _, _):
        for number in range(rounds + 1):
            answers = await embedding_round(server, size, CONCURRENCY)
            for index, outcome in answers.items():
                check(index, outcome)
            at_rest(server)
            gc.collect()
            if number:  # round 0 warms up: compilations, caches, pools
                samples.append(rss_kib())
    slope = float(np.polyfit(np.arange(rounds), np.array(samples, float), 1)[0])
    growth = samples[-1] - samples[0]
    leak_per_request = 1.0  # KiB: the smallest leak this test is sized to catch
    assert growth < leak_per_request * size * (rounds - 1) / 3, (samples, slope)
    record(
        "Load",
        "RSS across repeated rounds of the mixed load, after a warm-up round",
        f"{rounds} rounds of {size:,} requests",
        f"slope {slope:+.0f} KiB per round ({slope / size * 1000:+.1f} KiB per 1,000 "
        f"requests); {growth / 1024:+.1f} MiB from the first to the last round",
    )
