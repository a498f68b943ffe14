"""The front ends inside a trio program: cancellation crosses them, traces join the caller's."""

from __future__ import annotations

import contextlib
import functools
import http.client
import socket
import struct
from typing import Any

import numpy as np
import pytest
import trio
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from tritonclient.utils import InferenceServerException

from orchestrion import AsyncServer, open_server
from orchestrion.frontends._control import ModelControl, ModelControlMode, Shutdown
from orchestrion.frontends._grpc_service import serve_grpc_api
from orchestrion.frontends._http_api import HttpApi, serve_http_api
from orchestrion.frontends._serve import ServeOptions, serve
from support.served import MODELS, front_ends, wait_until


def _pending(server: AsyncServer, model: str) -> int:
    return server.model_statistics(model)[0].pending_request_count


@pytest.mark.parametrize("how", ["close", "reset"])
@pytest.mark.parametrize("frontend", ["native", "python"])
async def test_http_client_that_leaves_mid_request_cancels_the_work(
    frontend: str, how: str
) -> None:
    """A client that closes its connection, or resets it (RST: SO_LINGER 0), while its
    request runs frees the model at once (CANCELED), and the server answers the next client
    (a reset once ended the Python front end's whole server)."""
    async with front_ends(frontend=frontend) as (server, http_address, _):
        host, port = http_address.rsplit(":", 1)
        body = b'{"inputs":[{"name":"DELAY","datatype":"FP32","shape":[1],"data":[60.0]}]}'
        stream = await trio.open_tcp_stream(host, int(port))
        await stream.send_all(
            b"POST /v2/models/sleepy/infer HTTP/1.1\r\nHost: x\r\nContent-Length: "
            + str(len(body)).encode()
            + b"\r\n\r\n"
            + body
        )
        await wait_until(lambda: _pending(server, "sleepy") == 1)
        if how == "reset":
            linger = struct.pack("ii", 1, 0)
            stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)
        await stream.aclose()
        await wait_until(lambda: _pending(server, "sleepy") == 0, limit=10)
        assert server.model_statistics("sleepy")[0].failures_by_reason.get("CANCELED") == 1
        answer = await trio.to_thread.run_sync(_get, http_address, "/v2/health/live")
        assert answer == 200


def _get(address: str, path: str) -> int:
    connection = http.client.HTTPConnection(address, timeout=10)
    try:
        connection.request("GET", path)
        return connection.getresponse().status
    finally:
        connection.close()


async def test_grpc_client_deadline_cancels_the_work() -> None:
    """A gRPC client that gives up (its deadline) cancels the trio task running its request."""
    async with front_ends() as (server, _, grpc_address):

        def call() -> InferenceServerException:
            client = grpcclient.InferenceServerClient(grpc_address)
            item = grpcclient.InferInput("DELAY", [1], "FP32")
            item.set_data_from_numpy(np.array([60.0], np.float32))
            try:
                client.infer("sleepy", [item], client_timeout=0.5)
            except InferenceServerException as exc:
                return exc
            finally:
                client.close()
            raise AssertionError("the deadline did not fire")

        error = await trio.to_thread.run_sync(call)
        assert "Deadline" in str(error.status()) or "DEADLINE" in str(error.status())
        await wait_until(lambda: _pending(server, "sleepy") == 0, limit=10)
        assert server.model_statistics("sleepy")[0].failures_by_reason.get("CANCELED") == 1


async def test_grpc_stream_closed_mid_stream_stops_the_generator() -> None:
    """A client that stops its stream while a decoupled model is producing frees the model."""
    async with front_ends() as (server, _, grpc_address):

        def call() -> None:
            client = grpcclient.InferenceServerClient(grpc_address)
            got: list[Any] = []
            client.start_stream(callback=lambda result, error: got.append((result, error)))
            item = grpcclient.InferInput("DELAY", [1], "FP32")
            item.set_data_from_numpy(np.array([60.0], np.float32))
            client.async_stream_infer("sleepy", [item])
            with trio.from_thread.run(_wait_pending, server):
                pass
            client.stop_stream(cancel_requests=True)
            client.close()

        await trio.to_thread.run_sync(call)
        await wait_until(lambda: _pending(server, "sleepy") == 0, limit=10)


@contextlib.contextmanager
def _noop() -> Any:
    yield


