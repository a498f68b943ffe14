"""Triton's request checks and words through `orchestrion serve`, as Triton's own QA tests
send them (raw HTTP requests with ``requests``, tritonclient over gRPC): raw binary bodies,
JSON nested too deep, shapes past 64 bits or negative, duplicate outputs, unknown models, a
deeply nested control document. Each answer is checked for its status and Triton's words, and
the server for still serving.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from orchestrion.testing import Served
from support.served import start_server


@pytest.fixture(scope="module")
def server() -> Iterator[Served]:
    served = start_server()
    yield served
    assert served.stop() == 0, served.text()


def _url(server: Served, model: str) -> str:
    return f"http://{server.http}/v2/models/{model}/infer"


def _live(server: Served) -> bool:
    return requests.get(f"http://{server.http}/v2/health/live", timeout=30).status_code == 200


def _raw(server: Served, model: str, body: bytes) -> requests.Response:
    return requests.post(
        _url(server, model), data=body, headers={"Inference-Header-Content-Length": "0"}, timeout=30
    )


def test_a_raw_binary_request_is_one_inputs_bytes(server: Served) -> None:
    """``Inference-Header-Content-Length: 0``: the body is the only input, its batch and
    variable dims deduced from the config; the outputs come back as binary data."""
    x = np.arange(16, dtype=np.float32)
    answer = _raw(server, "classify", x.tobytes())
    assert answer.status_code == 200, answer.text
    header = int(answer.headers["Inference-Header-Content-Length"])
    document = json.loads(answer.content[:header])
    assert document["outputs"][0]["shape"] == [1, 2]
    got = np.frombuffer(answer.content[header:], np.float32)
    np.testing.assert_allclose(got, [x[:8].sum(), x[8:].sum()])

    word = _raw(server, "bytes_one", b"427")
    header = int(word.headers["Inference-Header-Content-Length"])
    assert word.content[header:] == len(b"427").to_bytes(4, "little") + b"427"


@pytest.mark.parametrize(
    ("model", "body", "words"),
    [
        (
            "identity_batch",
            np.zeros(8, np.float32).tobytes(),
            "Raw request must only have 1 input (found 1) to be deduced but got 14 inputs in "
            "'identity_batch' model configuration",
        ),
        (
            "grid",
            np.zeros(4, np.float32).tobytes(),
            "The shape of the raw input 'INPUT0' can not be deduced because there are more "
            "than one variable-sized dimension",
        ),
        ("classify", np.zeros(15, np.float32).tobytes(), "unexpected total byte size 60"),
    ],
)
def test_raw_binary_requests_that_cannot_be_deduced_are_refused(
    server: Served, model: str, body: bytes, words: str
) -> None:
    """Several inputs, two variable dims, a body that fits no shape: 400 in Triton's words."""
    answer = _raw(server, model, body)
    assert answer.status_code == 400
    assert words in answer.json()["error"]
    assert _live(server)


def _nested(depth: int, value: Any) -> Any:
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(("depth", "status"), [(50, 200), (120, 400), (5000, 400)])
def test_tensor_data_nested_deeper_than_100_is_refused(
    server: Served, depth: int, status: int
) -> None:
    """A [1, 1] tensor's data nested 50 deep is fine; 120 or 5,000 deep is refused in
    Triton's words (5,000 is past Python's own parser)."""
    document = {
        "inputs": [
            {"name": "IN_BYTES", "datatype": "BYTES", "shape": [1, 1], "data": "X"},
        ]
    }
    text = json.dumps(document).replace('"X"', "[" * depth + '"hello"' + "]" * depth)
    answer = requests.post(_url(server, "identity_batch"), data=text, timeout=30)
    assert answer.status_code == status, answer.text
    if status != 200:
        assert "JSON nesting depth exceeds maximum allowed limit (100)" in answer.json()["error"]
    assert _live(server)


@pytest.mark.parametrize(
    ("shape", "status", "words"),
    [
        ([2**4, 2**60 + 2], 400, "causes total element count to exceed maximum size of"),
        ([2**2, 2**60 + 2], 400, "byte size overflow for input 'IN_FP32'"),
        (
            [2, -5],
            500,  # Triton's: its JSON reader's error
            "Unable to parse 'shape': attempt to access JSON non-unsigned-integer as "
            "unsigned-integer",
        ),
    ],
)
def test_shapes_past_64_bits_or_negative_get_tritons_answer(
    server: Served, shape: list[int], status: int, words: str
) -> None:
    """Qa/L0_http's shape checks: the status and words Triton gives."""
    document = {"inputs": [{"name": "IN_FP32", "datatype": "FP32", "shape": shape, "data": [1.0]}]}
    answer = requests.post(_url(server, "identity_batch"), json=document, timeout=30)
    assert answer.status_code == status
    assert words in answer.json()["error"]
    assert _live(server)


