"""Tracing at the edges: malformed traceparents and the rate, exit with the collector down."""

from __future__ import annotations

import socket
import time
from typing import Any

import numpy as np
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import orchestrion
from orchestrion.telemetry import _tracing as tracing_module
from orchestrion.telemetry import make_tracer_provider
from orchestrion.testing import plus_one

X = np.arange(16, dtype=np.float32)


async def test_a_malformed_traceparent_does_not_bypass_the_rate(monkeypatch: Any) -> None:
    """With rate=1e9 a request whose traceparent is garbage is a root: (almost) never sampled."""
    exporter = InMemorySpanExporter()
    monkeypatch.setattr(
        tracing_module, "make_tracer_provider", lambda c: make_tracer_provider(c, exporter)
    )
    flags = ["mode=opentelemetry", "rate=1000000000"]
    async with orchestrion.open_server(models=[plus_one("a")], tracing=flags) as server:
        for _ in range(5):
            await server.infer("a", {"X": X}, traceparent="garbage")
    assert exporter.get_finished_spans() == ()


async def test_closing_with_an_unreachable_collector_is_prompt() -> None:
    """Leaving open_server does not hang (shielded from Ctrl-C) retrying a dead collector."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # nothing listens there once closed
    flags = ["mode=opentelemetry", f"opentelemetry,url=http://127.0.0.1:{port}/v1/traces"]
    async with orchestrion.open_server(models=[plus_one("a")], tracing=flags) as server:
        await server.infer("a", {"X": X})
        leaving = time.monotonic()
    assert time.monotonic() - leaving < 5  # the SDK default: 7-10 s of retries
