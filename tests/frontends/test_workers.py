"""``orchestrion serve --workers N``: real server processes sharing the ports, real clients
(HTTP on fresh connections, tritonclient over gRPC), real signals. The supervisor adds up
the workers' metrics, replaces a worker that dies, stops them all on SIGTERM, and what
would reach one worker only is refused."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from orchestrion.frontends import native_available
from orchestrion.frontends._workers import add_up
from orchestrion.testing import Served, get, post
from support.metrics import metric_value
from support.served import MODELS, pipeline_body, serve_command, start_server

_WORKERS = ("--frontend", "native", "--workers", "2")
_READY = re.compile(r"worker (\d+) \(pid (\d+)\) ready in .*its own metrics at (\S+)")

native = pytest.mark.skipif(
    not native_available(),
    reason="the native front end is not built (scripts/bootstrap builds it where cargo is)",
)


def _ready_workers(served: Served, limit: float = 120.0) -> dict[int, tuple[int, str]]:
    """Each worker's pid and own metrics address, from its latest ``ready`` line, once the
    supervisor said it is ready (bounded)."""
    deadline = time.monotonic() + limit
    while not any(line.startswith("ready in ") for line in list(served.output)):
        assert served.process.poll() is None, served.text()
        assert time.monotonic() < deadline, served.text()
        time.sleep(0.02)
    found = {}
    for line in list(served.output):
        if (match := _READY.search(line)) is not None:
            found[int(match[1])] = (int(match[2]), match[3])
    return found


def _succeeded(address: str, model: str = "pipeline") -> float:
    status, text = get(address, "/metrics")
    assert status == 200
    return metric_value(text.decode(), "nv_inference_request_success", model=model)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _infer_over_http(served: Served, count: int) -> None:
    """``count`` requests, each on a connection of its own (the kernel picks a worker per
    connection), each answered right."""
    for index in range(count):
        status, body = post(served.http, "/v2/models/pipeline/infer", pipeline_body(float(index)))
        assert status == 200, body
        outputs = {o["name"]: o for o in json.loads(body)["outputs"]}
        assert set(outputs) == {"CLASS", "SEG"}


@native
def test_workers_share_the_ports_and_their_metrics_add_up() -> None:
    """Two workers: requests on fresh connections reach both; the supervisor's metrics are
    their sum; gRPC answers too; SIGTERM stops every worker and the command exits 0."""
    served = start_server(*_WORKERS)
    try:
        workers = _ready_workers(served)
        assert sorted(workers) == [0, 1]
        _infer_over_http(served, 60)
        own = [_succeeded(metrics) for _, metrics in workers.values()]
        assert sum(own) == 60
        assert all(count > 0 for count in own), own  # both took connections
        assert _succeeded(served.metrics) == 60
        with grpcclient.InferenceServerClient(served.grpc) as client:
            item = grpcclient.InferInput("INPUT", [1, 16], "FP32")
            item.set_data_from_numpy(np.full((1, 16), 2.0, np.float32))
            result = client.infer("pipeline", [item])
            assert result.as_numpy("SEG").shape == (1, 16)
            assert client.is_server_ready()
        assert _succeeded(served.metrics) == 61
    finally:
        code = served.stop(timeout=60)
    assert code == 0, served.text()
    assert not any(_alive(pid) for pid, _ in workers.values())
    assert "SIGTERM: stopping 2 workers" in served.text()


@native
def test_a_worker_that_dies_is_replaced_and_the_others_serve_on() -> None:
    """A worker killed (SIGKILL) is started again; the server answers throughout (a
    connection to the dead worker fails, new ones reach the living or the new one)."""
    served = start_server(*_WORKERS)
    try:
        workers = _ready_workers(served)
        victim, _ = workers[0]
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while len([line for line in list(served.output) if _READY.search(line)]) < 3:
            assert time.monotonic() < deadline, served.text()
            time.sleep(0.05)
        assert "worker 0 exited with status -9: starting another" in served.text()
        replaced = _ready_workers(served)
        assert replaced[0][0] != victim
        assert _alive(replaced[0][0])
        _infer_over_http(served, 20)
    finally:
        code = served.stop(timeout=60)
    assert code == 0, served.text()
    assert not any(_alive(pid) for pid, _ in replaced.values())


@native
def test_workers_whose_supervisor_is_killed_stop_by_themselves() -> None:
    """SIGKILL to the supervisor (nothing can forward a signal): each worker sees it is
    orphaned and stops gracefully within seconds, leaving no process behind."""
    served = start_server(*_WORKERS)
    workers = _ready_workers(served)
    served.stop(timeout=30, how=signal.SIGKILL)
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid, _ in workers.values()):
        assert time.monotonic() < deadline, "workers outlived their supervisor"
        time.sleep(0.05)


@native
def test_what_would_reach_one_worker_only_is_refused_saying_why() -> None:
    """Model control through the API and client shared memory would change one worker of
    two: both are refused with a message naming --workers; explicit mode's --load-model
    still loads at start, in every worker."""
    served = start_server(*_WORKERS, "--model-control-mode", "explicit", "--load-model", "pipeline")
    try:
        _ready_workers(served)
        _infer_over_http(served, 4)
        status, body = post(served.http, "/v2/repository/models/pipeline/unload", b"{}")
        assert status >= 400
        assert "not available with --workers 2" in json.loads(body)["error"]
        region = json.dumps({"key": "/orchestrion-none", "offset": 0, "byte_size": 64}).encode()
        status, body = post(served.http, "/v2/systemsharedmemory/region/r/register", region)
        assert status >= 400
        assert "client shared memory is not available with --workers 2" in body.decode()
        _infer_over_http(served, 4)  # still loaded everywhere
    finally:
        assert served.stop(timeout=60) == 0, served.text()


@native
def test_a_worker_that_cannot_start_stops_the_start() -> None:
    """A repository that does not load: each worker says why, the supervisor stops the
    others and exits with the workers' status, leaving no process behind."""
    command = serve_command(*_WORKERS, repository=MODELS / "no-such-folder")
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "before it was ready" in done.stdout
    assert "no-such-folder" in done.stdout
    leftover = subprocess.run(
        ["pgrep", "-f", "no-such-folder.*--worker-of"], capture_output=True, check=False
    )
    assert leftover.stdout == b""


