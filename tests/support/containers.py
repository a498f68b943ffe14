"""A Docker daemon of the caller's own, a base image made with debootstrap, and the shipped
images (``deploy/container``) built on it: used by ``tests/deploy/test_container.py`` and
``bench/container.py``.

The daemon (Debian's ``docker.io``) is started as root with its own socket, no iptables rules,
and a bridge of its own that the caller creates and deletes: each container has its own
network namespace and address on that bridge (as a pod has), reachable from this machine
and reaching it at the bridge's address, and nothing else. Builds use the host's network
(``--network host``): the package registries. Its images stay in a data root
under ``~/.cache/orchestrion`` between runs (locked: a second run at the same time gets a
temporary one), so the base image and unchanged build steps are made once per machine.

The base image stands in for the official ``python:3.11-slim-bookworm`` (no registry of
images is reachable here): Debian bookworm, made by ``debootstrap --variant=minbase``, with
its Python 3.11 and venv module. The build trusts this machine's CA bundle (the one
``SSL_CERT_FILE`` names) through a BuildKit secret, never through the Dockerfile.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import attrs

REPOSITORY = Path(__file__).resolve().parents[2]
BASE_IMAGE = "orchestrion-test/python:3.11-bookworm"
DEBIAN_MIRROR = os.environ.get("ORCHESTRION_TEST_DEBIAN_MIRROR", "http://deb.debian.org/debian")
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "orchestrion"
KEEP_BUILD_CACHE = "4GB"
"""The build cache kept between runs: about two builds' worth of the CPU image's steps."""


class DockerUnavailable(Exception):
    """No Docker daemon can be started here (the message says why)."""


@attrs.frozen
class Docker:
    """A client bound to one daemon."""

    client: str
    socket: Path
    #: The bridge's own address: where a container reaches this machine.
    gateway: str

    def env(self) -> dict[str, str]:
        """The environment for this daemon's client, with BuildKit on."""
        return {**os.environ, "DOCKER_HOST": f"unix://{self.socket}", "DOCKER_BUILDKIT": "1"}

    def run(
        self, *args: str, timeout: float = 60, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        """``docker ARGS``; raises with the output when it fails and ``check`` is set."""
        done = subprocess.run(
            [self.client, *args],
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if check and done.returncode != 0:
            raise RuntimeError(
                f"docker {' '.join(args[:3])} failed ({done.returncode}):\n"
                f"{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
            )
        return done


def _client() -> str:
    # Debian's docker.io client drives BuildKit itself; a newer client without its buildx
    # plugin cannot build with BuildKit at all.
    for candidate in ("/usr/bin/docker", shutil.which("docker")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise DockerUnavailable("no docker client (Debian's docker.io package)")


def unavailable_reason() -> str | None:
    """Why no daemon can be started here, or None when one can be tried."""
    if os.geteuid() != 0:
        return "starting a Docker daemon needs root"
    for program in ("dockerd", "debootstrap"):
        if shutil.which(program) is None:
            return f"no {program} (scripts/bootstrap --test installs docker.io and debootstrap)"
    try:
        _client()
    except DockerUnavailable as exc:
        return str(exc)
    return None


@contextlib.contextmanager
def _data_root() -> Iterator[Path]:
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / "docker.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            # Another run holds the cached one: this run builds from nothing.
            with tempfile.TemporaryDirectory(prefix="orchestrion-docker-") as scratch:
                yield Path(scratch)
            return
        yield CACHE / "docker"


@contextlib.contextmanager
def docker_daemon(start_timeout: float = 60) -> Iterator[Docker]:
    """Starts ``dockerd`` (root), yields a client bound to it, and stops it after.

    Raises:
        DockerUnavailable: what it needs is missing here (not root, no ``dockerd``, no
            right to make a bridge): a reason to skip.
        RuntimeError: the daemon was started and failed (its log's end in the message).
    """
    reason = unavailable_reason()
    if reason is not None:
        raise DockerUnavailable(reason)
    # A unix socket's path is short (108 bytes): the run state lives in a short temporary path.
    with (
        _data_root() as data,
        tempfile.TemporaryDirectory(prefix="odk-", dir="/tmp") as run,
        _bridge() as (bridge, gateway),
    ):
        docker = Docker(_client(), Path(run) / "docker.sock", gateway)
        # No settings of the machine's own (/etc/docker/daemon.json), no host-wide
        # forwarding, and a containerd namespace of its own where it shares a containerd.
        (Path(run) / "daemon.json").write_text("{}")
        namespace = f"orchestrion-test-{os.getpid()}"
        command = [
            "dockerd",
            f"--config-file={run}/daemon.json",
            f"--data-root={data}",
            f"--exec-root={run}/exec",
            f"--pidfile={run}/dockerd.pid",
            f"--host=unix://{docker.socket}",
            f"--bridge={bridge}",
            "--iptables=false",
            "--ip6tables=false",
            "--ip-forward=false",
            f"--containerd-namespace={namespace}",
            f"--containerd-plugins-namespace={namespace}-plugins",
        ]
        with open(Path(run) / "dockerd.log", "wb") as log:
            process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
            try:
                _wait_for_daemon(docker, process, Path(run) / "dockerd.log", start_timeout)
                yield docker
            finally:
                _stop(process)


def _stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM to dockerd (it stops its containers and its containerd); if it does not
    exit within 30 s, SIGKILL to its whole process group (the containerd it started too)."""
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)


@contextlib.contextmanager
def _bridge() -> Iterator[tuple[str, str]]:
    """A Linux bridge with a /24 of 10.213.0.0/16 that no interface here uses yet, deleted
    after."""
    used = subprocess.run(
        ["ip", "-o", "-4", "addr"], capture_output=True, text=True, check=True, timeout=10
    ).stdout
    name = f"orch{os.getpid() % 100000}"
    third = next((n for n in range(7, 255) if f" 10.213.{n}." not in used), None)
    if third is None:
        raise DockerUnavailable("no free /24 in 10.213.0.0/16 for the daemon's bridge")
    gateway = f"10.213.{third}.1"
    try:
        for command in (
            ["ip", "link", "add", name, "type", "bridge"],
            ["ip", "addr", "add", f"{gateway}/24", "dev", name],
            ["ip", "link", "set", name, "up"],
        ):
            done = subprocess.run(command, capture_output=True, text=True, timeout=10)
            if done.returncode != 0:  # no right to make one (a container without NET_ADMIN)
                raise DockerUnavailable(f"{' '.join(command)}: {done.stderr.strip()}")
        yield name, gateway
    finally:
        subprocess.run(["ip", "link", "delete", name], capture_output=True, timeout=10)


def _wait_for_daemon(
    docker: Docker, process: subprocess.Popen[bytes], log: Path, limit: float
) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(
                f"dockerd exited ({process.returncode}): {log.read_text(errors='replace')[-2000:]}"
            )
        if (
            docker.socket.exists()
            and docker.run("version", check=False, timeout=10).returncode == 0
        ):
            return
        time.sleep(0.2)
    raise RuntimeError(
        f"dockerd did not answer within {limit:.0f} s: {log.read_text(errors='replace')[-2000:]}"
    )


def ensure_base_image(docker: Docker) -> str:
    """The base image (Debian bookworm with Python 3.11), made with debootstrap if missing."""
    if docker.run("image", "inspect", BASE_IMAGE, check=False).returncode == 0:
        return BASE_IMAGE
    with tempfile.TemporaryDirectory(prefix="orchestrion-rootfs-") as scratch:
        root = Path(scratch) / "rootfs"
        done = subprocess.run(
            [
                "debootstrap",
                "--variant=minbase",
                "--include=python3,python3-venv,ca-certificates",
                "bookworm",
                str(root),
                DEBIAN_MIRROR,
            ],
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"debootstrap failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        # What the official images leave out too: the package cache and lists.
        for folder in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for entry in (root / folder).glob("*"):
                if entry.is_file():
                    entry.unlink()
        tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
        try:
            imported = subprocess.run(
                [docker.client, "import", "-", BASE_IMAGE],
                stdin=tar.stdout,
                env=docker.env(),
                capture_output=True,
                timeout=300,
                check=False,
            )
        finally:
            assert tar.stdout is not None
            tar.stdout.close()
            tar.wait(timeout=60)
        if imported.returncode != 0:
            raise RuntimeError(f"docker import failed: {imported.stderr.decode(errors='replace')}")
    return BASE_IMAGE


def build_image(
    docker: Docker, dockerfile: str, tag: str, *, cold: bool = False, timeout: float = 1800
) -> float:
    """Builds ``deploy/container/<dockerfile>`` on the base image (``cold``: without the
    daemon's build cache); returns the seconds taken."""
    base = ensure_base_image(docker)
    args = [
        "build",
        "--network=host",
        f"--file={REPOSITORY / 'deploy' / 'container' / dockerfile}",
        f"--build-arg=PYTHON_IMAGE={base}",
        f"--tag={tag}",
        "--progress=plain",
        *(["--no-cache"] if cold else []),
    ]
    ca_bundle = os.environ.get("SSL_CERT_FILE", "/etc/ssl/certs/ca-certificates.crt")
    if Path(ca_bundle).is_file():
        args.append(f"--secret=id=ca-certificates,src={ca_bundle}")
    started = time.monotonic()
    docker.run(*args, str(REPOSITORY), timeout=timeout)
    took = time.monotonic() - started
    # The data root is kept between runs: what this build replaced goes (the image it
    # untagged, and build cache beyond what one image's rebuild reuses).
    docker.run("image", "prune", "--force", timeout=300)
    docker.run("builder", "prune", "--force", f"--keep-storage={KEEP_BUILD_CACHE}", timeout=300)
    return took


def image_size(docker: Docker, tag: str) -> int:
    """The image's size in bytes, as ``docker images`` counts it (all its layers)."""
    return int(docker.run("image", "inspect", "--format={{.Size}}", tag).stdout.strip())
