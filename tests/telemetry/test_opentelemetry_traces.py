"""OpenTelemetry traces: the span tree of an ensemble request, cache and compute spans, an
incoming traceparent, sampling, the trace flags, and the real OTLP/HTTP wire path."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import trio
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

import orchestrion
from orchestrion.protocols import ConfigError, TraceConfig, parse_trace_config
from orchestrion.testing import cached, chain, model, tensor

X = np.arange(16, dtype=np.float32)
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_ID = "b7ad6b7169203331"


def pipeline() -> list[orchestrion.Model]:
    def a(X: Any) -> dict[str, Any]:
        if X[0] < 0:
            raise RuntimeError("negative input")
        return {"Y": X + 1}

    return [
        cached(model("a", a, [tensor("X")], [tensor("Y")], jit=False)),
        model("b", lambda X: {"Y": X * 2}, [tensor("X")], [tensor("Y")], jit=False),
        chain("pipe", "a", "b"),
    ]


@pytest.fixture
def spans() -> Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider, exporter
    provider.shutdown()


def tree(finished: tuple[ReadableSpan, ...]) -> dict[str, list[str]]:
    """Span name -> names of its children (sorted)."""
    by_id = {s.context.span_id: s for s in finished}
    children: dict[str, list[str]] = {s.name: [] for s in finished}
    for s in finished:
        if s.parent is not None and s.parent.span_id in by_id:
            children[by_id[s.parent.span_id].name].append(s.name)
    return {name: sorted(kids) for name, kids in children.items()}


async def test_span_tree_of_an_ensemble_request(spans: Any) -> None:
    """InferRequest -> a span per composing-model request -> compute and cache spans."""
    provider, exporter = spans
    async with orchestrion.open_server(
        models=pipeline(), cache_config="local,size=1048576", tracing=provider
    ) as server:
        await server.infer("pipe", {"IN": X}, request_id="r-1")
    finished = exporter.get_finished_spans()
    assert tree(finished) == {
        "InferRequest": ["a", "b"],
        "a": ["cache_insert", "cache_lookup", "compute"],
        "b": ["compute"],
        "compute": [],
        "cache_lookup": [],
        "cache_insert": [],
    }
    assert len({s.context.trace_id for s in finished}) == 1
    root = next(s for s in finished if s.name == "InferRequest")
    assert root.parent is None
    assert root.kind is SpanKind.SERVER
    assert dict(root.attributes or {}) == {
        "orchestrion.model.name": "pipe",
        "orchestrion.model.version": 1,
        "orchestrion.request.id": "r-1",
        "orchestrion.batch_size": 1,
    }
    a = next(s for s in finished if s.name == "a")
    assert (a.attributes or {})["orchestrion.cache.hit"] is False
    assert (a.attributes or {})["orchestrion.request.id"] == "r-1"
    lookup = next(s for s in finished if s.name == "cache_lookup")
    assert (lookup.attributes or {})["orchestrion.cache.hit"] is False
    for s in finished:  # children lie within their parents
        assert s.start_time is not None
        assert s.end_time is not None
        assert s.start_time <= s.end_time
        if s.parent is not None:
            parent = next(p for p in finished if p.context.span_id == s.parent.span_id)
            assert parent.start_time is not None
            assert parent.end_time is not None
            assert parent.start_time <= s.start_time + 1_000_000  # 1 ms of clock slack
            assert s.end_time <= parent.end_time + 1_000_000


async def test_a_hit_and_a_failure(spans: Any) -> None:
    """A cache hit has no compute span; a failure sets ERROR with Triton's reason."""
    provider, exporter = spans
    async with orchestrion.open_server(
        models=pipeline(), cache_config="local,size=1048576", tracing=provider
    ) as server:
        await server.infer("a", {"X": X})
        exporter.clear()
        await server.infer("a", {"X": X})
        hit = exporter.get_finished_spans()
        exporter.clear()
        with pytest.raises(orchestrion.InferenceError):
            await server.infer("pipe", {"IN": -(X + 1)})
        failed = exporter.get_finished_spans()
    assert sorted(s.name for s in hit) == ["InferRequest", "cache_lookup"]
    root = next(s for s in hit if s.name == "InferRequest")
    assert (root.attributes or {})["orchestrion.cache.hit"] is True
    by_name = {s.name: s for s in failed}
    assert by_name["InferRequest"].status.status_code is StatusCode.ERROR
    assert by_name["a"].status.status_code is StatusCode.ERROR
    assert (by_name["a"].attributes or {})["orchestrion.failure.reason"] == "BACKEND"
    assert "negative input" in (by_name["a"].status.description or "")


