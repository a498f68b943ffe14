"""orchestrion replicas on several hosts behind HAProxy, sharing a Redis Cluster cache: the
cross-host test and ``bench/replicas.py`` build the same site.

How this works: `Hosts` makes the hosts (``lb``, ``app1``..``appN``, ``redis1``,
``redis2``); a 3-primary, 3-replica Redis Cluster runs on the two Redis hosts (each primary's
replica on the other host); each app host runs ``orchestrion serve`` (the same command as
the container images) on a small repository with one cached model; HAProxy on ``lb`` takes
HTTP on 8000 and gRPC (HTTP/2) on 8001, checks each replica's ``/v2/health/ready`` every
200 ms, and retries a request whose connection failed or whose server closed it unanswered
(inference is idempotent) on another replica. `ReplicaSite.close` stops everything it
started and removes the hosts, whatever failed.
"""

from __future__ import annotations

import csv
import io
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from ._netns import Hosts
from ._redis_cluster import RedisClusterServers
from ._served import Served, get, start_server

MODEL = "scaled"
"""Y = 2 X + 1 over 16 FP32 values, cached, after waiting ``WAIT_MS`` (a model that holds
its device for that long: one request at a time per replica)."""
WAIT_MS = 5

_CONFIG = f"""name: "{MODEL}"
max_batch_size: 0
response_cache {{ enable: true }}
instance_group {{ count: 1 }}
input [ {{ name: "X" data_type: TYPE_FP32 dims: [ 16 ] }} ]
output [ {{ name: "Y" data_type: TYPE_FP32 dims: [ 16 ] }} ]
"""
_CODE = f"""import trio

JIT = False


async def execute(X):
    await trio.sleep({WAIT_MS / 1000})
    return {{"Y": X * 2.0 + 1.0}}
"""


def write_repository(folder: Path) -> Path:
    """The replicas' model repository (one cached model), written into ``folder``."""
    model = folder / MODEL
    (model / "1").mkdir(parents=True, exist_ok=True)
    (model / "config.pbtxt").write_text(_CONFIG)
    (model / "1" / "model.py").write_text(_CODE)
    return folder


def haproxy_unavailable() -> str | None:
    """Why HAProxy cannot run here (None: it can)."""
    if shutil.which("haproxy") is None:
        return "HAProxy is not installed (scripts/bootstrap --test installs Debian's haproxy)"
    return None


def _haproxy_config(site: ReplicaSite) -> str:
    servers_http = []
    servers_grpc = []
    for i, host in enumerate(site.app_hosts, 1):
        address = site.hosts.address(host)
        servers_http.append(f"    server app{i} {address}:8000 check")
        servers_grpc.append(
            f"    server app{i} {address}:8001 proto h2 check port 8000 check-proto h1"
        )
    return "\n".join(
        [
            "global",
            "    maxconn 4096",
            f"    stats socket {site.stats_socket} mode 600 level admin",
            "defaults",
            "    mode http",
            "    timeout connect 1s",
            "    timeout client 60s",
            "    timeout server 60s",
            # A request whose connection failed, or whose server closed it unanswered, goes
            # to another replica (inference is idempotent); up to 3 times.
            "    retries 3",
            "    option redispatch 1",
            "    retry-on conn-failure empty-response response-timeout",
            "    option httpchk GET /v2/health/ready",
            "    http-check expect status 200",
            "    default-server inter 200ms fall 2 rise 2",
            "frontend http",
            f"    bind {site.hosts.address('lb')}:8000",
            "    default_backend replicas_http",
            "frontend grpc",
            f"    bind {site.hosts.address('lb')}:8001 proto h2",
            "    default_backend replicas_grpc",
            "backend replicas_http",
            "    balance roundrobin",
            *servers_http,
            "backend replicas_grpc",
            "    balance roundrobin",
            *servers_grpc,
            "",
        ]
    )


