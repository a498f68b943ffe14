"""The native front end (``native/``, hyper in Rust threads) as a user meets it through
``orchestrion serve``: its cache tier answers repeated requests with the bytes the server
answered and counts them where Triton counts cache hits; a reload empties the tier, so no
answer outlives its model's revision; answers read from shared memory are never kept; HTTP/2
on the HTTP port; the choice of front end. (Everything else both front ends do is checked by
the rest of the suite, which ``scripts/test`` runs against each.)"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm

from orchestrion.frontends import native_available
from orchestrion.testing import Served, get
from support.metrics import metric_value
from support.served import MODELS, start_server

pytestmark = pytest.mark.skipif(
    not native_available(),
    reason="the native front end is not built (scripts/bootstrap builds it where cargo is)",
)

_CACHED = ("--frontend", "native", "--cache-config", "local,size=4194304")


def _pipeline_input(value: float, module: Any = grpcclient) -> Any:
    item = module.InferInput("INPUT", [1, 16], "FP32")
    item.set_data_from_numpy(np.full((1, 16), value, np.float32))
    return item


def _stats(client: grpcclient.InferenceServerClient, model: str) -> dict[str, int]:
    found = client.get_inference_statistics(model, as_json=True)["model_stats"][0]
    inference = found["inference_stats"]
    return {
        "success": int(inference["success"].get("count", 0)),
        "cache_hit": int(inference["cache_hit"].get("count", 0)),
        "cache_miss": int(inference["cache_miss"].get("count", 0)),
        "inference_count": int(found.get("inference_count", 0)),
        "execution_count": int(found.get("execution_count", 0)),
    }


def _metric(served: Served, name: str, **labels: str) -> float:
    status, text = get(served.metrics, "/metrics")
    assert status == 200
    return metric_value(text.decode(), name, **labels)


@pytest.mark.parametrize("tier", ["on", "off"])
def test_repeated_requests_are_cache_hits_with_or_without_the_tier(tier: str) -> None:
    """Ten identical requests over gRPC and ten over HTTP to an ensemble that caches: every
    answer has the first one's numbers, the model ran once, and the statistics and metrics
    count 19 hits and 1 miss whether the front end's tier answered them (on) or the
    server's cache did (off); with the tier on, /metrics shows it answered 18 (the first
    request of each protocol goes through Python: their keys differ)."""
    size = "67108864" if tier == "on" else "0"
    served = start_server(*_CACHED, "--frontend-cache-size", size)
    try:
        with grpcclient.InferenceServerClient(served.grpc) as client:
            first = client.infer("pipeline", [_pipeline_input(0.5)])
            expected = {name: first.as_numpy(name) for name in ("CLASS", "SEG")}
            for _ in range(9):
                again = client.infer("pipeline", [_pipeline_input(0.5)])
                for name, value in expected.items():
                    np.testing.assert_array_equal(again.as_numpy(name), value)
            with httpclient.InferenceServerClient(served.http) as http:
                for _ in range(10):
                    answer = http.infer("pipeline", [_pipeline_input(0.5, httpclient)])
                    for name, value in expected.items():
                        np.testing.assert_array_equal(answer.as_numpy(name), value)
            stats = _stats(client, "pipeline")
            classify = _stats(client, "classify")
        assert stats == {
            "success": 20,
            "cache_hit": 19,
            "cache_miss": 1,
            "inference_count": 1,
            "execution_count": 0,  # an ensemble's are its steps' (Triton's rule)
        }
        assert classify["execution_count"] == 1
        assert _metric(served, "nv_cache_num_hits_per_model", model="pipeline") == 19
        assert _metric(served, "nv_inference_request_success", model="pipeline") == 20
        assert _metric(served, "nv_cache_num_hits") == 19
        assert _metric(served, "nv_cache_num_lookups") == 20
        tier_hits = _metric(served, "orchestrion_cache_frontend_hits")
        assert tier_hits == (18 if tier == "on" else 0)
        if tier == "on":
            assert _metric(served, "orchestrion_cache_frontend_entries") == 2
    finally:
        code = served.stop()
    assert code == 0, served.text()


_MODEL_CONFIG = """
name: "scaled"
backend: "python"
max_batch_size: 0
response_cache { enable: true }
input [ { name: "X" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 4 ] } ]
"""
_MODEL_CODE = """
import triton_python_backend_utils as pb_utils

FACTOR = {factor}


