"""Review of the network front end (`orchestrion serve`): HTTP robustness, the binary tensor
extension, gRPC edges, model control and shutdown. Real clients and sockets, loopback only."""

from __future__ import annotations

import base64
import json
import queue
import shutil
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from orchestrion.testing import Served, post
from support.served import MODELS, start_server

ECHO_CONFIG = """
name: "{name}"
max_batch_size: 0
input [ {{ name: "X" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [ {{ name: "INFO" data_type: TYPE_STRING dims: [ 1 ] }} ]
"""
ECHO_MODEL = """
import json
import numpy as np

JIT = False


def execute(request, X):
    doc = {
        "parameters": dict(request.parameters),
        "priority": request.priority,
        "timeout": request.timeout,
        "id": request.request_id,
    }
    return {"INFO": np.array([json.dumps(doc).encode()], dtype=object)}
"""


def _echo_model(repository: Path, name: str) -> None:
    folder = repository / name
    (folder / "1").mkdir(parents=True)
    (folder / "config.pbtxt").write_text(ECHO_CONFIG.format(name=name))
    (folder / "1" / "model.py").write_text(ECHO_MODEL)


@pytest.fixture(scope="module")
def server() -> Iterator[Served]:
    served = start_server("--exit-timeout-secs=5")
    yield served
    served.stop()


@pytest.fixture(scope="module")
def repo_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Served, Path]]:
    """Explicit mode over a private repository (echo models, sleepy, square)."""
    repository = tmp_path_factory.mktemp("repo")
    for name in ("sleepy", "square", "pipeline", "preprocess", "classify", "segment"):
        shutil.copytree(MODELS / name, repository / name)
    _echo_model(repository, "echo")
    _echo_model(repository, "my model")
    served = start_server(
        "--model-control-mode=explicit",
        "--load-model",
        "*",
        "--exit-timeout-secs=5",
        repository=repository,
    )
    yield served, repository
    served.stop()


def _address(served: Served) -> tuple[str, int]:
    host, port = served.http.rsplit(":", 1)
    return host, int(port)


def _exchange(served: Served, data: bytes, *, timeout: float = 10.0) -> bytes:
    """Send raw bytes on a fresh connection and read until the server closes (bounded)."""
    with socket.create_connection(_address(served), timeout=timeout) as sock:
        sock.sendall(data)
        out = b""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                break
            if not chunk:
                break
            out += chunk
        return out


def _status_and_body(reply: bytes) -> tuple[int, bytes]:
    head, _, body = reply.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


def _still_serving(served: Served) -> None:
    client = httpclient.InferenceServerClient(served.http)
    try:
        item = httpclient.InferInput("Y", [1], "INT32")
        item.set_data_from_numpy(np.array([7], np.int32))
        assert client.infer("square", [item]).as_numpy("Z").tolist() == [49]
    finally:
        client.close()


# ------------------------------------------------------------------------ binary tensors


def test_http_binary_bytes_with_a_huge_shape_is_400_quickly(server: Served) -> None:
    """A BYTES input of shape [1, 10**12] with 4 bytes of binary data is a 400 (not a 500)."""
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "IN_BYTES",
                    "datatype": "BYTES",
                    "shape": [1, 10**12],
                    "parameters": {"binary_data_size": 4},
                }
            ]
        }
    ).encode()
    started = time.monotonic()
    status, body = post(
        server.http,
        "/v2/models/identity_batch/infer",
        header + b"\0\0\0\0",
        {"Inference-Header-Content-Length": str(len(header))},
    )
    assert time.monotonic() - started < 5
    assert status == 400, body
    assert "error" in json.loads(body)
    _still_serving(server)


def test_http_empty_tensor_with_a_huge_dim_is_400(server: Served) -> None:
    """A JSON input of shape [0, 10**30] (no elements, impossible dim) is a 400, not a 500."""
    body = json.dumps(
        {"inputs": [{"name": "IN_FP32", "datatype": "FP32", "shape": [0, 10**30], "data": []}]}
    ).encode()
    status, reply = post(server.http, "/v2/models/identity_batch/infer", body)
    assert status == 400, reply