async def _wait_pending(server: AsyncServer) -> Any:
    await wait_until(lambda: _pending(server, "sleepy") == 1)
    return _noop()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
async def test_incoming_traceparent_becomes_the_parent(protocol: str) -> None:
    """A W3C traceparent header (HTTP) or metadata entry (gRPC) parents the request's span."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    parent = "00f067aa0ba902b7"
    header = f"00-{trace_id}-{parent}-01"
    async with front_ends(tracing=provider) as (_, http_address, grpc_address):

        def call() -> None:
            module: Any = httpclient if protocol == "http" else grpcclient
            client = module.InferenceServerClient(
                http_address if protocol == "http" else grpc_address
            )
            item = module.InferInput("X", [1], "FP32")
            item.set_data_from_numpy(np.array([1.0], np.float32))
            client.infer("fragile", [item], headers={"traceparent": header})
            client.close()

        await trio.to_thread.run_sync(call)
    roots = [
        s
        for s in exporter.get_finished_spans()
        if s.parent is not None and s.parent.span_id == int(parent, 16)
    ]
    assert len(roots) == 1
    assert roots[0].context.trace_id == int(trace_id, 16)


async def test_bind_errors_are_config_errors() -> None:
    """A taken port is a ConfigError naming the address, for both front ends."""
    from orchestrion import ConfigError

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        async with open_server(MODELS, load_models=["square"]) as server:
            control = ModelControl(server)
            # Raised before they report, so never serving: the deadline is a safeguard.
            with trio.fail_after(60), pytest.raises(ConfigError, match=f"127.0.0.1:{port}"):
                await serve_http_api(HttpApi(server, control, "t"), "127.0.0.1", port)
            with trio.fail_after(60), pytest.raises(ConfigError, match=f"127.0.0.1:{port}"):
                await serve_grpc_api(server, control, "t", "127.0.0.1", port)
    finally:
        taken.close()


async def test_serve_in_process_stops_gracefully_on_shutdown_and_at_once_on_cancel() -> None:
    """`serve` reports its endpoints through ``nursery.start``. A requested `Shutdown` lets
    a request in flight finish (200) before `serve` returns, and the ports close; cancelling
    `serve` instead stops it at once."""
    options = ServeOptions(
        model_repository=MODELS,
        http_port=0,
        grpc_port=0,
        metrics_port=0,
        model_control_mode=ModelControlMode.EXPLICIT,
        load_models=("sleepy",),
        exit_timeout=20,
    )
    shutdown = Shutdown()
    async with trio.open_nursery() as nursery:
        endpoints = await nursery.start(functools.partial(serve, options, shutdown=shutdown))
        assert endpoints.http is not None
        assert endpoints.grpc is not None
        assert endpoints.metrics is not None
        host, port = endpoints.http.rsplit(":", 1)
        body = b'{"inputs":[{"name":"DELAY","datatype":"FP32","shape":[1],"data":[1.0]}]}'
        stream = await trio.open_tcp_stream(host, int(port))
        await stream.send_all(
            b"POST /v2/models/sleepy/infer HTTP/1.1\r\nHost: x\r\nContent-Length: "
            + str(len(body)).encode()
            + b"\r\n\r\n"
            + body
        )
        metrics = endpoints.metrics
        with trio.fail_after(30):
            while not await trio.to_thread.run_sync(_sleepy_pending, metrics):  # noqa: ASYNC110
                await trio.sleep(0.02)
        shutdown.request()
        answer = b""
        with trio.fail_after(30):
            while chunk := await stream.receive_some():
                answer += chunk
        await stream.aclose()
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]
    assert b"connection: close" in answer.lower()
    with pytest.raises(OSError, match="[Cc]onnect"):
        await trio.open_tcp_stream(host, int(port))
    with trio.fail_after(10):  # no request in flight either way: cancelling is immediate
        async with trio.open_nursery() as nursery:
            await nursery.start(serve, options)
            nursery.cancel_scope.cancel()


def _sleepy_pending(address: str) -> bool:
    """Whether the metrics endpoint at ``address`` counts a pending request of ``sleepy``."""
    connection = http.client.HTTPConnection(address, timeout=10)
    try:
        connection.request("GET", "/metrics")
        text = connection.getresponse().read().decode()
    finally:
        connection.close()
    return any(
        line.startswith('nv_inference_pending_request_count{model="sleepy"')
        and float(line.split()[-1]) > 0
        for line in text.splitlines()
    )
