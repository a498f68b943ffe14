"""A real ``redis-server`` process on a free loopback port, for tests and benchmarks.

The binary comes from PATH (Debian's ``redis-server``, which ``scripts/bootstrap`` installs
when it is missing) or from ``$REDIS_SERVER``. Nothing is persisted to disk.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path


def redis_binary() -> str:
    """The path of ``redis-server``.

    Raises:
        RuntimeError: not installed (run scripts/bootstrap).
    """
    found = os.environ.get("REDIS_SERVER") or shutil.which("redis-server")
    if not found:
        raise RuntimeError("redis-server is not installed; scripts/bootstrap installs it")
    return found


def free_port() -> int:
    """A TCP port nobody listens on right now, on 127.0.0.1."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RedisServer:
    """One ``redis-server`` process; `start`, `kill` and `start` again on the same port."""

    def __init__(
        self,
        workdir: Path,
        extra: Sequence[str] = (),
        *,
        tls: bool = False,
        host: str = "127.0.0.1",
        port: int | None = None,
        launcher: Sequence[str] = (),
        sentinel_config: Path | None = None,
    ) -> None:
        """
        Args:
            workdir: Redis's working folder (nothing is saved there unless ``extra`` says).
            extra: more ``redis-server`` arguments.
            tls: listen with TLS only (``extra`` names the certificates).
            host: the address to bind and announce.
            port: the port (default: a free one on 127.0.0.1).
            launcher: a command that runs the server (``ip netns exec <host>``).
            sentinel_config: run a Sentinel with this (writable) config file instead.
        """
        self.port = port if port is not None else free_port()
        self.host = host
        self.workdir = workdir
        self.extra = list(extra)
        self.tls = tls
        self.launcher = list(launcher)
        self.sentinel_config = sentinel_config
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        """``host:port``."""
        return f"{self.host}:{self.port}"

    @property
    def cache_config(self) -> list[str]:
        """``--cache-config`` values that point at this server."""
        return [f"redis,host={self.host}", f"redis,port={self.port}"]

    def start(self) -> None:
        """Start the server and wait (at most 10 s) until it accepts connections."""
        port = (
            ["--port", "0", "--tls-port", str(self.port)]
            if self.tls
            else ["--port", str(self.port)]
        )
        # A Sentinel's config file comes first, and it saves nothing but that file.
        first = [str(self.sentinel_config), "--sentinel"] if self.sentinel_config else []
        persistence = [] if self.sentinel_config else ["--save", "", "--appendonly", "no"]
        self.process = subprocess.Popen(
            [
                *self.launcher,
                redis_binary(),
                *first,
                *port,
                "--bind",
                self.host,
                *persistence,
                "--dir",
                str(self.workdir),
                "--loglevel",
                "warning",
                *self.extra,
            ],
            # Redis logs (start-up errors included) to stdout; little at level warning.
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                error = self.process.stdout.read().decode() if self.process.stdout else ""
                raise RuntimeError(f"redis-server exited at start: {error}")
            try:
                socket.create_connection((self.host, self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.01)
        self.stop()
        raise RuntimeError(f"redis-server did not listen on port {self.port} within 10 s")

    def fill(self, size: int = 2 << 20, over: int = 256 << 10) -> int:
        """Make this Redis full: filler keys (``filler:<n>``, outside orchestrion's prefix) of
        ``size`` bytes in all, then ``maxmemory`` set ``over`` bytes below what Redis uses,
        policy noeviction (Redis's default). From then on Redis refuses every write with OOM
        and still answers reads, until memory is freed (``CONFIG SET maxmemory 0`` lifts the
        limit). (A Redis filled exactly to its limit accepts small writes again whenever a
        client's buffers shrink: the margin keeps this one full.)

        Returns:
            how many filler keys were stored.

        Raises:
            RuntimeError: Redis still accepted a write.
        """
        import redis  # here: only this method needs a client

        block = 64 << 10
        client = redis.Redis(host=self.host, port=self.port)
        try:
            fillers = size // block
            for n in range(fillers):
                client.set(f"filler:{n}", b"x" * block)
            used = int(client.info("memory")["used_memory"])
            client.config_set("maxmemory-policy", "noeviction")
            client.config_set("maxmemory", used - over)
            try:
                client.set("filler:probe", b"x")
            except redis.exceptions.OutOfMemoryError:
                return fillers
            raise RuntimeError(f"Redis still accepts writes with maxmemory {used - over}")
        finally:
            client.close()

    def kill(self) -> None:
        """Kill the server at once (SIGKILL), as a crash would."""
        if self.process is not None:
            self.process.kill()
            self.process.wait(timeout=10)
            if self.process.stdout is not None:
                self.process.stdout.close()
            self.process = None

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 5 s)."""
        if self.process is None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=5)
        if self.process.stdout is not None:
            self.process.stdout.close()
        self.process = None
