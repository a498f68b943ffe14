"""deploy/container: the CPU image, built from the shipped Dockerfile by a Docker daemon the
tests start, run the way deploy/kubernetes/orchestrion.yaml's Deployment runs it (its
arguments, user, read-only root filesystem, dropped capabilities, memory limit, /tmp as an
emptyDir, probes, preStop pause and grace period), serving examples/onnx_pipeline with the
manifest's Redis response cache pointed at a real Redis, to tritonclient over HTTP and gRPC.

The base image stands in for the official Python image (no registry of images is reachable
here): Debian bookworm made by debootstrap (tests/support/containers.py)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest
import redis
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import yaml

import orchestrion
from orchestrion.testing import RedisServer
from support import containers
from support.metrics import metric_value

REPO = Path(__file__).resolve().parents[2]
MANIFEST = REPO / "deploy" / "kubernetes" / "orchestrion.yaml"
MODELS = REPO / "examples" / "onnx_pipeline" / "models"
MODEL = "pipeline"
TAG = "orchestrion:cpu-test"
REDIS_PASSWORD = uuid.uuid4().hex

pytestmark = pytest.mark.skipif(
    containers.unavailable_reason() is not None,
    reason=f"no Docker daemon can be started here: {containers.unavailable_reason()}",
)


@attrs.frozen
class Pod:
    """What the manifest's Deployment asks of its container, read from the file."""

    args: list[str]
    user: int
    read_only: bool
    drop: list[str]
    no_new_privileges: bool
    memory_bytes: int
    empty_dirs: list[str]
    models_at: str
    env_from_secrets: list[str]
    startup: dict[str, Any]
    readiness: dict[str, Any]
    grace_seconds: int
    pre_stop_seconds: int


def _bytes(quantity: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30}
    for suffix, factor in units.items():
        if quantity.endswith(suffix):
            return int(quantity[: -len(suffix)]) * factor
    return int(quantity)


