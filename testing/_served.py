"""`orchestrion serve` in a child process, on free loopback ports, for the client tests.

How this works: the child prints a ``Started ... at HOST:PORT`` line per endpoint; a thread
reads its output (stdout and stderr) into `Served.output` from the start to its exit, so a
verbose server never blocks on a full pipe and the test can look for a line at any time.
"""

from __future__ import annotations

import http.client
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import attrs

from ._front_ends import frontend_under_test

_STARTED = re.compile(r"Started (GRPCInferenceService|HTTPService|Metrics Service) at (\S+)")


@attrs.define(eq=False)
class Served:
    """A running ``orchestrion serve`` and where it listens."""

    process: subprocess.Popen[bytes]
    http: str = ""
    grpc: str = ""
    metrics: str = ""
    output: list[str] = attrs.field(factory=list)
    """The lines the server printed so far (a thread appends them as they come)."""
    reader: threading.Thread | None = None
    """The thread reading the output; it ends when the server exits."""

    def stop(self, timeout: float = 60.0, how: signal.Signals | None = signal.SIGTERM) -> int:
        """Send ``how`` (once; None: the caller signalled already), then wait (bounded) for
        the exit and the rest of the output; returns the exit code.

        Raises:
            subprocess.TimeoutExpired: no exit within ``timeout`` (the server is then killed).
        """
        if how is not None and self.process.poll() is None:
            self.process.send_signal(how)
        try:
            code = self.process.wait(timeout)
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait(10)
            if self.reader is not None:
                self.reader.join(10)
        if self.reader is None:  # nobody followed the output: read the rest now
            assert self.process.stdout is not None
            self.output.extend(self.process.stdout.read().decode(errors="replace").splitlines())
        return code

    def text(self) -> str:
        """Everything the server printed so far (after `stop`: all of it)."""
        return "\n".join(self.output)


def serve_command(*flags: str, repository: Path) -> list[str]:
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
        "--frontend",
        frontend_under_test(),  # before ``flags``: a test's own choice wins
        *flags,
    ]


def follow_output(served: Served) -> threading.Thread:
    """Start the thread that reads the server's output into ``served.output`` until it exits,
    and fills in ``served.http``, ``grpc`` and ``metrics`` from its ``Started`` lines."""
    stdout = served.process.stdout
    assert stdout is not None
    fd = stdout.fileno()

    def read() -> None:
        rest = b""
        while chunk := os.read(fd, 65536):
            *lines, rest = (rest + chunk).split(b"\n")
            for raw in lines:
                line = raw.decode(errors="replace")
                served.output.append(line)
                if (match := _STARTED.search(line)) is not None:
                    kind, address = match.groups()
                    field = {"HTTPService": "http", "GRPCInferenceService": "grpc"}
                    setattr(served, field.get(kind, "metrics"), address)
        if rest:
            served.output.append(rest.decode(errors="replace"))

    served.reader = threading.Thread(target=read, daemon=True)
    served.reader.start()
    return served.reader


def start_server(
    *flags: str,
    repository: Path,
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
    files: int | None = None,
    launcher: Sequence[str] = (),
) -> Served:
    """Start ``orchestrion serve`` on free ports and wait until it reports every endpoint.

    Args:
        flags: more command-line flags.
        repository: the model repository.
        timeout: seconds the start may take.
        env: variables added to this process's environment.
        files: the child's limit of open descriptors (RLIMIT_NOFILE), if given.
        launcher: a command that runs the server (``ip netns exec <host>``: another host).

    Raises:
        RuntimeError: the server exited before reporting every endpoint.
        TimeoutError: it did not report them within ``timeout``.
    """

    def limit() -> None:
        if files is not None:
            import resource  # POSIX only, and only where a limit is asked for

            resource.setrlimit(resource.RLIMIT_NOFILE, (files, files))

    process = subprocess.Popen(
        [*launcher, *serve_command(*flags, repository=repository)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, "COLUMNS": "200", **(env or {})},
        preexec_fn=limit if files is not None else None,
    )
    served = Served(process)
    wanted = {"http", "grpc", "metrics"}
    for flag, field in (
        ("--allow-http=false", "http"),
        ("--allow-grpc=false", "grpc"),
        ("--allow-metrics=false", "metrics"),
    ):
        if flag in flags:
            wanted.discard(field)
    reader = follow_output(served)
    deadline = time.monotonic() + timeout
    try:
        while not all(getattr(served, field) for field in wanted):
            if process.poll() is not None:
                reader.join(10)
                if all(getattr(served, field) for field in wanted):
                    break
                raise RuntimeError(f"server exited ({process.returncode}): {served.text()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"server did not start: {served.text()}")
            time.sleep(0.02)
    except BaseException:
        process.kill()
        process.wait(10)
        reader.join(10)
        raise
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


def rss_kib(pid: int | None = None) -> int:
    """The resident memory (VmRSS, in KiB) of process ``pid`` (default: this process).

    Raises:
        RuntimeError: no such process, or no VmRSS line (not Linux).
    """
    path = Path(f"/proc/{pid if pid is not None else 'self'}/status")
    try:
        status = path.read_text()
    except OSError as exc:
        raise RuntimeError(f"cannot read {path}: {exc}") from exc
    match = re.search(r"VmRSS:\s+(\d+) kB", status)
    if match is None:
        raise RuntimeError(f"no VmRSS in {path}")
    return int(match.group(1))
