"""`orchestrion serve` in a child process, on free loopback ports, for the client tests."""

from __future__ import annotations

import http.client
import os
import re
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

import attrs

MODELS = Path(__file__).parent / "kserve_models"
_STARTED = re.compile(r"Started (GRPCInferenceService|HTTPService|Metrics Service) at (\S+)")


@attrs.define(eq=False)
class Served:
    """A running ``orchestrion serve`` and where it listens."""

    process: subprocess.Popen[bytes]
    http: str = ""
    grpc: str = ""
    metrics: str = ""
    output: list[str] = attrs.field(factory=list)

    def stop(self, timeout: float = 60.0, how: signal.Signals = signal.SIGTERM) -> int:
        """Send ``how`` (once), then wait (bounded) for the exit; returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(how)
        try:
            code = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)
            raise
        assert self.process.stdout is not None
        self.output.extend(self.process.stdout.read().decode(errors="replace").splitlines())
        return code

    def text(self) -> str:
        """Everything the server printed so far (after `stop`: all of it)."""
        return "\n".join(self.output)


def serve_command(*flags: str, repository: Path = MODELS) -> list[str]:
    """The ``orchestrion serve`` command line for ``repository`` on free ports (0)."""
    return [
        sys.executable,
        "-m",
        "orchestrion",
        "serve",
        "--model-repository",
        str(repository),
        "--http-port",
        "0",
        "--grpc-port",
        "0",
        "--metrics-port",
        "0",
        *flags,
    ]


def start_server(
    *flags: str,
    repository: Path = MODELS,
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
) -> Served:
    """Start ``orchestrion serve`` on free ports and wait until it reports every endpoint."""
    command = serve_command(*flags, repository=repository)
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, "COLUMNS": "200", **(env or {})},
    )
    served = Served(process)
    wanted = {"HTTPService", "GRPCInferenceService", "Metrics Service"}
    for flag, name in (
        ("--allow-http=false", "HTTPService"),
        ("--allow-grpc=false", "GRPCInferenceService"),
        ("--allow-metrics=false", "Metrics Service"),
    ):
        if flag in flags:
            wanted.discard(name)
    assert process.stdout is not None
    selector = selectors.DefaultSelector()
    selector.register(process.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    pending = b""
    try:
        while wanted:
            if time.monotonic() > deadline:
                raise TimeoutError(f"server did not start: {served.text()}")
            if not selector.select(timeout=1.0):
                continue
            chunk = os.read(process.stdout.fileno(), 65536)
            if not chunk:
                raise RuntimeError(f"server exited ({process.wait(10)}): {served.text()}")
            *lines, pending = (pending + chunk).split(b"\n")
            for raw in lines:
                line = raw.decode(errors="replace")
                served.output.append(line)
                match = _STARTED.search(line)
                if match is not None:
                    kind, address = match.groups()
                    wanted.discard(kind)
                    field = {"HTTPService": "http", "GRPCInferenceService": "grpc"}.get(
                        kind, "metrics"
                    )
                    setattr(served, field, address)
    except BaseException:
        process.kill()
        process.wait(10)
        raise
    finally:
        selector.close()
    return served


def post(
    address: str, path: str, body: bytes, headers: dict[str, str] | None = None
) -> tuple[int, bytes]:
    """One HTTP POST on a fresh connection: the status and the body of the answer."""
    connection = http.client.HTTPConnection(address, timeout=30)
    try:
        connection.request("POST", path, body, headers or {})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def get(address: str, path: str) -> tuple[int, bytes]:
    """One HTTP GET on a fresh connection: the status and the body of the answer."""
    connection = http.client.HTTPConnection(address, timeout=30)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def pending(served: Served, model: str) -> float:
    """``nv_inference_pending_request_count`` of ``model``, from the metrics endpoint."""
    _, body = get(served.metrics, "/metrics")
    for line in body.decode().splitlines():
        if line.startswith(f'nv_inference_pending_request_count{{model="{model}"'):
            return float(line.split()[-1])
    return 0.0
