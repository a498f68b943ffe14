"""Hypothesis throws malformed HTTP requests at `orchestrion serve`: each gets a 4xx with
Triton's JSON error body (never a dropped connection, and a 500 only where Triton answers one),
and the server keeps serving."""

from __future__ import annotations

import http.client
import json
import socket
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrion.testing import Served, post
from support.reliability_report import examples, record
from support.served import start_server

DATATYPES = ["BOOL", "UINT8", "INT32", "INT64", "FP16", "FP32", "FP64", "BF16", "BYTES", "FP8", ""]
NAMES = ["IN_FP32", "IN_BYTES", "IN_BOOL", "IN_INT64", "IN_FP16", "INPUT", "", "IN_BF16"]
MODELS = ["identity_batch", "identity_plain", "pipeline", "nope", "counter", "repeat"]
ALLOWED = {200, 400, 404, 405, 413, 415}

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)
shapes = st.lists(st.integers(-2, 6) | st.sampled_from([2**40, 2**63]), max_size=4)
tensors = st.fixed_dictionaries(
    {"name": st.sampled_from(NAMES), "datatype": st.sampled_from(DATATYPES), "shape": shapes},
    optional={
        "data": json_values,
        "parameters": st.fixed_dictionaries(
            {}, optional={"binary_data_size": st.integers(-5, 200) | json_values}
        ),
    },
)
documents = st.fixed_dictionaries(
    {"inputs": st.lists(tensors, max_size=4) | json_values},
    optional={
        "id": json_values,
        "outputs": st.lists(
            st.fixed_dictionaries(
                {"name": st.sampled_from(NAMES).map(lambda n: n.replace("IN_", "OUT_"))},
                optional={
                    "parameters": st.dictionaries(
                        st.sampled_from(["binary_data", "classification", "x"]),
                        json_values,
                        max_size=2,
                    )
                },
            ),
            max_size=3,
        ),
        "parameters": st.dictionaries(
            st.sampled_from(
                [
                    "sequence_id",
                    "sequence_start",
                    "priority",
                    "timeout",
                    "binary_data_output",
                    "custom",
                    "shared_memory_region",
                ]
            ),
            json_values,
            max_size=3,
        ),
    },
)


@pytest.fixture(scope="module")
def server() -> Iterator[Served]:
    served = start_server("--http-max-input-size", "65536")
    yield served
    assert served.stop() == 0, served.text()


_COUNTS: dict[str, int] = {}


def _count(tried: str, unit: str, happened: str) -> None:
    _COUNTS[tried] = _COUNTS.get(tried, 0) + 1
    record("Bad input", tried, f"{_COUNTS[tried]} {unit} (Hypothesis)", happened)


def _check(status: int, body: bytes) -> None:
    # The identity models echo only the inputs given: asking for another output is answered
    # without it (200, as in Triton).
    if status == 500 and b"Unable to parse 'shape'" in body:
        return  # a dim that is no unsigned integer: Triton's JSON reader error, 500 there too
    assert status in ALLOWED, (status, body[:300])
    if status != 200:
        assert "error" in json.loads(body), body[:300]


@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    model=st.sampled_from(MODELS),
    document=documents,
    binary=st.binary(max_size=64),
    # http.client itself refuses control characters in header values.
    header_length=st.none()
    | st.integers(-3, 400).map(str)
    | st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=5),
)
def test_malformed_infer_requests_get_4xx(
    server: Served,
    model: str,
    document: dict[str, Any],
    binary: bytes,
    header_length: str | None,
) -> None:
    """Random infer documents, binary tails and header lengths: 200 or a JSON 4xx."""
    header = json.dumps(document).encode()
    headers = {}
    if header_length is not None:
        headers["Inference-Header-Content-Length"] = header_length
    status, body = post(server.http, f"/v2/models/{model}/infer", header + binary, headers)
    _check(status, body)
    _count(
        "Malformed KServe infer documents over HTTP (shapes up to 2**63, wrong types, "
        "wrong binary_data_size, bad header lengths)",
        "requests",
        "each a 200 or a JSON 4xx naming the problem; never a dropped connection, and a 500 "
        "only where Triton answers one (a dim that is not an unsigned integer)",
    )


@settings(max_examples=examples(60), deadline=None)
@given(body=st.binary(max_size=300), encoding=st.sampled_from([None, "gzip", "deflate", "br"]))
def test_random_bytes_get_4xx(server: Served, body: bytes, encoding: str | None) -> None:
    """Arbitrary bytes as a body, with any Content-Encoding: a JSON 4xx."""
    headers = {"Content-Encoding": encoding} if encoding else {}
    status, reply = post(server.http, "/v2/models/identity_batch/infer", body, headers)
    _check(status, reply)
    _count(
        "Random bytes as an infer body, plain or claiming gzip/deflate/br",
        "bodies",
        "each a JSON 4xx",
    )


@settings(max_examples=examples(40), deadline=None)
@given(raw=st.binary(min_size=1, max_size=200))
def test_garbage_on_the_socket_never_kills_the_server(server: Served, raw: bytes) -> None:
    """Raw garbage instead of HTTP: the server answers 400 or closes, and keeps serving."""
    host, port = server.http.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(raw + b"\r\n\r\n")
        sock.shutdown(socket.SHUT_WR)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    if reply:
        assert reply.startswith(b"HTTP/1.1 4"), reply[:100]
    connection = http.client.HTTPConnection(server.http, timeout=10)
    connection.request("GET", "/v2/health/live")
    assert connection.getresponse().status == 200
    connection.close()
    _count(
        "Raw garbage on the HTTP socket instead of a request",
        "connections",
        "a 400 or a close; the server stays live",
    )