async def test_an_incoming_traceparent_is_the_parent(spans: Any) -> None:
    """A W3C traceparent makes the request's span a child of the caller's span."""
    provider, exporter = spans
    async with orchestrion.open_server(models=pipeline(), tracing=provider) as server:
        await server.infer("pipe", {"IN": X}, traceparent=f"00-{TRACE_ID}-{PARENT_ID}-01")
        await server.infer("pipe", {"IN": X}, traceparent="garbage")
    roots = [s for s in exporter.get_finished_spans() if s.name == "InferRequest"]
    assert roots[0].context.trace_id == int(TRACE_ID, 16)
    assert roots[0].parent is not None
    assert roots[0].parent.span_id == int(PARENT_ID, 16)
    assert roots[0].parent.is_remote
    assert roots[1].parent is None  # a malformed header starts a new trace


async def test_tracing_off_records_nothing(spans: Any) -> None:
    """No tracing argument: no spans, even with a traceparent."""
    _provider, exporter = spans
    async with orchestrion.open_server(models=pipeline()) as server:
        await server.infer("pipe", {"IN": X}, traceparent=f"00-{TRACE_ID}-{PARENT_ID}-01")
    assert exporter.get_finished_spans() == ()


def test_blocking_server_traces(spans: Any) -> None:
    """The blocking Server takes tracing (and a traceparent) too."""
    provider, exporter = spans
    with orchestrion.Server(models=pipeline(), tracing=provider) as blocking:
        blocking.infer("pipe", {"IN": X}, traceparent=f"00-{TRACE_ID}-{PARENT_ID}-01")
    finished = exporter.get_finished_spans()
    assert len(finished) == 5
    assert {s.context.trace_id for s in finished} == {int(TRACE_ID, 16)}


async def test_blocking_server_inside_an_event_loop_is_refused() -> None:
    """Opening the blocking Server in trio code is a clear error, not a deadlock."""
    with pytest.raises(RuntimeError, match="use `async with orchestrion.open_server"):
        orchestrion.Server(models=pipeline()).open()


class Receiver:
    """A loopback OTLP/HTTP receiver: decodes each posted ExportTraceServiceRequest."""

    def __init__(self) -> None:
        self.requests: list[ExportTraceServiceRequest] = []
        self.paths: list[str] = []
        self.types: list[str] = []
        received = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                message = ExportTraceServiceRequest()
                message.ParseFromString(body)
                received.requests.append(message)
                received.paths.append(self.path)
                received.types.append(self.headers["Content-Type"])
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def spans(self) -> list[Any]:
        return [
            span
            for request in self.requests
            for resource in request.resource_spans
            for scope in resource.scope_spans
            for span in scope.spans
        ]


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    got = Receiver()
    got.thread.start()
    try:
        yield got
    finally:
        got.server.shutdown()
        got.server.server_close()
        got.thread.join(timeout=10)


async def test_otlp_http_export_reaches_a_collector(receiver: Receiver) -> None:
    """With Triton-style flags the server exports OTLP/HTTP protobuf and flushes on exit."""
    flags = [
        "mode=opentelemetry",
        "rate=1",
        f"opentelemetry,url=127.0.0.1:{receiver.port}/v1/traces",
        "opentelemetry,resource=deployment.environment=test",
    ]
    async with orchestrion.open_server(models=pipeline(), tracing=flags) as server:
        await server.infer("pipe", {"IN": X}, traceparent=f"00-{TRACE_ID}-{PARENT_ID}-01")
    spans = receiver.spans()
    assert receiver.paths
    assert set(receiver.paths) == {"/v1/traces"}
    assert receiver.types[0] == "application/x-protobuf"
    assert sorted(s.name for s in spans) == ["InferRequest", "a", "b", "compute", "compute"]
    assert {s.trace_id.hex() for s in spans} == {TRACE_ID}
    root = next(s for s in spans if s.name == "InferRequest")
    assert root.parent_span_id.hex() == PARENT_ID
    resource = {
        a.key: a.value.string_value
        for a in receiver.requests[0].resource_spans[0].resource.attributes
    }
    assert resource["service.name"] == "orchestrion"
    assert resource["deployment.environment"] == "test"


