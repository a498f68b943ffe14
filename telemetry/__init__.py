"""Prometheus metrics (Triton's names) and OpenTelemetry traces of a server."""

from ._http import metrics_app as metrics_app
from ._http import open_metrics_endpoint as open_metrics_endpoint
from ._http import serve_metrics_endpoint as serve_metrics_endpoint
from ._metrics import CONTENT_TYPE as CONTENT_TYPE
from ._metrics import MetricsSource as MetricsSource
from ._metrics import ServerMetrics as ServerMetrics
from ._metrics import make_metrics_registry as make_metrics_registry
from ._metrics import metrics_text as metrics_text
from ._metrics import render_text as render_text
from ._tracing import UNSAMPLED as UNSAMPLED
from ._tracing import RequestTracing as RequestTracing
from ._tracing import extract_traceparent as extract_traceparent
from ._tracing import make_exporter as make_exporter
from ._tracing import make_tracer_provider as make_tracer_provider
from ._tracing import open_request_tracing as open_request_tracing
from ._tracing import request_tracing as request_tracing
