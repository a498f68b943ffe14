"""Three orchestrion replicas on three hosts (network namespaces) behind HAProxy, sharing a
Redis Cluster on two other hosts: what one replica computed the others answer from the
cache, and replicas killed (SIGKILL) and stopped (SIGTERM) under HTTP and gRPC load, then
restarted, cost no client a wrong or missing answer. Needs root (CI runs as root)."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import tritonclient.http as httpclient

from orchestrion.testing import (
    ReplicaLoad,
    ReplicaSite,
    get,
    haproxy_unavailable,
    netns_unavailable,
    percentile,
)
from support.reliability_report import SIZE, record

PHASE = max(300, SIZE // 10)
"""Requests answered between two events of the fault test."""


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ReplicaSite]:
    """The hosts, the Redis Cluster, three replicas and HAProxy; all removed afterwards."""
    why = netns_unavailable() or haproxy_unavailable()
    if why:
        pytest.skip(why)
    built = ReplicaSite(tmp_path_factory.mktemp("site"))
    built.open()
    try:
        yield built
    finally:
        built.close()


def model_stats(address: str) -> dict[str, int]:
    """Executions and cache hits of the model on one replica."""
    status, body = get(address, "/v2/models/scaled/stats")
    assert status == 200, body
    (stats,) = json.loads(body)["model_stats"]
    return {
        "executions": int(stats["execution_count"]),
        "hits": int(stats["inference_stats"]["cache_hit"]["count"]),
    }


def ask(address: str, value: float) -> Any:
    client = httpclient.InferenceServerClient(address, network_timeout=30)
    try:
        item = httpclient.InferInput("X", [16], "FP32")
        item.set_data_from_numpy(np.full(16, value, np.float32))
        return client.infer("scaled", [item]).as_numpy("Y")
    finally:
        client.close()


def test_a_response_computed_on_one_replica_is_a_hit_on_the_others(site: ReplicaSite) -> None:
    """Asked of app1, the model runs there; asked of app2 and app3 (directly, on their own
    hosts), the answer comes from the shared Redis Cluster without running the model."""
    first, *others = site.app_hosts
    before = {host: model_stats(site.replica_http(host)) for host in site.app_hosts}
    answers = [ask(site.replica_http(host), 4242.0) for host in (first, *others)]
    after = {host: model_stats(site.replica_http(host)) for host in site.app_hosts}
    for answer in answers:
        np.testing.assert_array_equal(answer, np.full(16, 4242.0 * 2 + 1, np.float32))
    assert after[first]["executions"] == before[first]["executions"] + 1
    for host in others:
        assert after[host]["executions"] == before[host]["executions"], host
        assert after[host]["hits"] == before[host]["hits"] + 1, host
    record(
        "Faults",
        "One input asked of each of three replicas on three hosts (network namespaces), "
        "sharing a 3-primary, 3-replica Redis Cluster on two other hosts",
        "3 requests, one per replica",
        "computed once, on the first replica; the other two answered it from the cache "
        "(a hit each, no execution)",
    )


def _phase(load: ReplicaLoad) -> None:
    load.wait_for(load.count() + PHASE, timeout=120)


def test_replicas_killed_and_stopped_under_load_answer_every_request(site: ReplicaSite) -> None:
    """Under HTTP and gRPC load through HAProxy: app1 SIGKILLed, then restarted; app2
    drained at HAProxy and SIGTERMed (exit 0), as a rolling deploy stops a replica, then
    restarted. Every request gets exactly one answer, the right one; HAProxy's retries hide
    the failures from the clients."""
    app1, app2, _ = site.app_hosts
    load = ReplicaLoad(site.http, site.grpc).start()
    try:
        _phase(load)
        site.kill_replica(app1, signal.SIGKILL)
        killed_at = load.count()
        _phase(load)
        site.wait_balanced(set(site.app_hosts) - {app1})
        site.start_replica(app1)
        site.wait_balanced(set(site.app_hosts))
        _phase(load)
        site.drain_replica(app2)
        code = site.kill_replica(app2, signal.SIGTERM)
        _phase(load)
        site.wait_balanced(set(site.app_hosts) - {app2})
        site.start_replica(app2)
        site.wait_balanced(set(site.app_hosts))
        _phase(load)
    finally:
        outcomes = load.stop()
    retries = site.retries()
    errors = [o for o in outcomes if o.error]
    indexes = [o.index for o in outcomes]
    by_protocol = {p: sum(o.protocol == p for o in outcomes) for p in ("http", "grpc")}
    slowest = max(o.latency for o in outcomes)
    p99 = percentile([o.latency for o in outcomes], 0.99)
    hits = sum(model_stats(site.replica_http(h))["hits"] for h in site.app_hosts)
    record(
        "Faults",
        "Three replicas behind HAProxy (health checks on /v2/health/ready every 200 ms, "
        "retries of failed connections and unanswered requests) under HTTP and gRPC load: "
        "one SIGKILLed and restarted, another drained at HAProxy, SIGTERMed and restarted",
        f"{len(outcomes):,} requests ({by_protocol['http']:,} HTTP, {by_protocol['grpc']:,} "
        f"gRPC, 8 clients), {killed_at:,} before the SIGKILL",
        f"{len(outcomes) - len(errors):,} answered right, {len(errors)} errors seen by clients; "
        f"HAProxy counted {retries['retried']} retries, {retries['redispatched']} "
        f"redispatches (requests sent to another replica than first chosen), "
        f"{retries['connect_errors']} connection and {retries['response_errors']} response "
        "errors; SIGTERM exit code "
        f"{code}; p99 {p99 * 1000:.0f} ms, slowest {slowest:.2f} s; {hits:,} cache hits "
        "counted by the replicas since their last start",
    )
    assert len(set(indexes)) == len(indexes)  # one outcome per request
    assert errors == [], errors[:5]
    assert code == 0
    assert by_protocol["http"] > 0
    assert by_protocol["grpc"] > 0
