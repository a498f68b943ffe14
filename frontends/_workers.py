"""``orchestrion serve --workers N``: N server processes behind the same ports.

How this works. One server process runs its requests' Python work on one thread; several
use every core. The command's own process becomes a supervisor (`serve_workers`): it loads
no model and starts N copies of the same ``serve`` command (``--worker-of N`` tells each it
is a worker). Each worker loads the models and binds the HTTP and gRPC ports with
SO_REUSEPORT, so the kernel spreads new connections across them (a connection stays with
one worker); a port given as 0 is chosen once, by the supervisor, for all of them.

- **Start.** The supervisor forwards each worker's lines, prefixed ``worker i:``, and waits
  for every worker's start-up lines, which it replaces with one (``worker i (pid p) ready in
  ... s; its own metrics at ...``); then it prints Triton's own (``Started HTTPService at
  ...``, and the metrics service, which it serves itself) and ``ready in``. A worker that
  exits before it is ready stops the start: the others are stopped, and the command exits
  with that worker's status (its error already printed).
- **Metrics.** Each worker serves its metrics on a loopback port of its own (its line says
  which); the supervisor's metrics port answers with their sum (`add_up`): counters,
  histograms and per-process gauges add up; settings, a shared cache backend's size and
  utilizations are combined as they should be (`NOT_ADDED`, `SHARED_BACKEND`).
- **Failure.** A worker that exits while serving is started again (logged), at most
  `RESTARTS` times in `RESTART_WINDOW` seconds; beyond that, the server stops and the
  command exits with status 1.
- **Stop.** SIGINT or SIGTERM to the supervisor sends SIGTERM to every worker, which stops
  gracefully (``--exit-timeout-secs``); one still running `KILL_AFTER` seconds after that is
  killed. The workers run in sessions of their own, so a terminal's Ctrl-C reaches them
  only through the supervisor, once. A worker whose supervisor disappears (killed) stops
  by itself (`_serve.stop_when_orphaned`).
- **What a worker refuses.** Model control through the API and client shared memory: each
  would reach the one worker that the request's connection landed on. Both are refused
  with a message that says so; everything else (inference, health, metadata, statistics of
  that worker, the cache, tracing) works as with one process. A local response cache is
  per worker; a Redis cache is shared.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs
import trio
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry

from ..protocols import ConfigError, ungrouped
from ..telemetry import render_text, serve_metrics_endpoint
from ._logging import GRPC_STARTED, HTTP_STARTED, METRICS_STARTED, report_started

if TYPE_CHECKING:
    from rich.console import Console

    from ._serve import ServeOptions

_log = logging.getLogger("orchestrion")

RESTARTS = 5
"""How many times workers may be started again within `RESTART_WINDOW` seconds."""
RESTART_WINDOW = 60.0
KILL_AFTER = 10.0
"""Seconds past the exit timeout after which a worker that has not stopped is killed."""
NOT_ADDED: dict[str, str] = {
    "orchestrion_cache_available": "min",
    "orchestrion_step_max_inflight_requests": "max",
    "orchestrion_model_load_seconds": "max",
    "nv_cache_util": "mean",
}
"""Gauges whose workers' values do not add up, and how they combine: the cache backend
answers only where it answers every worker; a setting or a load time is the same or the
longest; a utilization is the workers' mean."""
SHARED_BACKEND = frozenset({"orchestrion_cache_used_bytes", "orchestrion_cache_capacity_bytes"})
"""Gauges of a cache that every worker shares (any but ``cache="local"``): each reports the
same backend, so they are taken once (the largest)."""
_COUNTER = re.compile(r"^# TYPE (\S+) counter$", re.MULTILINE)


# -- the supervisor ------------------------------------------------------------------------


