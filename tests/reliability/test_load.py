"""Exactly one answer per request under load, through the embedding API, HTTP and gRPC.

Mixed models (a cached ensemble with repeated inputs, a model that fails on negative inputs,
an identity model of every type, a plain step), checked against a reference computation;
afterwards every pending count, step, slot and queue is back at rest and no task is left.
The default size fits CI; ``ORCHESTRION_LOAD_REQUESTS=20000`` runs the full size.
"""

from __future__ import annotations

import http.client
import os
import threading
from typing import Any

import trio
import tritonclient.grpc as grpcclient
from inprocess_servers import front_ends
from mixed_load import at_rest, case, check, http_call

from orchestrion import DataType, InferenceError

REQUESTS = int(os.environ.get("ORCHESTRION_LOAD_REQUESTS", "3000"))
CONCURRENCY = 128


async def test_embedding_api_under_load_answers_each_request_once() -> None:
    """REQUESTS mixed requests at concurrency 128: each gets its one right answer or its one
    error, and everything is at rest afterwards."""
    answers: dict[int, Any] = {}
    async with front_ends(cache_config="local,size=1048576") as (server, _, _):
        tasks_before = trio.lowlevel.current_statistics().tasks_living
        todo = iter(range(REQUESTS))

        async def client() -> None:
            for index in todo:
                model, inputs, _ = case(index)
                assert index not in answers
                try:
                    answers[index] = dict((await server.infer(model, inputs)).outputs)
                except InferenceError as exc:
                    answers[index] = exc

        async with trio.open_nursery() as nursery:
            for _ in range(CONCURRENCY):
                nursery.start_soon(client)
        assert trio.lowlevel.current_statistics().tasks_living == tasks_before
        at_rest(server)
        hits = server.model_statistics("pipeline")[0].inference_stats.cache_hit.count
    assert sorted(answers) == list(range(REQUESTS))
    for index, outcome in answers.items():
        check(index, outcome)
    assert hits > 0


async def test_http_and_grpc_under_load_answer_each_request_once() -> None:
    """REQUESTS mixed requests, half over HTTP (32 keep-alive connections) and half over gRPC
    (64 in flight): every answer arrives once and is right; the server ends at rest."""
    answers: dict[int, Any] = {}
    lock = threading.Lock()

    def record(index: int, outcome: Any) -> None:
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
                record(index, http_call(http_address, index, connection))
            connection.close()

        def grpc_worker() -> None:
            client = grpcclient.InferenceServerClient(grpc_address)
            slots = threading.Semaphore(64)
            done = threading.Event()
            remaining = [len(range(1, REQUESTS, 2))]

            def callback(index: int, result: Any, error: Any) -> None:
                if error is not None:
                    record(index, error)
                else:
                    record(index, {n: result.as_numpy(n) for n in case(index)[2]})
                slots.release()
                with lock:
                    remaining[0] -= 1
                    if remaining[0] == 0:
                        done.set()

            for index in range(1, REQUESTS, 2):
                model, inputs, _ = case(index)
                items = []
                for name, value in inputs.items():
                    datatype = DataType.from_numpy(value.dtype).value
                    item = grpcclient.InferInput(name, list(value.shape), datatype)
                    item.set_data_from_numpy(value)
                    items.append(item)
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
        at_rest(server)
    assert sorted(answers) == list(range(REQUESTS))
    for index, outcome in answers.items():
        check(index, outcome)