def manifest_pod() -> Pod:
    """The Deployment's pod, as ``docker run`` can reproduce it."""
    (deployment,) = [
        doc for doc in yaml.safe_load_all(MANIFEST.read_text()) if doc["kind"] == "Deployment"
    ]
    spec = deployment["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: volumes[m["name"]] for m in container["volumeMounts"]}
    security = container["securityContext"]
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep", pre_stop
    return Pod(
        args=container["args"],
        user=spec["securityContext"]["runAsUser"],
        read_only=security["readOnlyRootFilesystem"],
        drop=security["capabilities"]["drop"],
        no_new_privileges=not security["allowPrivilegeEscalation"],
        memory_bytes=_bytes(container["resources"]["limits"]["memory"]),
        empty_dirs=[path for path, volume in mounts.items() if "emptyDir" in volume],
        models_at=next(p for p, v in mounts.items() if "persistentVolumeClaim" in v),
        env_from_secrets=[e["name"] for e in container["env"] if "secretKeyRef" in e["valueFrom"]],
        startup=container["startupProbe"],
        readiness=container["readinessProbe"],
        grace_seconds=spec["terminationGracePeriodSeconds"],
        pre_stop_seconds=int(pre_stop[1]),
    )


def run_flags(pod: Pod, docker: containers.Docker, cache: RedisServer) -> list[str]:
    """``docker run`` flags and arguments for ``pod``, its Redis being ``cache``."""
    flags = [f"--user={pod.user}", f"--memory={pod.memory_bytes}"]
    flags += ["--read-only"] if pod.read_only else []
    flags += [f"--cap-drop={cap}" for cap in pod.drop]
    flags += ["--security-opt=no-new-privileges"] if pod.no_new_privileges else []
    flags += [f"--tmpfs={path}" for path in pod.empty_dirs]
    # The Secret's one variable is the Redis password (Redis refuses other hosts without one).
    (password,) = pod.env_from_secrets
    flags += [f"--env={password}={REDIS_PASSWORD}"]
    flags += [f"--volume={MODELS}:{pod.models_at}:ro", TAG]
    args = []
    for arg in pod.args:  # the manifest's Redis Service is this test's Redis
        if arg.startswith("--cache-config=redis,host="):
            arg = f"--cache-config=redis,host={docker.gateway}"
        elif arg.startswith("--cache-config=redis,port="):
            arg = f"--cache-config=redis,port={cache.port}"
        args.append(arg)
    assert args != pod.args, "the manifest names no Redis to replace"
    return flags + args


def probe(probe: dict[str, Any], address: str) -> bool:
    """One probe as the kubelet makes it: a GET within its timeout, 2xx-3xx is success."""
    http = probe["httpGet"]
    assert http["port"] == "http", http
    url = f"http://{address}:8000{http['path']}"
    try:
        with urllib.request.urlopen(url, timeout=probe.get("timeoutSeconds", 1)) as response:
            return 200 <= response.status < 400
    except (urllib.error.URLError, OSError):
        return False


def wait_for(check: Any, limit: float, what: str) -> float:
    """Seconds until ``check()`` is true, polling every 50 ms; fails after ``limit``."""
    started = time.monotonic()
    while time.monotonic() - started < limit:
        if check():
            return time.monotonic() - started
        time.sleep(0.05)
    raise AssertionError(f"{what} not within {limit:.0f} s")


@attrs.define
class Running:
    name: str
    address: str
    ready_after: float


@pytest.fixture(scope="module")
def docker() -> Iterator[containers.Docker]:
    # Skipped where what a daemon needs is missing; a daemon that starts and fails is an error.
    with contextlib.ExitStack() as stack:
        try:
            daemon = stack.enter_context(containers.docker_daemon())
        except containers.DockerUnavailable as exc:
            pytest.skip(f"no Docker daemon can be started here: {exc}")
        yield daemon


@pytest.fixture(scope="module")
def image(docker: containers.Docker) -> str:
    seconds = containers.build_image(docker, "Dockerfile", TAG)
    size = containers.image_size(docker, TAG)
    print(f"built {TAG} in {seconds:.0f} s: {size / 1e6:.0f} MB")
    return TAG


@pytest.fixture
def cache(tmp_path: Path, docker: containers.Docker) -> Iterator[RedisServer]:
    # At the bridge's address, where containers reach this machine.
    server = RedisServer(tmp_path, ["--requirepass", REDIS_PASSWORD], host=docker.gateway)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@contextlib.contextmanager
def running(docker: containers.Docker, pod: Pod, cache: RedisServer) -> Iterator[Running]:
    """The container, started and awaited as the kubelet's probes would; removed after."""
    name = f"orchestrion-test-{uuid.uuid4().hex[:8]}"
    started = time.monotonic()
    try:
        docker.run("run", "--detach", f"--name={name}", *run_flags(pod, docker, cache))
        address = docker.run(
            "inspect", "--format={{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}", name
        ).stdout.strip()
        startup_limit = pod.startup["periodSeconds"] * pod.startup["failureThreshold"]

        def succeeds(kind: dict[str, Any]) -> bool:
            if probe(kind, address):
                return True
            state = docker.run("inspect", "--format={{.State.Status}}", name).stdout.strip()
            assert state == "running", f"the container is {state}"
            return False

        wait_for(lambda: succeeds(pod.startup), startup_limit, "the startup probe")
        wait_for(lambda: succeeds(pod.readiness), startup_limit, "the readiness probe")
        yield Running(name, address, time.monotonic() - started)
    except BaseException:
        print(docker.run("logs", name, check=False).stdout[-6000:])
        print(docker.run("logs", name, check=False).stderr[-6000:])
        raise
    finally:
        docker.run("rm", "--force", name, check=False)


def request_images(seed: int, batch: int = 2) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (batch, 64, 64, 3), dtype=np.uint8)


