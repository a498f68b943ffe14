"""Triton's restricted APIs (``--http-restricted-api``, ``--grpc-restricted-protocol``)
through `orchestrion serve` with real clients: the restricted groups answer only requests that
carry the header, in Triton's words (HTTP 403, gRPC UNAVAILABLE, a stream ended before it
reads), the other groups stay open, and a malformed flag stops the server from starting.
"""

from __future__ import annotations

import queue
import subprocess
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from orchestrion.testing import Served
from support.served import serve_command, start_server

ADMIN = {"admin-key": "s3cret"}
INFER = {"infer-key": "open-sesame"}


@pytest.fixture(scope="module")
def server() -> Iterator[Served]:
    served = start_server(
        "--http-restricted-api=model-repository:admin-key=s3cret",
        "--http-restricted-api=inference,health:infer-key=open-sesame",
        "--grpc-restricted-protocol=model-repository:admin-key=s3cret",
        "--grpc-restricted-protocol=inference,health:infer-key=open-sesame",
    )
    yield served
    assert served.stop() == 0, served.text()


def _square(value: int) -> dict[str, Any]:
    return {"inputs": [{"name": "Y", "datatype": "INT32", "shape": [1], "data": [value]}]}


def test_http_groups_answer_only_with_their_header(server: Served) -> None:
    """Inference and health need infer-key, the repository admin-key (a wrong value is no
    better than none); metadata and statistics stay open."""
    base = f"http://{server.http}"
    infer = f"{base}/v2/models/square/infer"
    refused = requests.post(infer, json=_square(3), timeout=30)
    assert refused.status_code == 403
    assert refused.json() == {"error": "This API is restricted, expecting header 'infer-key'"}
    wrong = requests.post(infer, json=_square(3), headers={"infer-key": "guess"}, timeout=30)
    assert wrong.status_code == 403
    answered = requests.post(infer, json=_square(3), headers=INFER, timeout=30)
    assert answered.json()["outputs"][0]["data"] == [9]
    assert requests.get(f"{base}/v2/health/live", timeout=30).status_code == 403
    assert requests.get(f"{base}/v2/health/live", headers=INFER, timeout=30).status_code == 200
    assert requests.get(f"{base}/v2/models/square/ready", timeout=30).status_code == 403
    index = f"{base}/v2/repository/index"
    assert requests.post(index, json={}, headers=INFER, timeout=30).status_code == 403
    assert requests.post(index, json={}, headers=ADMIN, timeout=30).status_code == 200
    assert requests.get(f"{base}/v2/models/square", timeout=30).status_code == 200
    assert requests.get(f"{base}/v2/models/square/stats", timeout=30).status_code == 200


def test_grpc_groups_answer_only_with_their_metadata(server: Served) -> None:
    """UNAVAILABLE and Triton's words without ``triton-grpc-protocol-<key>``; with it the
    call goes through to its own answer (here: load/unload refused by the control mode)."""
    client = grpcclient.InferenceServerClient(server.grpc)
    prefix = "triton-grpc-protocol-"
    with pytest.raises(InferenceServerException) as caught:
        client.is_server_live()
    assert caught.value.status() == "StatusCode.UNAVAILABLE"
    assert "This protocol is restricted, expecting header 'triton-grpc-protocol-infer-key'" in (
        str(caught.value)
    )
    assert client.is_server_live(headers={prefix + "infer-key": "open-sesame"})
    with pytest.raises(InferenceServerException, match="This protocol is restricted"):
        client.unload_model("square", headers={prefix + "infer-key": "open-sesame"})
    with pytest.raises(InferenceServerException, match="explicit model load / unload is not"):
        client.unload_model("square", headers={prefix + "admin-key": "s3cret"})
    client.get_inference_statistics("square")  # not restricted
    y = grpcclient.InferInput("Y", [1], "INT32")
    y.set_data_from_numpy(np.array([4], np.int32))
    with pytest.raises(InferenceServerException, match="This protocol is restricted"):
        client.infer("square", [y])
    result = client.infer("square", [y], headers={prefix + "infer-key": "open-sesame"})
    assert result.as_numpy("Z").tolist() == [16]
    client.close()


def test_a_stream_without_the_header_ends_before_it_reads(server: Served) -> None:
    """The stream opens (gRPC decides that), then ends UNAVAILABLE with Triton's words; one
    opened with the header answers."""
    answers: queue.Queue[Any] = queue.Queue()
    y = grpcclient.InferInput("Y", [1], "INT32")
    y.set_data_from_numpy(np.array([5], np.int32))
    client = grpcclient.InferenceServerClient(server.grpc)
    client.start_stream(lambda result, error: answers.put(error or result))
    error = answers.get(timeout=30)
    assert isinstance(error, InferenceServerException)
    assert "This protocol is restricted" in str(error)
    client.stop_stream()
    client.start_stream(
        lambda result, error: answers.put(error or result),
        headers={"triton-grpc-protocol-infer-key": "open-sesame"},
    )
    client.async_stream_infer("square", [y])
    result = answers.get(timeout=30)
    assert result.as_numpy("Z").tolist() == [25]
    client.stop_stream()
    client.close()


@pytest.mark.parametrize(
    ("flag", "words"),
    [
        ("--grpc-restricted-protocol=model-reposit,health:k1=v1", "unknown restricted protocol"),
        ("--http-restricted-api=health", "--http-restricted-api option format is"),
        ("--http-restricted-api=health:a=1", "can not be specified in multiple config groups"),
    ],
)
def test_a_malformed_restriction_stops_the_server_from_starting(flag: str, words: str) -> None:
    """A typo in a restriction must not leave the endpoints open: exit 2, the flag named."""
    extra = ["--http-restricted-api=health:b=2"] if "multiple" in words else []
    done = subprocess.run(
        serve_command(flag, *extra), capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert words in done.stdout + done.stderr
