"""Real Redis Cluster and Sentinel setups of ``redis-server`` processes, for tests and
benchmarks: a cluster of primaries with one replica each, and a primary with a replica
watched by Sentinels.

How this works: each node is a `RedisServer` (so it can be killed and started again on its
port). The cluster is formed by hand, as ``redis-cli --cluster create`` does it: each node
gets its own config epoch and each primary a range of the 16384 slots, the nodes MEET, then
each replica REPLICATEs its primary; `RedisClusterServers.start` returns once every node
reports ``cluster_state:ok`` and every replica's link is up. Nothing is persisted but each
node's ``nodes.conf``, which lets a killed node rejoin when started again.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import redis

from ._redis import RedisServer, free_port

SLOTS = 16384


def _wait(what: str, ready: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if ready():
                return
        except (redis.exceptions.RedisError, OSError):
            pass
        time.sleep(0.05)
    raise RuntimeError(f"redis: {what} within {timeout:.0f} s")


def _client(node: RedisServer) -> redis.Redis:
    return redis.Redis(host=node.host, port=node.port, socket_timeout=5)


def _info(node: RedisServer, section: str) -> dict[str, object]:
    with _client(node) as client:
        return dict(client.info(section))


def cluster_port() -> int:
    """A free port on 127.0.0.1 whose cluster bus port (10000 above) is free too."""
    for _ in range(100):
        port = free_port()
        if port + 10000 > 65535:
            continue
        with socket.socket() as bus:
            try:
                bus.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port with a free cluster bus port found")


def _cluster_ok(node: RedisServer) -> bool:
    with _client(node) as client:
        return bool(client.execute_command("CLUSTER INFO").get("cluster_state") == "ok")


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class RedisClusterServers:
    """A Redis Cluster of ``primaries`` primaries with ``replicas`` replicas each."""

    def __init__(
        self,
        workdir: Path,
        *,
        primaries: int = 3,
        replicas: int = 1,
        node_timeout_ms: int = 1500,
        hosts: Sequence[str] = ("127.0.0.1",),
        launchers: Sequence[Sequence[str]] = ((),),
        ports: Sequence[int] | None = None,
    ) -> None:
        """
        Args:
            workdir: a folder for the nodes' ``nodes.conf`` files.
            primaries: how many primaries share the slots.
            replicas: replicas per primary.
            node_timeout_ms: ``cluster-node-timeout``: how long a node may be silent before
                the others fail it over (a failover takes about this plus one second).
            hosts: addresses the nodes bind, in turn (node ``i`` on ``hosts[i % len]``).
            launchers: commands that run the nodes, in turn (``ip netns exec <host>``).
            ports: the nodes' ports (default: free ports on 127.0.0.1).
        """
        count = primaries * (1 + replicas)
        self.primaries = primaries
        self.nodes: list[RedisServer] = []
        for i in range(count):
            folder = workdir / f"node-{i}"
            folder.mkdir(parents=True, exist_ok=True)
            extra = [
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                str(folder / "nodes.conf"),
                "--cluster-node-timeout",
                str(node_timeout_ms),
                # A replica fails over however long it has been out of touch (tests kill
                # primaries right after writing).
                "--cluster-replica-validity-factor",
                "0",
            ]
            host = hosts[i % len(hosts)]
            if not host.startswith("127."):
                # Reached from other (test) hosts, with no password: Redis's protected mode
                # would refuse them.
                extra += ["--protected-mode", "no"]
            self.nodes.append(
                RedisServer(
                    folder,
                    extra,
                    host=host,
                    port=cluster_port() if ports is None else ports[i],
                    launcher=launchers[i % len(launchers)],
                )
            )

    @property
    def cache_config(self) -> list[str]:
        """``--cache-config`` values for this cluster (the first node as the seed)."""
        seed = self.nodes[0]
        return [f"redis,host={seed.host}", f"redis,port={seed.port}", "redis,cluster=true"]

    def node_id(self, node: RedisServer) -> str:
        """The node's cluster id."""
        with _client(node) as client:
            return str(client.execute_command("CLUSTER MYID").decode())

    def start(self, timeout: float = 60.0) -> None:
        """Start every node and form the cluster; wait until it serves every slot.

        Raises:
            RuntimeError: a node did not start, or the cluster did not form in time.
        """
        try:
            for node in self.nodes:
                node.start()
            self._form(timeout)
        except BaseException:
            self.stop()
            raise

    def _form(self, timeout: float) -> None:
        primaries, replicas = self.nodes[: self.primaries], self.nodes[self.primaries :]
        step = SLOTS // self.primaries
        for i, node in enumerate(self.nodes):
            with _client(node) as client:
                client.execute_command("CLUSTER SET-CONFIG-EPOCH", i + 1)
                if i < self.primaries:
                    last = SLOTS - 1 if i == self.primaries - 1 else (i + 1) * step - 1
                    client.execute_command("CLUSTER ADDSLOTSRANGE", i * step, last)
        first = self.nodes[0]
        for node in self.nodes[1:]:
            with _client(node) as client:
                client.execute_command("CLUSTER MEET", first.host, first.port)

        def everyone_met() -> bool:
            for node in self.nodes:
                with _client(node) as client:
                    known = client.execute_command("CLUSTER NODES")
                if len(known) < len(self.nodes) or any(
                    "handshake" in n["flags"] or not n["connected"] for n in known.values()
                ):
                    return False
            return True

        _wait("the nodes did not all meet", everyone_met, timeout)
        for i, replica in enumerate(replicas):
            primary = primaries[i % self.primaries]
            with _client(replica) as client:
                client.execute_command("CLUSTER REPLICATE", self.node_id(primary))
        self.wait_ready(timeout)

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Wait until every running node says ``cluster_state:ok`` and every running
        replica's link to its primary is up."""

        def ready() -> bool:
            for node in self.running():
                if not _cluster_ok(node):
                    return False
                replication = _info(node, "replication")
                if replication.get("role") == "slave" and (
                    replication.get("master_link_status") != "up"
                ):
                    return False
            return True

        _wait("the cluster is not ready", ready, timeout)

    def running(self) -> list[RedisServer]:
        """The nodes whose process runs."""
        return [n for n in self.nodes if n.process is not None]

    def primary_nodes(self) -> list[RedisServer]:
        """The running nodes that are primaries now."""
        return [n for n in self.running() if _info(n, "replication").get("role") == "master"]

    def wait_failover(self, killed: RedisServer, timeout: float = 60.0) -> RedisServer:
        """Wait until a replica has taken the slots of ``killed`` (a stopped primary) and
        the cluster is ok again.

        Returns:
            the promoted node.
        """
        promoted: list[RedisServer] = []

        def taken() -> bool:
            live = self.running()
            with _client(live[0]) as client:
                slots = client.execute_command("CLUSTER SLOTS")
            owners = {(_text(s[2][0]), int(s[2][1])) for s in slots}
            if (killed.host, killed.port) in owners:
                return False
            if not all(_cluster_ok(node) for node in live):
                return False
            promoted[:] = [
                n for n in self.primary_nodes() if n not in self.nodes[: self.primaries]
            ] or [n for n in live if (n.host, n.port) in owners]
            return bool(promoted)

        _wait(f"no replica took the slots of {killed.address}", taken, timeout)
        return promoted[0]

    def stop(self) -> None:
        """Stop every node."""
        for node in self.nodes:
            node.stop()