class WorkerFailed(Exception):
    """A worker exited before it was ready, or workers kept failing while serving."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


@attrs.define(eq=False)
class _Worker:
    index: int
    process: trio.Process | None = None
    metrics: str | None = None
    """Where its metrics are served (``host:port``), once it said so."""
    grpc: str | None = None
    http: str | None = None
    """Where its front ends listen (``host:port``), once it said so."""
    ready: trio.Event = attrs.field(factory=trio.Event)


@attrs.define(eq=False)
class _Supervisor:
    options: ServeOptions
    command: list[str]
    console: Console
    workers: list[_Worker]
    stopping: bool = False
    restarts: list[float] = attrs.field(factory=list)

    async def run_worker(self, worker: _Worker, first: bool) -> None:
        """Run ``worker`` until it exits for good: started again while serving (within the
        budget), never before the server is ready."""
        while True:
            status = await self._run_once(worker)
            if self.stopping:
                return
            if first and not worker.ready.is_set():
                raise WorkerFailed(
                    f"worker {worker.index} exited with status {status} before it was ready",
                    status or 1,
                )
            now = time.monotonic()
            self.restarts = [t for t in self.restarts if now - t < RESTART_WINDOW] + [now]
            if len(self.restarts) > RESTARTS:
                raise WorkerFailed(
                    f"workers exited {len(self.restarts)} times within {RESTART_WINDOW:g} s "
                    f"(worker {worker.index} last, status {status}): stopping",
                    1,
                )
            _log.error("worker %d exited with status %s: starting another", worker.index, status)
            worker.metrics, worker.ready = None, trio.Event()
            first = False

    async def _run_once(self, worker: _Worker) -> int:
        """One process of ``worker``, its lines forwarded, until it exits; its status."""
        async with trio.open_nursery() as nursery:
            process: trio.Process = await nursery.start(
                functools.partial(
                    trio.run_process,
                    self.command,
                    stdout=subprocess.PIPE,
                    check=False,
                    start_new_session=True,
                    deliver_cancel=self._stop_process,
                )
            )
            worker.process = process
            assert process.stdout is not None
            await self._forward(worker, process.stdout)
        worker.process = None
        return process.returncode if process.returncode is not None else 1

    async def _forward(self, worker: _Worker, stream: trio.abc.ReceiveStream) -> None:
        """Print the worker's lines (prefixed), noting its addresses and readiness."""
        pending = b""
        async for chunk in stream:
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for raw in lines:
                line = raw.decode(errors="replace")
                # Its start-up lines are not passed on: scripts wait for the supervisor's.
                if line.startswith(METRICS_STARTED):
                    worker.metrics = line.removeprefix(METRICS_STARTED).strip()
                elif line.startswith(GRPC_STARTED):
                    worker.grpc = line.removeprefix(GRPC_STARTED).strip()
                elif line.startswith(HTTP_STARTED):
                    worker.http = line.removeprefix(HTTP_STARTED).strip()
                elif line.startswith("ready in "):
                    pid = worker.process.pid if worker.process is not None else 0
                    own = f"; its own metrics at {worker.metrics}" if worker.metrics else ""
                    self._say(f"worker {worker.index} (pid {pid}) {line.split(';')[0]}{own}")
                    worker.ready.set()
                else:
                    self._say(f"worker {worker.index}: {line}")
        if pending:
            self._say(f"worker {worker.index}: {pending.decode(errors='replace')}")

    def _say(self, line: str) -> None:
        """One line on standard output, as it is (no markup, no wrapping)."""
        self.console.print(line, highlight=False, markup=False, soft_wrap=True)

    async def _stop_process(self, process: trio.Process) -> None:
        """SIGTERM (a graceful stop), then SIGKILL past the exit timeout."""
        with contextlib.suppress(OSError):
            process.send_signal(signal.SIGTERM)
        with trio.move_on_after(self.options.exit_timeout + KILL_AFTER):
            await process.wait()
            return
        _log.error("worker pid %d did not stop in time: killing it", process.pid)
        process.kill()

    def stop_all(self) -> None:
        """Send every worker SIGTERM (once)."""
        if self.stopping:
            return
        self.stopping = True
        for worker in self.workers:
            if worker.process is not None and worker.process.returncode is None:
                with contextlib.suppress(OSError):
                    worker.process.send_signal(signal.SIGTERM)

    def metrics_sources(self) -> list[str]:
        return [w.metrics for w in self.workers if w.metrics is not None]


async def serve_workers(
    options: ServeOptions,
    argv: Sequence[str],
    console: Console,
) -> int:
    """Run ``options.workers`` workers of the ``serve`` command ``argv`` (its arguments,
    from ``serve`` on) until SIGINT or SIGTERM; the command's exit status.

    Raises:
        ConfigError: a port cannot be reserved.
    """
    began = time.perf_counter()
    with contextlib.ExitStack() as reserved:
        http_port = _reserve(reserved, options.http_address, options.http_port)
        grpc_port = _reserve(reserved, options.grpc_address, options.grpc_port)
        command = [sys.executable, "-m", "orchestrion", *argv, "--workers", "1"]
        command += ["--worker-of", str(options.workers)]
        if http_port is not None:
            command += ["--http-port", str(http_port)]
        if grpc_port is not None:
            command += ["--grpc-port", str(grpc_port)]
        if options.metrics_port is not None:
            command += ["--metrics-port", "0", "--metrics-address", "127.0.0.1"]
        workers = [_Worker(i) for i in range(options.workers)]
        supervisor = _Supervisor(options, command, console, workers)
        try:
            async with ungrouped(trio.open_nursery()) as nursery:
                nursery.start_soon(_stop_on_signal, supervisor, nursery.cancel_scope, console)
                for worker in workers:
                    nursery.start_soon(supervisor.run_worker, worker, True)
                for worker in workers:
                    await worker.ready.wait()
                metrics = None
                if options.metrics_port is not None:
                    metrics = await nursery.start(
                        serve_metrics_endpoint,
                        CollectorRegistry(auto_describe=False),
                        options.metrics_address,
                        options.metrics_port,
                        functools.partial(_added_up, supervisor),
                    )
                at = metrics.removeprefix("http://").removesuffix("/metrics") if metrics else None
                first = workers[0]
                report_started(console, first.grpc, first.http, at, time.perf_counter() - began)
        except WorkerFailed as exc:
            console.print(f"[red]error:[/red] {exc}", highlight=False, soft_wrap=True)
            return exc.status
    console.print("stopped")
    return 0


