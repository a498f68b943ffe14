"""A steady load through the load balancer of a `ReplicaSite`: tritonclient's HTTP and gRPC
clients in threads, each request's answer checked and timed.

How this works: every client thread takes the next request number from one counter, asks for
``Y = 2 X + 1`` with ``X`` made from that number (``distinct`` values in turn, so that
requests repeat and the shared cache answers them; or every one new), and records one
`Outcome`: the right answer, a wrong one, or the error the client saw, with its latency.
A call that never returns would hold its thread: the clients' network timeout (30 s) bounds
it, and `ReplicaLoad.stop` joins the threads with a deadline.
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any

import attrs
import numpy as np
import tritonclient.grpc as grpcclient

from ._replicas import MODEL


@attrs.frozen(kw_only=True)
class Outcome:
    """One request as its client saw it."""

    index: int
    protocol: str
    started: float
    """`time.monotonic` when it was sent."""
    latency: float
    error: str | None = None
    """What the client saw instead of the right answer (None: the right answer)."""


def request_value(index: int, distinct: int | None) -> np.ndarray[Any, Any]:
    """Request ``index``'s input: ``distinct`` values in turn (None: each one new; exact in
    FP32 up to 2**24)."""
    value = index % distinct if distinct else index
    return np.full(16, float(value), np.float32)


@attrs.define(eq=False)
class ReplicaLoad:
    """``http_clients`` + ``grpc_clients`` threads asking through ``http`` and ``grpc``."""

    http: str
    grpc: str
    http_clients: int = 4
    grpc_clients: int = 4
    distinct: int | None = 200
    first: int = 0
    """The first request's number (``distinct=None``: runs that must not meet each other's
    cached answers start apart)."""
    outcomes: list[Outcome] = attrs.field(factory=list)
    _counter: itertools.count[int] = attrs.field(init=False)
    _stop: threading.Event = attrs.field(factory=threading.Event)
    _threads: list[threading.Thread] = attrs.field(factory=list)

    def __attrs_post_init__(self) -> None:
        self._counter = itertools.count(self.first)

    def start(self) -> ReplicaLoad:
        """Start the client threads."""
        kinds = ["http"] * self.http_clients + ["grpc"] * self.grpc_clients
        for kind in kinds:
            thread = threading.Thread(target=self._client, args=(kind,), daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self, timeout: float = 60.0) -> list[Outcome]:
        """Stop the clients (each finishes its request) and return every outcome.

        Raises:
            TimeoutError: a client is still waiting for an answer after ``timeout``.
        """
        self._stop.set()
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                raise TimeoutError("a client still waits for its answer")
        return list(self.outcomes)

    def count(self) -> int:
        """Requests answered so far (rightly or not)."""
        return len(self.outcomes)

    def wait_for(self, count: int, timeout: float = 60.0) -> None:
        """Wait until ``count`` requests have been answered.

        Raises:
            TimeoutError: they were not, within ``timeout``.
        """
        deadline = time.monotonic() + timeout
        while self.count() < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.count()} of {count} requests answered")
            time.sleep(0.01)

    def _client(self, kind: str) -> None:
        import tritonclient.http as httpclient  # the test extra's (geventhttpclient)

        if kind == "http":
            client: Any = httpclient.InferenceServerClient(
                self.http, connection_timeout=30, network_timeout=30
            )
        else:
            client = grpcclient.InferenceServerClient(self.grpc)
        protocol = httpclient if kind == "http" else grpcclient
        try:
            while not self._stop.is_set():
                self.outcomes.append(self._one(kind, protocol, client, next(self._counter)))
        finally:
            client.close()

    def _one(self, kind: str, protocol: Any, client: Any, index: int) -> Outcome:
        x = request_value(index, self.distinct)
        item = protocol.InferInput("X", [16], "FP32")
        item.set_data_from_numpy(x)
        started = time.monotonic()
        error = None
        try:
            kwargs = {"client_timeout": 30} if kind == "grpc" else {}
            y = client.infer(MODEL, [item], **kwargs).as_numpy("Y")
            if y is None or not np.array_equal(y, x * 2 + 1):
                error = f"wrong answer: {y!r}"
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        return Outcome(
            index=index,
            protocol=kind,
            started=started,
            latency=time.monotonic() - started,
            error=error,
        )


def percentile(values: list[float], share: float) -> float:
    """The ``share`` (0-1) percentile of ``values`` (nearest rank); 0 when empty."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]