class TritonPythonModel:
    def execute(self, requests):
        return [
            pb_utils.InferenceResponse(
                [pb_utils.Tensor("Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy() * FACTOR)]
            )
            for r in requests
        ]
"""


@pytest.fixture
def scaled_repository(tmp_path: Path) -> Iterator[Path]:
    """A repository with one python-backend model that multiplies by FACTOR, and caches."""
    folder = tmp_path / "models" / "scaled"
    (folder / "1").mkdir(parents=True)
    (folder / "config.pbtxt").write_text(_MODEL_CONFIG)
    (folder / "1" / "model.py").write_text(_MODEL_CODE.format(factor=2.0))
    yield tmp_path / "models"
    shutil.rmtree(tmp_path / "models")


def test_a_reload_empties_the_tier(scaled_repository: Path) -> None:
    """A model answered from the tier, then changed on disk and reloaded (explicit model
    control): the same request bytes now get the new model's answer, over gRPC and HTTP,
    never the old revision's."""
    served = start_server(
        *_CACHED,
        "--model-control-mode",
        "explicit",
        "--load-model",
        "scaled",
        repository=scaled_repository,
    )
    x = np.arange(4, dtype=np.float32)
    try:
        with (
            grpcclient.InferenceServerClient(served.grpc) as client,
            httpclient.InferenceServerClient(served.http) as http,
        ):

            def both() -> list[list[float]]:
                item = grpcclient.InferInput("X", [4], "FP32")
                item.set_data_from_numpy(x)
                web = httpclient.InferInput("X", [4], "FP32")
                web.set_data_from_numpy(x)
                return [
                    client.infer("scaled", [item]).as_numpy("Y").tolist(),
                    http.infer("scaled", [web]).as_numpy("Y").tolist(),
                ]

            for _ in range(3):
                assert both() == [[0.0, 2.0, 4.0, 6.0]] * 2
            assert _metric(served, "orchestrion_cache_frontend_hits") == 4
            code = scaled_repository / "scaled" / "1" / "model.py"
            code.write_text(_MODEL_CODE.format(factor=3.0))
            client.load_model("scaled")
            for _ in range(3):
                assert both() == [[0.0, 3.0, 6.0, 9.0]] * 2
    finally:
        status = served.stop()
    assert status == 0, served.text()


def test_answers_from_shared_memory_are_never_kept_by_the_tier() -> None:
    """The same request bytes naming a shared memory region, with other numbers written into
    the region between the calls: each answer is computed from the region's numbers of the
    moment (the request's bytes do not say what the model read)."""
    served = start_server(*_CACHED)
    name, key, size = "tier_input", f"/orchestrion_tier_{id(served)}", 64
    handle = shm.create_shared_memory_region(name, key, size)
    try:
        with grpcclient.InferenceServerClient(served.grpc) as client:
            client.register_system_shared_memory(name, key, size)
            answers = []
            for value in (1.0, 2.0, 3.0, 1.0):
                shm.set_shared_memory_region(handle, [np.full((1, 16), value, np.float32)])
                item = grpcclient.InferInput("INPUT", [1, 16], "FP32")
                item.set_shared_memory(name, size)
                answers.append(client.infer("pipeline", [item]).as_numpy("SEG").copy())
            plain = client.infer("pipeline", [_pipeline_input(2.0)]).as_numpy("SEG")
            client.unregister_system_shared_memory(name)
        assert not np.array_equal(answers[0], answers[1])
        assert not np.array_equal(answers[1], answers[2])
        np.testing.assert_array_equal(answers[0], answers[3])
        np.testing.assert_array_equal(answers[1], plain)
        assert _metric(served, "orchestrion_cache_frontend_entries") <= 1  # the plain one
    finally:
        shm.destroy_shared_memory_region(handle)
        code = served.stop()
    assert code == 0, served.text()


def test_http2_cleartext_is_served_on_the_http_port() -> None:
    """A client that speaks HTTP/2 with prior knowledge (curl) is answered on the HTTP port,
    health and inference alike."""
    curl = shutil.which("curl")
    if curl is None:
        pytest.skip("curl is not installed")
    served = start_server("--frontend", "native")
    try:
        body = b'{"inputs":[{"name":"INPUT","datatype":"FP32","shape":[1,16],"data":[%s]}]}' % (
            b",".join([b"1.0"] * 16)
        )
        done = subprocess.run(
            [
                curl,
                "-s",
                "--http2-prior-knowledge",
                "-o",
                "-",
                "-w",
                "\\n%{http_version} %{http_code}",
                "--data-binary",
                "@-",
                f"http://{served.http}/v2/models/pipeline/infer",
            ],
            input=body,
            capture_output=True,
            timeout=30,
            check=True,
        )
        answer, _, trailer = done.stdout.rpartition(b"\n")
        assert trailer == b"2 200", done.stdout[-300:]
        assert b'"name":"CLASS"' in answer.replace(b" ", b"")
    finally:
        code = served.stop()
    assert code == 0, served.text()


def test_the_front_end_is_chosen_by_flag() -> None:
    """``--frontend python`` serves without the native part; a bad ``--frontend`` value and a
    negative ``--frontend-cache-size`` are refused before anything loads, naming the flag."""
    served = start_server("--frontend", "python")
    try:
        assert get(served.http, "/v2/health/ready")[0] == 200
        with grpcclient.InferenceServerClient(served.grpc) as client:
            assert client.is_server_live()
    finally:
        code = served.stop()
    assert code == 0, served.text()
    for flags, expected in (
        (["--frontend", "rust"], "--frontend"),
        (["--frontend-cache-size", "-1"], "--frontend-cache-size must be >= 0"),
    ):
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "orchestrion",
                "serve",
                "--model-repository",
                str(MODELS),
                *flags,
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode != 0
        assert expected in done.stderr + done.stdout, done.stderr[-500:]
