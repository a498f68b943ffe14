"""Exactly one answer per request under load, through the embedding API, HTTP and gRPC.

Mixed models (a cached ensemble with repeated inputs, a model that fails on negative inputs,
an identity model of every type, a plain step), checked against a reference computation;
afterwards every pending count, step, slot and queue is back at rest and no task is left.
The default size fits CI; ``ORCHESTRION_LOAD_REQUESTS=20000`` runs the full size.
"""

from __future__ import annotations

import http.client
import json
import os
import threading
from typing import Any

import numpy as np
import trio
import tritonclient.grpc as grpcclient
from inprocess_servers import front_ends
from tritonclient.utils import InferenceServerException

from builders import assert_idle
from orchestrion import AsyncServer, InferenceError

REQUESTS = int(os.environ.get("ORCHESTRION_LOAD_REQUESTS", "3000"))
CONCURRENCY = 128


def _case(index: int) -> tuple[str, dict[str, np.ndarray[Any, Any]], Any]:
    """Request ``index``: model, inputs and the expected outputs (or the expected error)."""
    kind = index % 4
    rng = np.random.default_rng(index % 50)  # inputs repeat: the pipeline's cache gets hits
    if kind == 0:
        x = rng.standard_normal((1, 16)).astype(np.float32)
        pre = x * 2 + 1
        expected = {"CLASS": np.stack([pre[:, :8].sum(1), pre[:, 8:].sum(1)], 1), "SEG": -pre}
        return "pipeline", {"INPUT": x}, expected
    if kind == 1:
        value = np.array([float(index % 7) - 2.0], np.float32)  # negative: the model fails
        expected = InferenceError if value[0] < 0 else {"Y": value + 1}
        return "fragile", {"X": value}, expected
    if kind == 2:
        y = np.array([index % 1000], np.int32)
        return "square", {"Y": y}, {"Z": y * y}
    x = rng.integers(-100, 100, size=(2, 3)).astype(np.int64)
    return "identity_batch", {"IN_INT64": x}, {"OUT_INT64": x}


def _check(index: int, outcome: Any) -> None:
    _, _, expected = _case(index)
    if expected is InferenceError:
        assert isinstance(outcome, InferenceError | InferenceServerException), (index, outcome)
        return
    assert isinstance(outcome, dict), (index, outcome)
    assert outcome.keys() == expected.keys(), (index, outcome.keys())
    for name, want in expected.items():
        np.testing.assert_allclose(outcome[name], want, rtol=1e-5, err_msg=f"{index} {name}")


async def test_embedding_api_under_load_answers_each_request_once() -> None:
    """REQUESTS mixed requests at concurrency 128: each gets its one right answer or its one
    error, and everything is at rest afterwards."""
    answers: dict[int, Any] = {}
    async with front_ends(cache_config="local,size=1048576") as (server, _, _):
        tasks_before = trio.lowlevel.current_statistics().tasks_living
        todo = iter(range(REQUESTS))

        async def client() -> None:
            for index in todo:
                model, inputs, _ = _case(index)
                assert index not in answers
                try:
                    answers[index] = dict((await server.infer(model, inputs)).outputs)
                except InferenceError as exc:
                    answers[index] = exc

        async with trio.open_nursery() as nursery:
            for _ in range(CONCURRENCY):
                nursery.start_soon(client)
        assert trio.lowlevel.current_statistics().tasks_living == tasks_before
        _at_rest(server)
        hits = server.model_statistics("pipeline")[0].inference_stats.cache_hit.count
    assert sorted(answers) == list(range(REQUESTS))
    for index, outcome in answers.items():
        _check(index, outcome)
    assert hits > 0


def _at_rest(server: AsyncServer) -> None:
    assert_idle(server, "pipeline")
    cache = server.cache_statistics()
    assert cache is not None
    assert cache.queue_depth == 0


def _http_call(address: str, index: int, connection: http.client.HTTPConnection) -> Any:
    model, inputs, _ = _case(index)
    header = {
        "inputs": [
            {
                "name": name,
                "datatype": {"float32": "FP32", "int32": "INT32", "int64": "INT64"}[str(v.dtype)],
                "shape": list(v.shape),
                "parameters": {"binary_data_size": v.nbytes},
            }
            for name, v in inputs.items()
        ],
        "parameters": {"binary_data_output": True},
    }
    head = json.dumps(header).encode()
    body = head + b"".join(v.tobytes() for v in inputs.values())
    connection.request(
        "POST",
        f"/v2/models/{model}/infer",
        body,
        {"Inference-Header-Content-Length": str(len(head))},
    )
    response = connection.getresponse()
    data = response.read()
    if response.status != 200:
        return InferenceServerException(json.loads(data)["error"], status=str(response.status))
    length = int(response.getheader("Inference-Header-Content-Length"))
    document = json.loads(data[:length])
    outputs, offset = {}, length
    for output in document["outputs"]:
        size = output["parameters"]["binary_data_size"]
        dtype = {"FP32": np.float32, "INT32": np.int32, "INT64": np.int64}[output["datatype"]]
        outputs[output["name"]] = np.frombuffer(data[offset : offset + size], dtype).reshape(
            output["shape"]
        )
        offset += size
    return outputs


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
                record(index, _http_call(http_address, index, connection))
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
                    record(index, {n: result.as_numpy(n) for n in _case(index)[2]})
                slots.release()
                with lock:
                    remaining[0] -= 1
                    if remaining[0] == 0:
                        done.set()

            for index in range(1, REQUESTS, 2):
                model, inputs, _ = _case(index)
                items = []
                for name, value in inputs.items():
                    datatype = {"float32": "FP32", "int32": "INT32", "int64": "INT64"}[
                        str(value.dtype)
                    ]
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
        _at_rest(server)
    assert sorted(answers) == list(range(REQUESTS))
    for index, outcome in answers.items():
        _check(index, outcome)
