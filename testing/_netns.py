"""Hosts on one machine: Linux network namespaces on one virtual LAN, for tests that need
several machines (replicas behind a load balancer, a Redis Cluster elsewhere).

How this works (iproute2, as root): one namespace holds a bridge, the LAN's switch; each host
is a namespace with its own loopback, ports and an ``eth0`` (one end of a veth pair whose
other end is plugged into the bridge), at ``198.18.<n>.<i>/24``: the range set aside for
benchmarking networks (RFC 2544), so no real address is ever used. This process's own
namespace is plugged in too (at ``.1``), so the test itself, as a client, reaches every host.
A process runs on a host through ``ip netns exec`` (`Hosts.launcher`). `Hosts.close` deletes
the namespaces, which removes every link; it runs on any failure of `open`, and a
``with`` block calls it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Sequence
from types import TracebackType


def netns_unavailable() -> str | None:
    """Why hosts cannot be made here (None: they can): not root, no ``ip``, or a kernel or
    sandbox that refuses network namespaces."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    if shutil.which("ip") is None:
        return "iproute2's ip is not installed (scripts/bootstrap --test installs it)"
    probe = f"orch-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str, namespace: str | None = None) -> None:
    command = ["ip", *(["-n", namespace] if namespace else []), *args]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)}: {done.stderr.strip()}")


class Hosts:
    """Named hosts on one LAN; ``with Hosts([...]) as hosts:`` makes and removes them."""

    def __init__(self, names: Sequence[str], subnet: int | None = None) -> None:
        """
        Args:
            names: the hosts' names (their namespaces are ``o<pid>-<name>``).
            subnet: the third byte of ``198.18.<subnet>.0/24`` (default: from the pid, so
                that two runs at once do not share a LAN).
        """
        self.tag = f"o{os.getpid() % 100000}"
        self.subnet = subnet if subnet is not None else os.getpid() % 250 + 1
        self.names = list(names)
        self.namespaces: list[str] = []

    def namespace(self, host: str) -> str:
        """The namespace of ``host``."""
        return f"{self.tag}-{host}"

    def address(self, host: str) -> str:
        """The address of ``host`` on the LAN."""
        return f"198.18.{self.subnet}.{self.names.index(host) + 2}"

    @property
    def gateway(self) -> str:
        """This process's own address on the LAN."""
        return f"198.18.{self.subnet}.1"

    def launcher(self, host: str) -> list[str]:
        """The command prefix that runs a program on ``host``."""
        return ["ip", "netns", "exec", self.namespace(host)]

    def open(self) -> Hosts:
        """Make the switch, the hosts and their links.

        Raises:
            RuntimeError: an ``ip`` command failed (everything made so far is removed).
        """
        try:
            switch = self._add_namespace("switch")
            _ip("link", "add", "br0", "type", "bridge", namespace=switch)
            _ip("link", "set", "br0", "up", namespace=switch)
            self._plug(None, f"{self.tag}h", self.gateway)
            for host in self.names:
                namespace = self._add_namespace(host)
                self._plug(namespace, f"{self.tag}{self.names.index(host)}", self.address(host))
        except BaseException:
            self.close()
            raise
        return self

    def _add_namespace(self, host: str) -> str:
        namespace = self.namespace(host)
        _ip("netns", "add", namespace)
        self.namespaces.append(namespace)
        _ip("link", "set", "lo", "up", namespace=namespace)
        return namespace

    def _plug(self, namespace: str | None, name: str, address: str) -> None:
        """A veth pair: ``name`` (eth0 in ``namespace``, or ``name`` here) and its peer in
        the switch's bridge."""
        switch = self.namespace("switch")
        _ip("link", "add", name, "type", "veth", "peer", "name", f"{name}s")
        _ip("link", "set", f"{name}s", "netns", switch)
        _ip("link", "set", f"{name}s", "master", "br0", namespace=switch)
        _ip("link", "set", f"{name}s", "up", namespace=switch)
        inside = name
        if namespace is not None:
            _ip("link", "set", name, "netns", namespace)
            _ip("link", "set", name, "name", "eth0", namespace=namespace)
            inside = "eth0"
        _ip("addr", "add", f"{address}/24", "dev", inside, namespace=namespace)
        _ip("link", "set", inside, "up", namespace=namespace)

    def close(self) -> None:
        """Delete every namespace made (their links go with them); the link of this
        process's namespace goes with its peer."""
        for namespace in reversed(self.namespaces):
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
        self.namespaces.clear()
        subprocess.run(["ip", "link", "del", f"{self.tag}h"], capture_output=True)

    def __enter__(self) -> Hosts:
        return self.open()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
