"""OpenTelemetry traces of the requests a server runs.

How this works: the runtime uses only the OpenTelemetry *API*, through `RequestTracing`; the
SDK (provider, sampler, exporter) is configured at the edge, by `open_request_tracing` from
Triton's ``--trace-config`` flags and the ``OTEL_*`` variables, or by the embedding
application, which may pass its own ``TracerProvider``.

Each request gets a span (``InferRequest`` for a client's request, the model's name for an
ensemble step's request), whose context is stored *in the request message* (`InferRequest.
trace`): an ensemble derives its steps' requests from it, so a step's span is a child of the
ensemble's whatever task runs it, and nothing depends on task-local context in long-lived
actors. Compute and cache lookups become child spans recorded after the fact from the
timestamps the runtime measures anyway. A client's W3C ``traceparent`` becomes the parent of
its request's span. Sampling is parent-based: an unsampled request costs one
non-recording span per model it touches.
"""

from __future__ import annotations

import contextlib
import os
import random
import time
from collections.abc import Mapping, Sequence
from typing import Any

import trio
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from ..protocols import ConfigError, InferRequest, TraceConfig, failure_reason, parse_trace_config

INSTRUMENTATION = "orchestrion"
EXPORT_TIMEOUT_S = 2.0
"""How long one export may take, retries included, unless ``OTEL_EXPORTER_OTLP_TIMEOUT``
says otherwise (the SDK's default, 10 s, would hold a server's exit that long)."""
_PROPAGATOR = TraceContextTextMapPropagator()
UNSAMPLED = object()
"""The `InferRequest.trace` of a request the sampler left out: its parts make no spans."""


def _wall(perf_ns: int) -> int:
    """A ``perf_counter_ns`` stamp (what the runtime measures with) as wall-clock nanoseconds
    (what spans want), by the clocks' offset now: the wall clock may have been stepped since
    start (a VM's clock is), and the request's own span was started by the wall clock."""
    return perf_ns + time.time_ns() - time.perf_counter_ns()


def extract_traceparent(traceparent: str, tracestate: str | None = None) -> Context:
    """The context a W3C ``traceparent`` header names (an empty context if malformed)."""
    carrier = {"traceparent": traceparent}
    if tracestate:
        carrier["tracestate"] = tracestate
    return _PROPAGATOR.extract(carrier)


class RequestTracing:
    """Starts and ends the spans of requests; used by the runtime, never global.

    Args:
        tracer: where spans go.
        root_rate: when the provider was made from ``rate=N`` (its sampler then samples
            every root), the 1-in-N decision for requests without a parent is taken here
            with one random draw, before any span exists: an unsampled request then costs
            no SDK call at all. None: the provider's sampler decides everything.
    """

    def __init__(self, tracer: trace.Tracer, root_rate: int | None = None) -> None:
        self._tracer = tracer
        self._root_rate = root_rate
        self._random = random.Random()

    @staticmethod
    def traced(request: InferRequest) -> bool:
        """Whether ``request`` is sampled (its parts deserve spans)."""
        return isinstance(request.trace, Context)

    def start_request(
        self,
        model_name: str,
        version: int,
        request: InferRequest,
        batch_size: int,
        from_ensemble: bool,
    ) -> tuple[Span | None, InferRequest]:
        """A span for ``request`` (child of its context) and the request carrying it.

        A request that is not sampled is marked `UNSAMPLED`: its ensemble steps then make
        no spans at all (the sampler would say no to each of them anyway).
        """
        parent = request.trace
        if parent is UNSAMPLED:
            return None, request
        context = parent if isinstance(parent, Context) else None
        rate = self._root_rate
        if (
            context is None
            and rate is not None
            and rate > 1
            and self._random.random() * rate >= 1.0
        ):
            return None, request.with_trace(UNSAMPLED)
        span = self._tracer.start_span(
            model_name if from_ensemble else "InferRequest",
            context=context,
            kind=SpanKind.INTERNAL if from_ensemble else SpanKind.SERVER,
        )
        if not span.is_recording():
            return None, request.with_trace(UNSAMPLED)
        span.set_attributes(
            {
                "orchestrion.model.name": model_name,
                "orchestrion.model.version": version,
                "orchestrion.request.id": request.options.request_id,
                "orchestrion.batch_size": batch_size,
            }
        )
        return span, request.with_trace(trace.set_span_in_context(span, context))

    @staticmethod
    def end_request(span: Span, error: BaseException | None, cache_hit: bool | None) -> None:
        """End a request's span with its outcome."""
        if span.is_recording():
            if cache_hit is not None:
                span.set_attribute("orchestrion.cache.hit", cache_hit)
            if error is not None:
                span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
                span.set_attribute("orchestrion.failure.reason", failure_reason(error))
        span.end()

    def record(
        self,
        name: str,
        request: InferRequest,
        start_ns: int,
        end_ns: int,
        attributes: Mapping[str, Any] | None = None,
        failed: bool = False,
    ) -> None:
        """A finished child span of ``request``'s span, from ``perf_counter_ns`` stamps."""
        parent = request.trace
        if not isinstance(parent, Context):
            return  # not traced, or not sampled (UNSAMPLED)
        span = self._tracer.start_span(
            name, context=parent, start_time=_wall(start_ns), attributes=attributes
        )
        if failed:
            span.set_status(Status(StatusCode.ERROR))
        span.end(end_time=_wall(end_ns))