def test_grpc_raw_bytes_with_a_huge_shape_is_invalid_argument(server: Served) -> None:
    """gRPC raw BYTES of shape [1, 10**12] with 4 bytes is INVALID_ARGUMENT, not INTERNAL."""
    request = service_pb2.ModelInferRequest(model_name="identity_plain")
    tensor = request.inputs.add(name="IN_BYTES", datatype="BYTES")
    tensor.shape.extend([2, 10**12])
    request.raw_input_contents.append(b"\0\0\0\0")
    with grpc.insecure_channel(server.grpc) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            stub.ModelInfer(request, timeout=10)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()


def test_grpc_stream_survives_a_request_with_a_huge_shape(server: Served) -> None:
    """On a stream, a BYTES request of shape [1, 10**12] gets an error response and the
    next request on the same stream is still answered."""
    bad = service_pb2.ModelInferRequest(model_name="identity_plain", id="bad")
    tensor = bad.inputs.add(name="IN_BYTES", datatype="BYTES")
    tensor.shape.extend([2, 10**12])
    bad.raw_input_contents.append(b"\0\0\0\0")
    good = service_pb2.ModelInferRequest(model_name="square", id="good")
    good.inputs.add(name="Y", datatype="INT32", shape=[1])
    good.raw_input_contents.append(np.array([3], np.int32).tobytes())
    with grpc.insecure_channel(server.grpc) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        replies = []
        try:
            for reply in stub.ModelStreamInfer(iter([bad, good]), timeout=15):
                replies.append(reply)
        except grpc.RpcError as exc:
            pytest.fail(f"the stream failed: {exc.code()} {exc.details()}")
    by_id = {r.infer_response.id: r for r in replies}
    assert by_id["bad"].error_message
    assert not by_id["good"].error_message
    assert np.frombuffer(by_id["good"].infer_response.raw_output_contents[0], np.int32)[0] == 9


# ------------------------------------------------------------------------ HTTP protocol


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (b"GET /nowhere HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", 404),
        (b"DELETE /v2/health/live HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", 405),
        (
            b"POST /v2/models/square/infer HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
            b"Content-Encoding: br\r\nContent-Length: 2\r\n\r\n{}",
            415,
        ),
    ],
    ids=["404", "405", "415"],
)
def test_routing_errors_are_not_reported_as_internal(
    server: Served, request_bytes: bytes, status: int
) -> None:
    """404/405/415 answers carry a plain {"error": msg}, not 'internal error: _HttpError'."""
    got, body = _status_and_body(_exchange(server, request_bytes))
    assert got == status
    message = json.loads(body)["error"]
    assert "internal error" not in message, message
    assert "_HttpError" not in message, message


def test_headers_over_the_limit_are_refused(server: Served) -> None:
    """A 100 KiB header (over MAX_HEADER_SIZE, 64 KiB) is refused with 431 (or 400)."""
    reply = _exchange(
        server,
        b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nConnection: close\r\nX-Big: "
        + b"a" * 100_000
        + b"\r\n\r\n",
    )
    status, _ = _status_and_body(reply)
    assert status in (400, 431), reply[:200]


def test_percent_encoded_model_name(repo_server: tuple[Served, Path]) -> None:
    """tritonclient percent-encodes model names in URLs: 'my model' is served over HTTP."""
    served, _ = repo_server
    client = httpclient.InferenceServerClient(served.http)
    try:
        with grpcclient.InferenceServerClient(served.grpc) as other:
            assert other.is_model_ready("my model")  # loaded; only the URL differs
        assert client.is_model_ready("my model")
        item = httpclient.InferInput("X", [1], "INT32")
        item.set_data_from_numpy(np.array([1], np.int32))
        assert client.infer("my model", [item]).as_numpy("INFO") is not None
    finally:
        client.close()


