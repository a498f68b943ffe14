"""`orchestrion serve` as an operator meets it: model control modes, limits, graceful stop."""

from __future__ import annotations

import gzip
import http.client
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from orchestrion.testing import Served, pending, post
from support.served import MODELS, pipeline_body, start_server


@pytest.fixture(scope="module")
def explicit() -> Iterator[Served]:
    served = start_server(
        "--model-control-mode=explicit", "--load-model", "square", "--http-max-input-size", "4096"
    )
    yield served
    assert served.stop() == 0, served.text()


def test_explicit_mode_loads_only_what_was_asked(explicit: Served) -> None:
    """--load-model square: square is READY, the other folders are listed UNAVAILABLE."""
    client = httpclient.InferenceServerClient(explicit.http)
    index = {m["name"]: m for m in client.get_model_repository_index()}
    assert index["square"]["state"] == "READY"
    assert index["pipeline"]["state"] == "UNAVAILABLE"
    assert not client.is_model_ready("pipeline")
    client.close()


def test_load_and_unload_over_both_protocols(explicit: Served) -> None:
    """Loading an ensemble loads its steps; unloading it makes it 404 again; reload works."""
    http_client = httpclient.InferenceServerClient(explicit.http)
    grpc_client = grpcclient.InferenceServerClient(explicit.grpc)
    http_client.load_model("pipeline")
    assert grpc_client.is_model_ready("pipeline")
    assert grpc_client.is_model_ready("preprocess")
    status, _ = post(explicit.http, "/v2/models/pipeline/infer", pipeline_body())
    assert status == 200
    grpc_client.unload_model("pipeline")
    assert not http_client.is_model_ready("pipeline")
    status, body = post(explicit.http, "/v2/models/pipeline/infer", pipeline_body())
    assert status == 404, body
    grpc_client.load_model("pipeline")
    assert http_client.is_model_ready("pipeline")
    with pytest.raises(InferenceServerException) as used:
        http_client.unload_model("preprocess")
    assert str(used.value.status()) == "400"
    assert "used by ensembles pipeline" in used.value.message()
    http_client.unload_model("preprocess", unload_dependents=True)
    assert not http_client.is_model_ready("pipeline")
    http_client.close()
    grpc_client.close()


@pytest.mark.parametrize(
    ("name", "status"),
    [
        ("../kserve_models", ("400", "404")),  # no route, or refused: never a folder out
        ("..", ("400",)),
        ("a/b", ("400", "404")),
        ("does_not_exist", ("500",)),
    ],
)
def test_load_refuses_names_outside_the_repository(
    explicit: Served, name: str, status: tuple[str, ...]
) -> None:
    """A load of a path out of the repository is refused (400, or 404 when no route
    matches); of a missing folder, Triton's 500 "failed to load '<name>', failed to poll
    from model repository"."""
    client = httpclient.InferenceServerClient(explicit.http)
    with pytest.raises(InferenceServerException) as refused:
        client.load_model(name)
    assert str(refused.value.status()) in status
    if status == ("500",):
        assert refused.value.message().startswith(
            f"failed to load '{name}', failed to poll from model repository"
        )
    client.close()


def test_a_config_override_replaces_the_whole_config(explicit: Served) -> None:
    """As in Triton, a load's ``config`` replaces config.pbtxt whole: one without the
    inputs a JAX model's execute takes fails to load, and the model serves on."""
    client = httpclient.InferenceServerClient(explicit.http)
    with pytest.raises(InferenceServerException) as refused:
        client.load_model("square", config='{"max_batch_size": 4}')
    assert refused.value.message().startswith("load failed for model 'square': ")
    assert "execute requires parameters that are not config inputs" in refused.value.message()
    assert client.is_model_ready("square")
    client.close()