def expected(images: np.ndarray) -> dict[str, np.ndarray]:
    """The same pipeline run in this process: what the container must answer."""
    with orchestrion.Server(model_repository=MODELS) as server:
        return dict(server.infer(MODEL, {"IMAGE": images}).outputs)


def http_infer(address: str, images: np.ndarray, timeout: float = 10) -> dict[str, np.ndarray]:
    client = httpclient.InferenceServerClient(
        f"{address}:8000", connection_timeout=timeout, network_timeout=timeout
    )
    try:
        given = httpclient.InferInput("IMAGE", list(images.shape), "UINT8")
        given.set_data_from_numpy(images)
        result = client.infer(MODEL, [given])
        return {name: result.as_numpy(name) for name in ("PROBABILITIES", "LABEL")}
    finally:
        client.close()


def grpc_infer(address: str, images: np.ndarray, timeout: float = 10) -> dict[str, np.ndarray]:
    client = grpcclient.InferenceServerClient(f"{address}:8001")
    try:
        given = grpcclient.InferInput("IMAGE", list(images.shape), "UINT8")
        given.set_data_from_numpy(images)
        result = client.infer(MODEL, [given], client_timeout=timeout)
        return {name: result.as_numpy(name) for name in ("PROBABILITIES", "LABEL")}
    finally:
        client.close()


def metrics_text(address: str) -> str:
    with urllib.request.urlopen(f"http://{address}:8002/metrics", timeout=5) as response:
        return response.read().decode()


def inside(docker: containers.Docker, name: str, script: str) -> tuple[int, str]:
    done = docker.run("exec", name, "sh", "-c", script, check=False)
    return done.returncode, done.stdout + done.stderr


def test_the_image_serves_the_way_the_deployment_runs_it(
    docker: containers.Docker, image: str, cache: RedisServer
) -> None:
    pod = manifest_pod()
    images = request_images(seed=1)
    want = expected(images)
    with running(docker, pod, cache) as box:
        print(f"ready {box.ready_after:.1f} s after docker run")
        got_http = http_infer(box.address, images)
        got_grpc = grpc_infer(box.address, images)  # the same request: Redis answers it
        for got in (got_http, got_grpc):
            np.testing.assert_allclose(got["PROBABILITIES"], want["PROBABILITIES"], atol=1e-5)
            np.testing.assert_array_equal(got["LABEL"], want["LABEL"])

        # Prometheus' view: two successes, the second a hit in the manifest's Redis cache.
        metrics = metrics_text(box.address)
        assert metric_value(metrics, "nv_inference_request_success", model=MODEL) == 2
        assert metric_value(metrics, "nv_cache_num_hits_per_model", model=MODEL) == 1
        stored = redis.Redis(host=cache.host, port=cache.port, password=REDIS_PASSWORD).dbsize()
        assert stored >= 1

        # The Dockerfile's own HEALTHCHECK (every 10 s) agrees with the probes.
        def healthy() -> bool:
            state = docker.run("inspect", "--format={{json .State.Health}}", box.name).stdout
            return json.loads(state)["Status"] == "healthy"

        wait_for(healthy, 30, "docker's health check")

        # User 1000 (as the pod's securityContext says), a read-only root, a writable /tmp.
        status, out = inside(docker, box.name, "grep '^Uid:' /proc/1/status")
        assert (status, out.split()[1:]) == (0, [str(pod.user)] * 4), out
        status, out = inside(docker, box.name, "touch /opt/orchestrion/written")
        assert status != 0
        assert "Read-only file system" in out, out
        status, out = inside(docker, box.name, "touch /tmp/written && echo ok")
        assert (status, out.strip()) == (0, "ok")
        # --cap-drop ALL and no-new-privileges reach the process (its effective set is
        # empty anyway as uid 1000: the bounding set is what dropping changes).
        status, out = inside(docker, box.name, "grep -E '^(CapBnd|NoNewPrivs):' /proc/1/status")
        assert out.split() == ["CapBnd:", "0000000000000000", "NoNewPrivs:", "1"], out

        # The native front end serves (its extension is loaded into the server), and the
        # image holds no sources and nothing of the tests'.
        status, out = inside(docker, box.name, "grep -c 'orchestrion_native/_native' /proc/1/maps")
        assert status == 0, out
        assert int(out) >= 1, out
        status, out = inside(docker, box.name, "ls /src; pip show pytest tritonclient")
        assert "No such file or directory" in out, out
        assert "Package(s) not found: pytest" in out, out
        assert "Name: tritonclient" in out, out  # orchestrion's own dependency (Triton's schema)