class ReplicaSite:
    """The hosts, the Redis Cluster, the replicas and HAProxy, started with `open`."""

    def __init__(self, workdir: Path, replicas: int = 3) -> None:
        self.workdir = workdir
        self.app_hosts = [f"app{i}" for i in range(1, replicas + 1)]
        self.hosts = Hosts(["lb", *self.app_hosts, "redis1", "redis2"])
        self.repository = write_repository(workdir / "models")
        self.stats_socket = workdir / "haproxy.sock"
        self.redis: RedisClusterServers | None = None
        self.replicas: dict[str, Served | None] = dict.fromkeys(self.app_hosts)
        self.haproxy: subprocess.Popen[bytes] | None = None

    @property
    def http(self) -> str:
        """The load balancer's HTTP address (host:port)."""
        return f"{self.hosts.address('lb')}:8000"

    @property
    def grpc(self) -> str:
        """The load balancer's gRPC address (host:port)."""
        return f"{self.hosts.address('lb')}:8001"

    def replica_http(self, host: str) -> str:
        """One replica's own HTTP address, bypassing the load balancer."""
        return f"{self.hosts.address(host)}:8000"

    def open(self) -> ReplicaSite:
        """Build the site; on any failure, remove what was built."""
        try:
            self.hosts.open()
            self.redis = RedisClusterServers(
                self.workdir / "redis",
                hosts=[self.hosts.address("redis1"), self.hosts.address("redis2")],
                launchers=[self.hosts.launcher("redis1"), self.hosts.launcher("redis2")],
                ports=[7000 + i for i in range(6)],
                node_timeout_ms=2000,
            )
            self.redis.start(timeout=120)
            for host in self.app_hosts:
                self.start_replica(host)
            self._start_haproxy()
            self.wait_balanced(set(self.app_hosts))
        except BaseException:
            self.close()
            raise
        return self

    def start_replica(self, host: str, timeout: float = 180.0) -> Served:
        """Start (or restart) ``orchestrion serve`` on ``host`` and wait until it is ready."""
        assert self.redis is not None
        served = start_server(
            *(f"--cache-config={flag}" for flag in self.redis.cache_config),
            f"--host={self.hosts.address(host)}",
            "--http-port=8000",
            "--grpc-port=8001",
            "--metrics-port=8002",
            "--exit-timeout-secs=10",
            repository=self.repository,
            timeout=timeout,
            launcher=self.hosts.launcher(host),
        )
        self.replicas[host] = served
        deadline = time.monotonic() + timeout
        while get(served.http, "/v2/health/ready")[0] != 200:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{host} never became ready: {served.text()}")
            time.sleep(0.05)
        if self.haproxy is not None:  # back in rotation, if drained (health checks decide)
            index = self.app_hosts.index(host) + 1
            for backend in ("replicas_http", "replicas_grpc"):
                self._command(f"set server {backend}/app{index} state ready")
        return served

    def kill_replica(self, host: str, how: signal.Signals) -> int:
        """Stop ``host``'s replica with ``how`` (SIGKILL, or SIGTERM and its graceful stop);
        returns its exit code."""
        served = self.replicas[host]
        assert served is not None
        self.replicas[host] = None
        return served.stop(timeout=60, how=how)

    def drain_replica(self, host: str, timeout: float = 30.0) -> None:
        """Take ``host`` out of HAProxy's rotation before it is stopped, as a rolling deploy
        does (Kubernetes: the preStop pause while the endpoints drop the pod): HAProxy sends
        it no new request; returns once none it sent is still unanswered. `start_replica`
        puts it back."""
        index = self.app_hosts.index(host) + 1
        for backend in ("replicas_http", "replicas_grpc"):
            self._command(f"set server {backend}/app{index} state drain")
        deadline = time.monotonic() + timeout
        while any(
            row["svname"] == f"app{index}" and int(row["scur"] or 0) > 0 for row in self.stats()
        ):
            if time.monotonic() > deadline:
                raise TimeoutError(f"HAProxy still has requests on {host} after {timeout} s")
            time.sleep(0.01)

    def _command(self, command: str) -> str:
        """One command on HAProxy's admin socket; its answer."""
        with socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(5)
            sock.connect(str(self.stats_socket))
            sock.sendall(command.encode() + b"\n")
            chunks = []
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        return b"".join(chunks).decode()

    def _start_haproxy(self) -> None:
        config = self.workdir / "haproxy.cfg"
        config.write_text(_haproxy_config(self))
        self.haproxy = subprocess.Popen(
            [*self.hosts.launcher("lb"), "haproxy", "-db", "-f", str(config)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )

    def stats(self) -> list[dict[str, str]]:
        """HAProxy's ``show stat``: a row per frontend, server and backend."""
        text = self._command("show stat").lstrip("# ")
        return list(csv.DictReader(io.StringIO(text)))

    def up(self) -> dict[str, set[str]]:
        """The servers HAProxy sends to now, per backend."""
        found: dict[str, set[str]] = {}
        for row in self.stats():
            if row["svname"] not in ("FRONTEND", "BACKEND") and row["status"] == "UP":
                found.setdefault(row["pxname"], set()).add(row["svname"])
        return found

    def wait_balanced(self, hosts: set[str], timeout: float = 60.0) -> None:
        """Wait until HAProxy sends to exactly ``hosts``, in both backends."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                up = self.up()
            except OSError:
                up = {}
            if up.get("replicas_http") == hosts and up.get("replicas_grpc") == hosts:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"HAProxy sends to {up}, not {sorted(hosts)}")
            time.sleep(0.05)

    def retries(self) -> dict[str, int]:
        """Requests HAProxy retried (``wretr``) and sent to another replica (``wredis``),
        and connection and response errors it met, over both backends."""
        totals = {"retried": 0, "redispatched": 0, "connect_errors": 0, "response_errors": 0}
        for row in self.stats():
            if row["svname"] == "BACKEND":
                totals["retried"] += int(row["wretr"] or 0)
                totals["redispatched"] += int(row["wredis"] or 0)
                totals["connect_errors"] += int(row["econ"] or 0)
                totals["response_errors"] += int(row["eresp"] or 0)
        return totals

    def close(self) -> None:
        """Stop HAProxy, the replicas and Redis, and remove the hosts."""
        if self.haproxy is not None:
            self.haproxy.kill()
            self.haproxy.wait(10)
            if self.haproxy.stdout is not None:
                self.haproxy.stdout.close()
            self.haproxy = None
        for host, served in list(self.replicas.items()):
            if served is not None:
                served.stop(timeout=30, how=signal.SIGKILL)
                self.replicas[host] = None
        if self.redis is not None:
            self.redis.stop()
            self.redis = None
        self.hosts.close()
        if self.stats_socket.exists():
            os.unlink(self.stats_socket)
