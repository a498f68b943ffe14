"""Triton python-backend models (tests/triton_models) under ``orchestrion serve``, through
Triton's own clients (tritonclient.http and tritonclient.grpc), as Triton's python_backend
example clients call them: add_sub, BLS, a decoupled stream, an auto-completed config,
custom metrics, and a client that gives up while a BLS call is running."""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from orchestrion.testing import Served, get
from support.served import start_server

REPOSITORY = Path(__file__).resolve().parents[1] / "triton_models"
A = np.array([1, 2, 3, 4], np.float32)
B = np.array([4, 3, 2, 1], np.float32)


@pytest.fixture(scope="module")
def server() -> Iterator[Served]:
    served = start_server(repository=REPOSITORY)
    yield served
    assert served.stop() == 0, served.text()


def _add_sub_inputs(module: Any) -> list[Any]:
    inputs = [module.InferInput("INPUT0", [4], "FP32"), module.InferInput("INPUT1", [4], "FP32")]
    inputs[0].set_data_from_numpy(A)
    inputs[1].set_data_from_numpy(B)
    return inputs


@pytest.mark.parametrize("module", [httpclient, grpcclient], ids=["http", "grpc"])
@pytest.mark.parametrize("name", ["add_sub", "bls_async"])
def test_add_sub_and_async_bls_answer_tritons_clients(
    server: Served, module: Any, name: str
) -> None:
    """add_sub and bls_async, as python_backend's add_sub and bls async clients call them."""
    client = module.InferenceServerClient(server.http if module is httpclient else server.grpc)
    try:
        result = client.infer(name, _add_sub_inputs(module))
        assert result.as_numpy("OUTPUT0").tolist() == [5, 5, 5, 5]
        assert result.as_numpy("OUTPUT1").tolist() == [-3, -1, 1, 3]
    finally:
        client.close()


def test_bls_with_the_model_name_as_a_bytes_input(server: Served) -> None:
    """bls, as python_backend's bls sync client calls it: MODEL_NAME a BYTES input."""
    client = httpclient.InferenceServerClient(server.http)
    try:
        name = httpclient.InferInput("MODEL_NAME", [1], "BYTES")
        name.set_data_from_numpy(np.array([b"jax_add_sub"], dtype=object))
        result = client.infer("bls", [name, *_add_sub_inputs(httpclient)])
        assert result.as_numpy("OUTPUT1").tolist() == [-3, -1, 1, 3]
    finally:
        client.close()


def test_an_auto_completed_config_reads_as_tritons(server: Served) -> None:
    """The config of the folder without config.pbtxt, as python_backend's auto_complete
    client checks it: max_batch_size 4, inputs and outputs with numeric dims."""
    client = httpclient.InferenceServerClient(server.http)
    try:
        config = client.get_model_config("auto_complete")
    finally:
        client.close()
    assert config["max_batch_size"] == 4
    assert config["backend"] == "python"
    assert [(i["name"], i["data_type"], i["dims"]) for i in config["input"]] == [
        ("INPUT0", "TYPE_FP32", [4]),
        ("INPUT1", "TYPE_FP32", [4]),
    ]
    assert [o["name"] for o in config["output"]] == ["OUTPUT0", "OUTPUT1"]


def test_a_decoupled_model_streams_over_grpc(server: Served) -> None:
    """square over a gRPC stream, as python_backend's square client reads it: n responses
    per request, for several requests on one stream."""
    results: queue.Queue[Any] = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc)
    try:
        client.start_stream(
            callback=partial(lambda q, result, error: q.put((result, error)), results)
        )
        for n in (3, 1, 2):
            x = grpcclient.InferInput("IN", [1], "INT32")
            x.set_data_from_numpy(np.array([n], np.int32))
            client.async_stream_infer("square", [x], request_id=str(n))
        got: list[tuple[str, int]] = []
        for _ in range(6):
            result, error = results.get(timeout=30)
            assert error is None, error
            got.append((result.get_response().id, int(result.as_numpy("OUT")[0])))
        client.stop_stream()
    finally:
        client.close()
    assert sorted(got) == [("1", 1), ("2", 2), ("2", 2), ("3", 3), ("3", 3), ("3", 3)]


def test_custom_metrics_are_scraped_with_tritons(server: Served) -> None:
    """The metrics model's own families are on the metrics endpoint beside nv_inference_*."""
    client = httpclient.InferenceServerClient(server.http)
    try:
        x = httpclient.InferInput("INPUT0", [4], "FP32")
        x.set_data_from_numpy(np.full(4, 0.5, np.float32))
        client.infer("metrics", [x])
    finally:
        client.close()
    status, body = get(server.metrics, "/metrics")
    assert status == 200
    text = body.decode()
    assert 'custom_requests_total{model="metrics",version="1"} 1.0' in text
    assert 'custom_sum_bucket{model="metrics",version="1",le="10"} 1' in text
    assert 'nv_inference_request_success{model="metrics",version="1"} 1' in text


def _stats(server: Served, model: str) -> dict[str, Any]:
    client = httpclient.InferenceServerClient(server.http)
    try:
        stats: dict[str, Any] = client.get_inference_statistics(model)["model_stats"][0]
    finally:
        client.close()
    return stats


def test_a_client_that_gives_up_cancels_the_bls_call(server: Served) -> None:
    """A gRPC client's 0.5 s deadline on slow_bls, whose BLS call to sleeper would run 20 s:
    sleeper sees its request cancelled and stops (a CANCELLED failure, not a success 20 s
    later), and both models are idle again within seconds."""
    client = grpcclient.InferenceServerClient(server.grpc)
    try:
        seconds = grpcclient.InferInput("SECONDS", [1], "FP32")
        seconds.set_data_from_numpy(np.array([20], np.float32))
        started = time.monotonic()
        with pytest.raises(InferenceServerException, match="Deadline"):
            client.infer("slow_bls", [seconds], client_timeout=0.5)
    finally:
        client.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        stats = _stats(server, "sleeper")["inference_stats"]
        if stats["fail"]["count"] == 1:
            break
        time.sleep(0.05)
    assert stats["fail"]["count"] == 1, stats
    assert stats["success"]["count"] == 0
    assert time.monotonic() - started < 10
    while "sleeper: cancelled" not in server.text() and time.monotonic() < deadline:
        time.sleep(0.05)  # the server's output is read by a thread of the test's
    assert "model 'sleeper' (version 1): sleeper: cancelled" in server.text()