def test_sigterm_under_load_stops_within_the_grace_period(
    docker: containers.Docker, image: str, cache: RedisServer
) -> None:
    """The kubelet's stop: the preStop pause while still serving, then SIGTERM. Requests in
    flight when the signal arrives are answered, later ones are answered or refused (never
    left hanging), and the process exits 0 within the grace period."""
    pod = manifest_pod()
    with running(docker, pod, cache) as box:
        outcomes: list[tuple[float, float, str | None]] = []
        stop = threading.Event()
        signalled = [float("inf")]

        def load(infer: Any, seed: int) -> None:
            # Full batches of new inputs: every request runs the models, and with six
            # clients each waits behind the others, so some are in flight at the signal.
            for n in range(100_000):
                if stop.is_set():
                    return
                sent = time.monotonic()
                try:
                    infer(box.address, request_images(seed + n, batch=64), timeout=20)
                    error = None
                except Exception as exc:
                    error = f"{type(exc).__name__}: {exc}"
                outcomes.append((sent, time.monotonic(), error))
                if error is not None and sent > signalled[0]:
                    return  # refused after SIGTERM: the server is stopping

        clients = [
            threading.Thread(target=load, args=(infer, 1000 * n))
            for n, infer in enumerate([http_infer, grpc_infer] * 3)
        ]
        for client in clients:
            client.start()
        try:
            # The server is the container's first process (the image's exec-form entry
            # point): SIGTERM goes to it straight from here, as the runtime sends it, so
            # that the moment it is sent is known to within microseconds.
            server = int(docker.run("inspect", "--format={{.State.Pid}}", box.name).stdout)
            time.sleep(1)
            stopping = time.monotonic()
            time.sleep(pod.pre_stop_seconds)  # preStop: still in service
            kill_sent = time.monotonic()
            os.kill(server, signal.SIGTERM)
            signalled[0] = time.monotonic()
            left = pod.grace_seconds - (time.monotonic() - stopping)
            exit_code = int(docker.run("wait", box.name, timeout=left).stdout.strip())
            stopped_after = time.monotonic() - stopping
        finally:
            stop.set()
            for client in clients:
                client.join(timeout=30)
        logs = docker.run("logs", box.name).stdout
    straddling = [o for o in outcomes if o[0] < kill_sent and o[1] > signalled[0]]
    print(
        f"exited {exit_code} {stopped_after:.1f} s after the stop began; {len(outcomes)} "
        f"requests, {len(straddling)} in flight at SIGTERM"
    )
    assert exit_code == 0, logs[-3000:]
    assert stopped_after < pod.grace_seconds
    assert "stopped" in logs.splitlines()[-1], logs[-3000:]
    before = [o for o in outcomes if o[0] < kill_sent]
    assert len(before) >= 20, "too little load to test the stop"
    assert straddling != [], "no request was in flight at SIGTERM: the load is too light"
    # Sent before SIGTERM (in flight at it included): answered. A client's clock starts
    # before it connects, so a connection refused after the signal (the listener closed)
    # never reached the server: that one is not in flight.
    failed = [
        o
        for o in before
        if o[2] is not None and not ("ConnectionRefused" in o[2] and o[1] > signalled[0])
    ]
    assert failed == [], failed
    hanging = [o for o in outcomes if o[2] is not None and "timed out" in o[2].lower()]
    assert hanging == [], hanging