def _one_answer(sock: socket.socket, reply: bytearray) -> tuple[int, bytes]:
    """Read one answer (with a content-length) from a keep-alive connection; ``reply``
    holds what arrived beyond it."""
    deadline = time.monotonic() + 10
    while b"\r\n\r\n" not in reply and time.monotonic() < deadline:
        reply += sock.recv(65536)
    head, _, rest = bytes(reply).partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    while len(rest) < length and time.monotonic() < deadline:
        chunk = sock.recv(65536)
        assert chunk, "the connection closed mid-answer"
        rest += chunk
    reply[:] = rest[length:]
    return int(head.split(b" ", 2)[1]), rest[:length]


def test_raw_characters_a_url_may_not_hold_reach_the_handlers(
    repo_server: tuple[Served, Path],
) -> None:
    """Triton (and curl) send ``<``, ``>``, a backtick and ``"`` in a URL as they are;
    Triton's QA loads models named ``model<test>`` that way to see them refused in its
    words. The native front end's URL parser refuses those bytes, so each request line's
    target is percent-encoded before it; the handlers answer as for any name, request after
    request on one connection."""
    served, _ = repo_server
    config = {"name": "model<test>", "backend": "python", "max_batch_size": 0}
    code = base64.b64encode(b"class TritonPythonModel:\n    pass\n").decode()
    parameters = {"config": json.dumps(config), "file:/1/model.py": code}
    load = json.dumps({"parameters": parameters}).encode()
    with socket.create_connection(_address(served), timeout=10) as sock:
        reply = bytearray()
        sock.sendall(
            b"POST /v2/repository/models/model<test>/load HTTP/1.1\r\nHost: x\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(load), load)
        )
        status, body = _one_answer(sock, reply)
        assert status == 400, body
        assert "Invalid stub name: contains invalid characters" in json.loads(body)["error"]
        for target, name in (
            (b"/v2/models/a`b`/config", "a`b`"),
            (b'/v2/models/c"<d>/config', 'c"<d>'),
        ):
            sock.sendall(b"GET %s HTTP/1.1\r\nHost: x\r\n\r\n" % target)
            status, body = _one_answer(sock, reply)
            assert status == 404, body
            assert f"'{name}'" in json.loads(body)["error"]
        sock.sendall(b'GET /v2/models/echo/config?x="<`>" HTTP/1.1\r\nHost: x\r\n\r\n')
        status, body = _one_answer(sock, reply)
        assert status == 200, body
        assert json.loads(body)["name"] == "echo"
    _still_serving(served)


@pytest.mark.parametrize("chunked", [False, True], ids=["sized", "chunked"])
def test_a_body_that_looks_like_a_request_line_is_left_as_it_came(
    server: Served, chunked: bool
) -> None:
    """Bytes of a body never count as a request line, whatever they hold: a binary BYTES
    input whose values are request lines with a ``<``, sent in a write of its own (after its
    head and its length prefix), sized or chunked, comes back from the identity model as it
    went, and the connection serves on."""
    values = [b"GET /<x> HTTP/1.1\r\n", b"POST /a`b` HTTP/1.1\r\n\r\n"]
    raw = b"".join(len(v).to_bytes(4, "little") + v for v in values)
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "IN_BYTES",
                    "datatype": "BYTES",
                    "shape": [2, 1],
                    "parameters": {"binary_data_size": len(raw)},
                }
            ],
            "outputs": [{"name": "OUT_BYTES"}],
        }
    ).encode()
    body = header + raw
    split = len(header) + 4  # the second write starts with the first value
    framing = b"Transfer-Encoding: chunked" if chunked else b"Content-Length: %d" % len(body)
    head = (
        b"POST /v2/models/identity_plain/infer HTTP/1.1\r\nHost: x\r\n%s\r\n"
        b"Inference-Header-Content-Length: %d\r\n\r\n" % (framing, len(header))
    )
    if chunked:
        first = b"%x\r\n%s\r\n" % (split, body[:split])
        rest = body[split:]
        writes = [head + first + b"%x\r\n" % len(rest), rest + b"\r\n0\r\n\r\n"]
    else:
        writes = [head + body[:split], body[split:]]
    with socket.create_connection(_address(server), timeout=10) as sock:
        reply = bytearray()
        for _ in range(2):  # twice on one connection: the second head follows an answer
            for data in writes:
                sock.sendall(data)
                time.sleep(0.2)
            status, answer = _one_answer(sock, reply)
            assert status == 200, answer
            out = json.loads(answer)["outputs"][0]["data"]
            assert [v.encode() for v in out] == values