class RedisSentinels:
    """A primary and a replica watched by ``count`` Sentinels (quorum: a majority)."""

    def __init__(
        self,
        workdir: Path,
        *,
        count: int = 3,
        down_after_ms: int = 1000,
        master_name: str = "cache",
    ) -> None:
        self.workdir = workdir
        self.master_name = master_name
        self.down_after_ms = down_after_ms
        for role in ("primary", "replica"):
            (workdir / role).mkdir(parents=True, exist_ok=True)
        self.primary = RedisServer(workdir / "primary")
        self.replica = RedisServer(workdir / "replica")
        self.sentinels: list[RedisServer] = []
        for i in range(count):
            folder = workdir / f"sentinel-{i}"
            folder.mkdir(parents=True, exist_ok=True)
            self.sentinels.append(RedisServer(folder))
        self.quorum = count // 2 + 1

    @property
    def cache_config(self) -> list[str]:
        """``--cache-config`` values that reach the primary through the Sentinels."""
        where = ",".join(s.address for s in self.sentinels)
        return [f"redis,sentinels={where}", f"redis,sentinel_master={self.master_name}"]

    def start(self, timeout: float = 60.0) -> None:
        """Start the primary, its replica and the Sentinels; wait until every Sentinel
        knows the replica and the other Sentinels."""
        try:
            self.primary.start()
            self.replica.extra = ["--replicaof", self.primary.host, str(self.primary.port)]
            self.replica.start()
            for sentinel in self.sentinels:
                conf = sentinel.workdir / "sentinel.conf"
                conf.write_text(
                    f"sentinel monitor {self.master_name} {self.primary.host} "
                    f"{self.primary.port} {self.quorum}\n"
                    f"sentinel down-after-milliseconds {self.master_name} "
                    f"{self.down_after_ms}\n"
                    f"sentinel failover-timeout {self.master_name} 10000\n"
                )
                sentinel.sentinel_config = conf
                sentinel.start()
            _wait("the Sentinels did not find each other", self._known, timeout)
        except BaseException:
            self.stop()
            raise

    def _known(self) -> bool:
        for sentinel in self.sentinels:
            with _client(sentinel) as client:
                master = client.execute_command("SENTINEL MASTER", self.master_name)
            if int(master["num-slaves"]) < 1:
                return False
            if int(master["num-other-sentinels"]) < len(self.sentinels) - 1:
                return False
        return True

    def master_address(self) -> tuple[str, int]:
        """Where the Sentinels say the primary is now."""
        with _client(self.sentinels[0]) as client:
            host, port = client.execute_command(
                "SENTINEL GET-MASTER-ADDR-BY-NAME", self.master_name
            )
        return _text(host), int(port)

    def wait_failover(self, killed: RedisServer, timeout: float = 60.0) -> None:
        """Wait until the Sentinels name another primary than ``killed``, and it is one."""

        def moved() -> bool:
            host, port = self.master_address()
            if (host, port) == (killed.host, killed.port):
                return False
            node = self.replica if port == self.replica.port else self.primary
            return _info(node, "replication").get("role") == "master"

        _wait(f"the Sentinels did not replace {killed.address}", moved, timeout)

    def stop(self) -> None:
        """Stop the Sentinels and both servers."""
        for server in (*self.sentinels, self.replica, self.primary):
            server.stop()