def test_workers_need_the_native_front_end_and_a_count() -> None:
    """``--workers`` with the Python front ends, or below 1: a clear error, nothing served."""
    for flags, said in (
        (("--frontend", "python", "--workers", "2"), "--workers needs the native front end"),
        (("--workers", "0"), "--workers 0: give 1 or more"),
    ):
        command = [sys.executable, "-m", "orchestrion", "serve", "--model-repository"]
        command += [str(MODELS), *flags]
        done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 2
        assert said in done.stdout, done.stdout


def test_metrics_add_up_by_kind() -> None:
    """Counters, histograms and per-process gauges add up; a cache backend's availability is
    the least, a setting the largest, a utilization the mean, and a shared backend's size is
    counted once (a local cache's sizes add up); Triton's names keep no ``_total``."""
    one = """# HELP nv_inference_count Number of inferences performed
# TYPE nv_inference_count counter
nv_inference_count{model="m",version="1"} 3
# HELP nv_inference_pending_request_count Requests accepted and not yet answered
# TYPE nv_inference_pending_request_count gauge
nv_inference_pending_request_count{model="m",version="1"} 2
# HELP orchestrion_cache_available 1 while the backend answers
# TYPE orchestrion_cache_available gauge
orchestrion_cache_available{cache="redis"} 1
# HELP orchestrion_step_max_inflight_requests The step's max_inflight_requests
# TYPE orchestrion_step_max_inflight_requests gauge
orchestrion_step_max_inflight_requests{ensemble="e",step="0",model="m"} 4
# HELP nv_cache_util Cache utilization [0.0 - 1.0]
# TYPE nv_cache_util gauge
nv_cache_util 0.25
# HELP orchestrion_cache_capacity_bytes The cache's size
# TYPE orchestrion_cache_capacity_bytes gauge
orchestrion_cache_capacity_bytes{cache="redis"} 100
orchestrion_cache_capacity_bytes{cache="local"} 10
# HELP orchestrion_request_seconds Latency
# TYPE orchestrion_request_seconds histogram
orchestrion_request_seconds_bucket{le="0.1"} 1
orchestrion_request_seconds_bucket{le="+Inf"} 2
orchestrion_request_seconds_sum 0.5
orchestrion_request_seconds_count 2
"""
    two = (
        one.replace('"1"} 3', '"1"} 4')
        .replace('"1"} 2', '"1"} 5')
        .replace('redis"} 1', 'redis"} 0')
        .replace("util 0.25", "util 0.75")
        .replace('bucket{le="0.1"} 1', 'bucket{le="0.1"} 2')
    )
    text = add_up([one, two])
    assert 'nv_inference_count{model="m",version="1"} 7' in text
    assert "# TYPE nv_inference_count counter" in text
    assert "_total" not in text
    assert 'nv_inference_pending_request_count{model="m",version="1"} 7' in text
    assert 'orchestrion_cache_available{cache="redis"} 0' in text
    assert 'orchestrion_step_max_inflight_requests{ensemble="e",model="m",step="0"} 4' in text
    assert "nv_cache_util 0.5" in text
    assert 'orchestrion_cache_capacity_bytes{cache="redis"} 100' in text
    assert 'orchestrion_cache_capacity_bytes{cache="local"} 20' in text
    assert 'orchestrion_request_seconds_bucket{le="0.1"} 3' in text
    assert "orchestrion_request_seconds_count 4" in text