async def _stop_on_signal(
    supervisor: _Supervisor, scope: trio.CancelScope, console: Console
) -> None:
    """At the first SIGINT or SIGTERM, stop every worker gracefully; then the metrics
    endpoint (once the workers are gone). A second signal kills what is left."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for number in signals:
            console.print(
                f"{signal.Signals(number).name}: stopping {len(supervisor.workers)} workers "
                f"(requests in flight get {supervisor.options.exit_timeout:g} s)",
                highlight=False,
            )
            supervisor.stop_all()
            break
        with trio.CancelScope() as waiting:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_wait_for_workers, supervisor, waiting)
                async for _ in signals:  # a second signal: no more waiting
                    for worker in supervisor.workers:
                        if worker.process is not None:
                            worker.process.kill()
                    break
    scope.cancel()


async def _wait_for_workers(supervisor: _Supervisor, done: trio.CancelScope) -> None:
    for worker in supervisor.workers:
        if worker.process is not None:
            await worker.process.wait()
    done.cancel()


def _reserve(stack: contextlib.ExitStack, host: str, port: int | None) -> int | None:
    """The port the workers will share (``0``: a free one, held by a socket bound here with
    SO_REUSEPORT, not listening, until the workers are gone); None: not served.

    Raises:
        ConfigError: the address cannot be bound.
    """
    if port is None or port != 0:
        return port
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        held = stack.enter_context(socket.socket(family, socket.SOCK_STREAM))
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        held.bind((host, 0))
    except OSError as exc:
        raise ConfigError(f"cannot reserve a port on {host}: {exc.strerror or exc}") from None
    return int(held.getsockname()[1])


# -- metrics that add up -------------------------------------------------------------------


async def _added_up(supervisor: _Supervisor) -> str:
    """Every worker's metrics, added up (`add_up`)."""
    sources = supervisor.metrics_sources()
    texts: list[str] = [""] * len(sources)

    async def fetch(index: int, at: str) -> None:
        texts[index] = await trio.to_thread.run_sync(_fetch, at)

    async with trio.open_nursery() as nursery:
        for index, at in enumerate(sources):
            nursery.start_soon(fetch, index, at)
    return add_up([t for t in texts if t])


def _fetch(at: str) -> str:
    """One worker's metrics text ("" when it does not answer: it is being replaced)."""
    try:
        with urllib.request.urlopen(f"http://{at}/metrics", timeout=5) as response:
            return str(response.read().decode())
    except OSError:
        return ""


def add_up(texts: Sequence[str]) -> str:
    """Prometheus texts of several processes as one: samples with the same name and labels
    combined, added up (counters, histograms, per-process gauges) unless `NOT_ADDED` or
    `SHARED_BACKEND` says otherwise (creation times are left out)."""
    families: dict[str, Metric] = {}
    values: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], list[float]]] = {}
    for text in texts:
        # The parser renames a counter's samples to end in _total, which Triton's names do
        # not: counters are parsed as untyped and given their type back.
        counters = set(_COUNTER.findall(text))
        for family in text_string_to_metric_families(_COUNTER.sub(r"# TYPE \1 untyped", text)):
            if family.name in counters:
                family.type = "counter"
            families.setdefault(family.name, family)
            samples = values.setdefault(family.name, {})
            for sample in family.samples:
                if not sample.name.endswith("_created"):
                    key = (sample.name, tuple(sorted(sample.labels.items())))
                    samples.setdefault(key, []).append(sample.value)
    merged = []
    for name, family in families.items():
        out = Metric(family.name, family.documentation, family.type, family.unit)
        for (sample_name, labels), seen in values[name].items():
            out.add_sample(sample_name, dict(labels), _combined(name, dict(labels), seen))
        merged.append(out)
    return render_text(merged)


def _combined(family: str, labels: dict[str, str], values: list[float]) -> float:
    how = NOT_ADDED.get(family)
    if how is None and family in SHARED_BACKEND and labels.get("cache") != "local":
        how = "max"
    if how == "min":
        return min(values)
    if how == "max":
        return max(values)
    if how == "mean":
        return sum(values) / len(values)
    return sum(values)