def make_exporter(config: TraceConfig) -> SpanExporter:
    """An OTLP exporter over HTTP (protobuf) or gRPC, from ``config`` and ``OTEL_*``.

    Raises:
        ConfigError: an OTLP protocol orchestrion cannot export with.
    """
    protocol = (
        config.protocol
        or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    )
    if protocol not in ("grpc", "http/protobuf"):
        raise ConfigError(
            f"OTLP protocol {protocol!r} (from OTEL_EXPORTER_OTLP_PROTOCOL): orchestrion "
            "exports http/protobuf or grpc"
        )
    url = config.url
    if url is not None and "://" not in url:
        url = "http://" + url  # Triton's examples give host:port/v1/traces (plain text)
    # A collector that is down must not hold the server's exit for the SDK's 10 s of retries.
    timeout = None
    if not any(os.environ.get(f"OTEL_EXPORTER_OTLP_{part}TIMEOUT") for part in ("TRACES_", "")):
        timeout = EXPORT_TIMEOUT_S
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter as GrpcExporter,
        )

        return GrpcExporter(endpoint=url, timeout=timeout)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=url, timeout=timeout)


def make_tracer_provider(
    config: TraceConfig, exporter: SpanExporter | None = None
) -> TracerProvider:
    """A provider that follows a caller's sampling decision and samples every root (the
    1-in-``rate`` choice of roots is `RequestTracing`'s, see `request_tracing`), exporting
    in batches from the SDK's worker thread; the caller owns it and must `shutdown` it."""
    resource = Resource.create(dict(config.resource))  # OTEL_RESOURCE_ATTRIBUTES too
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = resource.merge(Resource({"service.name": "orchestrion"}))
    provider = TracerProvider(resource=resource, sampler=ParentBased(ALWAYS_ON))
    provider.add_span_processor(BatchSpanProcessor(exporter or make_exporter(config)))
    return provider


def request_tracing(provider: trace.TracerProvider, root_rate: int | None = None) -> RequestTracing:
    """The runtime's tracing, on ``provider`` (the server's own, made by
    `make_tracer_provider` with ``root_rate`` = its config's rate, or the application's)."""
    return RequestTracing(provider.get_tracer(INSTRUMENTATION), root_rate)


async def open_request_tracing(
    stack: contextlib.AsyncExitStack,
    tracing: str | Sequence[str] | trace.TracerProvider | None,
) -> RequestTracing | None:
    """The runtime's tracing from a server's ``tracing`` option (Triton's ``--trace-config``
    values, or the application's own provider; None: no spans); a provider made here is
    shut down (flushed, off the event loop) when ``stack`` closes."""
    if tracing is None:
        return None
    if isinstance(tracing, trace.TracerProvider):
        return request_tracing(tracing)  # the application's: it shuts it down
    config = parse_trace_config(tracing)
    if config is None:
        return None
    provider = make_tracer_provider(config)

    async def shutdown() -> None:
        # Flushing exports over the network: off the event loop, and even when cancelled.
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(provider.shutdown)

    stack.push_async_callback(shutdown)
    return request_tracing(provider, root_rate=config.rate)