def test_chunked_body_and_expect_continue(server: Served) -> None:
    """(guard) A chunked POST with Expect: 100-continue gets 100 then its 200 answer."""
    body = json.dumps({"inputs": [{"name": "Y", "datatype": "INT32", "shape": [1], "data": [4]}]})
    with socket.create_connection(_address(server), timeout=10) as sock:
        sock.sendall(
            b"POST /v2/models/square/infer HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
            b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
        )
        assert sock.recv(1000).startswith(b"HTTP/1.1 100")
        raw = body.encode()
        for part in (raw[:10], raw[10:]):
            sock.sendall(b"%x\r\n" % len(part) + part + b"\r\n")
        sock.sendall(b"0\r\n\r\n")
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    status, payload = _status_and_body(reply)
    assert status == 200
    assert json.loads(payload)["outputs"][0]["data"] == [16]


# ------------------------------------------------------------------------ parameters


def _info(result: Any) -> dict[str, Any]:
    value = result.as_numpy("INFO").reshape(-1)[0]
    return dict(json.loads(value))


def test_custom_parameters_priority_and_timeout_reach_the_model(
    repo_server: tuple[Served, Path],
) -> None:
    """(guard) Custom parameters, priority and timeout (µs) reach the model over HTTP and gRPC."""
    served, _ = repo_server
    seen: dict[str, dict[str, Any]] = {}
    http_client = httpclient.InferenceServerClient(served.http)
    item = httpclient.InferInput("X", [1], "INT32")
    item.set_data_from_numpy(np.array([1], np.int32))
    seen["http"] = _info(
        http_client.infer(
            "echo", [item], parameters={"flavour": "mint"}, priority=2, timeout=5_000_000
        )
    )
    http_client.close()
    grpc_client = grpcclient.InferenceServerClient(served.grpc)
    gitem = grpcclient.InferInput("X", [1], "INT32")
    gitem.set_data_from_numpy(np.array([1], np.int32))
    seen["grpc"] = _info(
        grpc_client.infer(
            "echo", [gitem], parameters={"flavour": "mint"}, priority=2, timeout=5_000_000
        )
    )
    grpc_client.close()
    for protocol, info in seen.items():
        assert info["parameters"] == {"flavour": "mint"}, (protocol, info)
        assert info["priority"] == 2, (protocol, info)
        assert info["timeout"] == pytest.approx(5.0), (protocol, info)


def test_stream_request_timeout_reaches_the_model(repo_server: tuple[Served, Path]) -> None:
    """A gRPC stream request's timeout (µs) reaches the model as on unary ModelInfer (5.0 s)."""
    served, _ = repo_server
    client = grpcclient.InferenceServerClient(served.grpc)
    item = grpcclient.InferInput("X", [1], "INT32")
    item.set_data_from_numpy(np.array([1], np.int32))
    results: queue.Queue[Any] = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        client.async_stream_infer(
            "echo", [item], parameters={"flavour": "mint"}, priority=2, timeout=5_000_000
        )
        result, error = results.get(timeout=15)
    finally:
        client.stop_stream()
        client.close()
    assert error is None, error
    info = _info(result)
    assert info["parameters"] == {"flavour": "mint"}, info
    assert info["priority"] == 2, info
    assert info["timeout"] == pytest.approx(5.0), info


# ------------------------------------------------------------------------ gRPC