async def test_sampling_rate(receiver: Receiver) -> None:
    """rate=N samples 1 in N; a sampled incoming parent is always followed (parent-based)."""
    flags = [
        "mode=opentelemetry",
        "rate=1000000000",
        f"opentelemetry,url=http://127.0.0.1:{receiver.port}/v1/traces",
    ]
    async with orchestrion.open_server(models=pipeline(), tracing=flags) as server:
        for _ in range(20):
            await server.infer("pipe", {"IN": X})
        await server.infer("pipe", {"IN": X}, traceparent=f"00-{TRACE_ID}-{PARENT_ID}-01")
    spans = receiver.spans()
    assert len(spans) == 5
    assert {s.trace_id.hex() for s in spans} == {TRACE_ID}


def test_trace_config_flags() -> None:
    """Triton's --trace-config format: global keys and opentelemetry,<key>=<value>."""
    assert parse_trace_config(None) is None
    assert parse_trace_config(["mode=opentelemetry", "level=OFF"]) is None
    assert parse_trace_config("mode=opentelemetry") == TraceConfig()
    config = parse_trace_config(
        [
            "mode=opentelemetry",
            "rate=100",
            "count=-1",
            "opentelemetry,url=http://collector:4318/v1/traces",
            "opentelemetry,resource=service.name=edge",
            "opentelemetry,resource=team=ml",
            "opentelemetry,protocol=grpc",
        ]
    )
    assert config == TraceConfig(
        rate=100,
        url="http://collector:4318/v1/traces",
        protocol="grpc",
        resource={"service.name": "edge", "team": "ml"},
    )


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["mode=triton"], "opentelemetry only"),
        (["rate=0"], "a positive integer"),
        (["rate=often"], "a positive integer"),
        (["nonsense"], "malformed"),
        (["jaeger,url=x"], "malformed"),
        (["opentelemetry,colour=red"], "unknown key"),
        (["opentelemetry,resource=novalue"], "expected <name>=<value>"),
        (["opentelemetry,protocol=carrier-pigeon"], "http/protobuf or grpc"),
        (["count=10"], "only -1"),
        (["level=DETAILED"], "TIMESTAMPS or OFF"),
    ],
)
def test_trace_config_errors(flags: list[str], message: str) -> None:
    """Malformed trace flags are start-up errors that say what is expected."""
    with pytest.raises(ConfigError, match=message):
        parse_trace_config(flags)


async def test_bad_trace_flags_stop_the_server() -> None:
    """open_server refuses bad trace flags before loading anything."""
    with pytest.raises(ConfigError, match="unknown key"):
        async with orchestrion.open_server(models=pipeline(), tracing=["opentelemetry,x=1"]):
            pass
    await trio.lowlevel.checkpoint()


async def test_otlp_grpc_export_reaches_a_collector() -> None:
    """opentelemetry,protocol=grpc exports to a gRPC TraceService on loopback."""
    from concurrent import futures

    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    received: list[ExportTraceServiceRequest] = []

    class Collector(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request: Any, context: Any) -> Any:
            received.append(request)
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Collector(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        flags = [
            "mode=opentelemetry",
            "opentelemetry,protocol=grpc",
            f"opentelemetry,url=127.0.0.1:{port}",  # no scheme: plain text, as over HTTP
        ]
        async with orchestrion.open_server(models=pipeline(), tracing=flags) as orch:
            await orch.infer("pipe", {"IN": X})
    finally:
        server.stop(grace=None).wait(timeout=10)
    names = sorted(
        span.name
        for request in received
        for resource in request.resource_spans
        for scope in resource.scope_spans
        for span in scope.spans
    )
    assert names == ["InferRequest", "a", "b", "compute", "compute"]