def test_body_size_limit_and_compression(explicit: Served) -> None:
    """A body over --http-max-input-size is a 413, also when it only inflates to that size;
    a gzip body within the limit is served."""
    explicit_client = httpclient.InferenceServerClient(explicit.http)
    explicit_client.load_model("pipeline")
    explicit_client.close()
    status, body = post(explicit.http, "/v2/models/pipeline/infer", b" " * 5000)
    assert status == 413, body
    assert b"--http-max-input-size" in body
    small = gzip.compress(pipeline_body(2.0))
    status, body = post(
        explicit.http, "/v2/models/pipeline/infer", small, {"Content-Encoding": "gzip"}
    )
    assert status == 200, body
    bomb = gzip.compress(b" " * 100_000)
    status, body = post(
        explicit.http, "/v2/models/pipeline/infer", bomb, {"Content-Encoding": "gzip"}
    )
    assert status == 413, body
    status, body = post(
        explicit.http, "/v2/models/pipeline/infer", b"not gzip", {"Content-Encoding": "gzip"}
    )
    assert status == 400, body


def test_poll_mode_picks_up_new_changed_and_removed_models(tmp_path: Path) -> None:
    """--model-control-mode=poll: a new folder is loaded, a removed one unloaded."""
    repository = tmp_path / "models"
    repository.mkdir()
    shutil.copytree(MODELS / "square", repository / "square")
    served = start_server(
        "--model-control-mode=poll", "--repository-poll-secs=0.2", repository=repository
    )
    try:
        client = httpclient.InferenceServerClient(served.http)
        assert client.is_model_ready("square")
        shutil.copytree(MODELS / "fragile", repository / "fragile")
        shutil.rmtree(repository / "square")
        deadline = time.monotonic() + 60
        while not client.is_model_ready("fragile") or client.is_model_ready("square"):
            assert time.monotonic() < deadline, served.text()
            time.sleep(0.1)
        with pytest.raises(InferenceServerException) as refused:
            client.load_model("square")
        assert "explicit" in refused.value.message()
        client.close()
    finally:
        assert served.stop() == 0


def test_sigterm_lets_requests_in_flight_finish() -> None:
    """SIGTERM with 6 slow requests in flight (HTTP and gRPC): all 6 succeed, new connections
    are refused, and the process exits 0."""
    served = start_server("--exit-timeout-secs=20")
    results: list[Any] = []

    def call(protocol: Any, url: str) -> None:
        client = protocol.InferenceServerClient(url)
        item = protocol.InferInput("DELAY", [1], "FP32")
        item.set_data_from_numpy(np.array([1.5], np.float32))
        try:
            results.append(client.infer("sleepy", [item]).as_numpy("DELAY_OUT").tolist())
        except Exception as exc:
            results.append(exc)

    threads = [
        threading.Thread(target=call, args=(p, u))
        for p, u in [(httpclient, served.http), (grpcclient, served.grpc)] * 3
    ]
    try:
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 30
        while pending(served, "sleepy") < 6:
            assert time.monotonic() < deadline, "requests never reached the model"
            time.sleep(0.02)
        served.process.send_signal(signal.SIGTERM)
        for thread in threads:
            thread.join(30)
        assert results == [[1.5]] * 6
        assert served.process.wait(30) == 0
    finally:
        code = served.stop()
    assert code == 0
    with pytest.raises(ConnectionRefusedError):
        http.client.HTTPConnection(served.http, timeout=5).request("GET", "/v2/health/live")


def test_exit_timeout_bounds_the_wait_for_slow_requests() -> None:
    """A request longer than --exit-timeout-secs gets an error and the process still exits
    within about that time."""
    served = start_server("--exit-timeout-secs=1")
    outcome: list[Any] = []

    def call() -> None:
        client = grpcclient.InferenceServerClient(served.grpc)
        item = grpcclient.InferInput("DELAY", [1], "FP32")
        item.set_data_from_numpy(np.array([60.0], np.float32))
        try:
            outcome.append(client.infer("sleepy", [item]))
        except InferenceServerException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=call)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while pending(served, "sleepy") < 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        started = time.monotonic()
        served.process.send_signal(signal.SIGTERM)
        assert served.process.wait(30) == 0
        assert time.monotonic() - started < 15
        thread.join(30)
        assert len(outcome) == 1
        assert isinstance(outcome[0], InferenceServerException)
    finally:
        served.stop()