def test_grpc_stream_many_concurrent_requests(server: Served) -> None:
    """(guard) 200 requests on one stream (mixed models) each get exactly one answer."""
    requests = []
    for i in range(200):
        request = service_pb2.ModelInferRequest(model_name="square", id=str(i))
        request.inputs.add(name="Y", datatype="INT32", shape=[1])
        request.raw_input_contents.append(np.array([i], np.int32).tobytes())
        requests.append(request)
    with grpc.insecure_channel(server.grpc) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        replies = list(stub.ModelStreamInfer(iter(requests), timeout=30))
    assert len(replies) == 200
    for reply in replies:
        assert not reply.error_message
        i = int(reply.infer_response.id)
        assert np.frombuffer(reply.infer_response.raw_output_contents[0], np.int32)[0] == i * i


# ------------------------------------------------------------------------ model control


def test_loading_a_broken_config_names_file_and_field(
    repo_server: tuple[Served, Path],
) -> None:
    """Loading a model whose config.pbtxt is broken is Triton's 500 "failed to load ...,
    failed to poll from model repository", then the file and the field; the server keeps
    serving."""
    served, repository = repo_server
    folder = repository / "broken"
    shutil.copytree(MODELS / "square", folder)
    (folder / "config.pbtxt").write_text(
        'name: "broken"\nmax_batch_size: 0\n'
        'input [ { name: "Y" data_type: TYPE_NOPE dims: [ 1 ] } ]\n'
        'output [ { name: "Z" data_type: TYPE_INT32 dims: [ 1 ] } ]\n'
    )
    client = httpclient.InferenceServerClient(served.http)
    try:
        with pytest.raises(InferenceServerException) as refused:
            client.load_model("broken")
        assert refused.value.status() == "500"
        message = refused.value.message()
        assert message.startswith("failed to load 'broken', failed to poll from model repository")
        assert "broken/config.pbtxt" in message, message
        assert str(repository) not in message, message
        assert "data_type" in message, message
    finally:
        client.close()
        shutil.rmtree(folder)
    _still_serving(served)


def test_unload_waits_for_requests_in_flight(repo_server: tuple[Served, Path]) -> None:
    """Unloading a model lets its requests in flight finish (as Triton), then unloads."""
    served, _ = repo_server
    outcome: list[Any] = []

    def call() -> None:
        client = httpclient.InferenceServerClient(served.http, network_timeout=30)
        item = httpclient.InferInput("DELAY", [1], "FP32")
        item.set_data_from_numpy(np.array([1.0], np.float32))
        try:
            outcome.append(client.infer("sleepy", [item]).as_numpy("DELAY_OUT").tolist())
        except Exception as exc:
            outcome.append(exc)
        finally:
            client.close()

    thread = threading.Thread(target=call)
    thread.start()
    time.sleep(0.3)
    client = httpclient.InferenceServerClient(served.http, network_timeout=30)
    try:
        client.unload_model("sleepy")
        thread.join(20)
        assert outcome == [[1.0]]
        assert not client.is_model_ready("sleepy")
    finally:
        client.load_model("sleepy")
        client.close()


def test_shutdown_is_not_stuck_on_an_idle_stream() -> None:
    """SIGTERM with an open but idle gRPC stream (nothing in flight) exits promptly, not after
    the whole --exit-timeout-secs (Triton waits only for inferences in flight)."""
    served = start_server("--exit-timeout-secs=20")
    results: queue.Queue[Any] = queue.Queue()
    client = grpcclient.InferenceServerClient(served.grpc)
    try:
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        item = grpcclient.InferInput("Y", [1], "INT32")
        item.set_data_from_numpy(np.array([2], np.int32))
        client.async_stream_infer("square", [item])
        _, error = results.get(timeout=15)
        assert error is None
        started = time.monotonic()
        served.process.send_signal(signal.SIGTERM)
        assert served.process.wait(30) == 0
        assert time.monotonic() - started < 10
    finally:
        client.stop_stream()
        client.close()
        served.stop()