def test_duplicate_output_names_are_refused_over_both_protocols(server: Served) -> None:
    """Naming an output twice: 400 / INVALID_ARGUMENT, ``output 'Z' already exists in request``."""
    document = {
        "inputs": [{"name": "Y", "datatype": "INT32", "shape": [1], "data": [3]}],
        "outputs": [{"name": "Z"}, {"name": "Z"}],
    }
    answer = requests.post(_url(server, "square"), json=document, timeout=30)
    assert answer.status_code == 400
    assert "output 'Z' already exists in request" in answer.json()["error"]
    client = grpcclient.InferenceServerClient(server.grpc)
    y = grpcclient.InferInput("Y", [1], "INT32")
    y.set_data_from_numpy(np.array([3], np.int32))
    outputs = [grpcclient.InferRequestedOutput("Z"), grpcclient.InferRequestedOutput("Z")]
    with pytest.raises(InferenceServerException) as caught:
        client.infer("square", [y], outputs=outputs)
    assert caught.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "output 'Z' already exists in request" in str(caught.value)
    assert client.infer("square", [y]).as_numpy("Z").tolist() == [9]
    client.close()


def test_unknown_models_and_versions_get_tritons_words(server: Served) -> None:
    """``Request for unknown model: 'X' is not found`` (404 / NOT_FOUND), and the same with
    the version; neither lists what the server holds."""
    answer = requests.post(_url(server, "no_such_model"), json={"inputs": []}, timeout=30)
    assert answer.status_code == 404
    assert answer.json()["error"] == "Request for unknown model: 'no_such_model' is not found"
    versioned = requests.post(
        f"http://{server.http}/v2/models/square/versions/9/infer", json={"inputs": []}, timeout=30
    )
    assert versioned.json()["error"] == "Request for unknown model: 'square' version 9 is not found"
    client = grpcclient.InferenceServerClient(server.grpc)
    with pytest.raises(InferenceServerException) as caught:
        client.get_model_metadata("no_such_model")
    assert caught.value.status() == "StatusCode.NOT_FOUND"
    assert "Request for unknown model: 'no_such_model' is not found" in str(caught.value)
    client.close()


@pytest.mark.parametrize(
    ("version", "words"),
    [
        (
            "wrong_specification",
            "failed to get model version from specified version string "
            "'wrong_specification' (details: stol), version should be an integral value > 0",
        ),
        ("-3", "invalid model version specified '-3' , version should be an integral value > 0"),
        ("1" * 30, "failed to get model version from specified version string '" + "1" * 30),
    ],
)
def test_a_version_that_is_not_a_number_gets_tritons_words(
    server: Served, version: str, words: str
) -> None:
    """A version string that is not a number: INVALID_ARGUMENT / 400 with Triton's sentence
    (``grpc_explicit_int8_content_client.py`` matches it), over gRPC and HTTP."""
    client = grpcclient.InferenceServerClient(server.grpc)
    y = grpcclient.InferInput("Y", [1], "INT32")
    y.set_data_from_numpy(np.array([3], np.int32))
    with pytest.raises(InferenceServerException) as caught:
        client.infer("square", [y], model_version=version)
    assert caught.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert words in str(caught.value)
    with pytest.raises(InferenceServerException) as metadata:
        client.get_model_metadata("square", model_version=version)
    assert words in str(metadata.value)
    assert client.infer("square", [y]).as_numpy("Z").tolist() == [9]
    client.close()
    document = {"inputs": [{"name": "Y", "datatype": "INT32", "shape": [1], "data": [3]}]}
    answer = requests.post(
        f"http://{server.http}/v2/models/square/versions/{version}/infer", json=document, timeout=30
    )
    assert answer.status_code == 400
    assert words in answer.json()["error"]


def test_a_control_document_nested_250000_deep_is_read_not_crashed_on(server: Served) -> None:
    """The repository index with ``ready`` nested 250,000 deep (past Python's parser): read
    member by member, refused for the member's type in Triton's words, the server live."""
    depth = 250_000
    body = '{"ready":' + "[" * depth + "true" + "]" * depth + "}"
    answer = requests.post(f"http://{server.http}/v2/repository/index", data=body, timeout=60)
    assert answer.status_code == 400
    assert "Invalid value for 'ready': expected a boolean" in answer.json()["error"]
    assert _live(server)


def test_a_declared_body_past_the_limit_gets_tritons_words(server: Served) -> None:
    """A body over --http-max-input-size: refused with Triton's sentence, before it is read."""
    size = 64 * 1024 * 1024 + 1
    answer = requests.post(_url(server, "square"), data=b"{" + b" " * (size - 2) + b"}", timeout=60)
    assert answer.status_code == 413
    assert (
        f"request JSON size of {size} bytes exceeds the maximum allowed input size of "
        f"{64 * 1024 * 1024} bytes. Use --http-max-input-size to increase the limit."
    ) in answer.json()["error"]
    assert _live(server)
