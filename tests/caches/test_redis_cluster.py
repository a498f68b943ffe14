"""The ``redis`` cache on a real Redis Cluster (3 primaries, 3 replicas) and on a primary
watched by real Sentinels: entries spread under their usual names, and a primary killed under
load costs misses, never a failed request."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest
import redis
import trio

import orchestrion
from orchestrion.caches import open_cache
from orchestrion.protocols import CacheUnavailableError, ConfigError, parse_cache_config
from orchestrion.testing import (
    RedisClusterServers,
    RedisSentinels,
    RedisServer,
    cached,
    free_port,
    model,
    tensor,
)

FAST_RETRY = "redis,retry_interval=200"
DEADLINE = 90.0
"""Seconds a load test may take in all (a failover takes about 3 s on a quiet machine)."""


class Counter:
    """Y = X + 1, counting executions."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, X: Any) -> dict[str, Any]:
        self.calls += 1
        return {"Y": X + 1}


def counted(counter: Counter) -> orchestrion.Model:
    m = cached(model("m", counter, [tensor("X")], [tensor("Y")], jit=False))
    return attrs.evolve(m, revision="cluster")


def inputs(first: int, count: int) -> list[np.ndarray]:
    return [np.full(16, float(i), np.float32) for i in range(first, first + count)]


@pytest.fixture
def redis_cluster(tmp_path: Path) -> Iterator[RedisClusterServers]:
    """A fresh 3-primary, 3-replica Redis Cluster on free loopback ports."""
    cluster = RedisClusterServers(tmp_path / "cluster")
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def redis_sentinels(tmp_path: Path) -> Iterator[RedisSentinels]:
    """A primary, its replica and three Sentinels on free loopback ports."""
    sentinels = RedisSentinels(tmp_path / "sentinel")
    sentinels.start()
    try:
        yield sentinels
    finally:
        sentinels.stop()


async def settle(server: orchestrion.AsyncServer) -> None:
    """Wait (bounded) until the cache actor has written every queued insert."""
    with trio.fail_after(10):
        while (s := server.cache_statistics()) is not None and s.queue_depth:  # noqa: ASYNC110
            await trio.sleep(0.01)
    await trio.sleep(0.05)


async def rounds(server: orchestrion.AsyncServer, xs: list[np.ndarray]) -> None:
    for x in xs:
        response = await server.infer("m", {"X": x})
        np.testing.assert_array_equal(response.outputs["Y"], x + 1)


async def test_entries_spread_over_the_primaries_under_their_usual_names(
    redis_cluster: RedisClusterServers,
) -> None:
    """Entries land on every primary under ``orchestrion:<32 hex>``; a second server hits
    what the first computed."""
    first, second = Counter(), Counter()
    xs = inputs(0, 48)
    async with orchestrion.open_server(
        models=[counted(first)], cache_config=redis_cluster.cache_config
    ) as a:
        await rounds(a, xs)
        await settle(a)
    async with orchestrion.open_server(
        models=[counted(second)], cache_config=redis_cluster.cache_config
    ) as b:
        await rounds(b, xs)
        stats = b.cache_statistics()
    assert (first.calls, second.calls) == (48, 0)
    assert stats is not None
    assert (stats.hits, stats.misses, stats.errors) == (48, 0, 0)
    per_primary = []
    for node in redis_cluster.nodes[:3]:
        with redis.Redis(host=node.host, port=node.port) as client:
            keys = client.keys("*")
        assert all(k.startswith(b"orchestrion:") and len(k) == 12 + 32 for k in keys)
        per_primary.append(len(keys))
    assert sum(per_primary) == 48
    assert min(per_primary) > 0, per_primary


async def _load_through(
    server: orchestrion.AsyncServer,
    xs: list[np.ndarray],
    stop: trio.Event,
    answers: list[int],
    failures: list[BaseException],
) -> None:
    """Eight clients asking for ``xs`` in turn until ``stop``; each answer checked."""

    async def client(offset: int) -> None:
        n = offset
        while not stop.is_set():
            x = xs[n % len(xs)]
            n += 7
            try:
                response = await server.infer("m", {"X": x}, timeout=10)
                np.testing.assert_array_equal(response.outputs["Y"], x + 1)
            except Exception as exc:
                failures.append(exc)
            else:
                answers.append(1)

    async with trio.open_nursery() as nursery:
        for offset in range(8):
            nursery.start_soon(client, offset)


async def _wait_replicated(cluster: RedisClusterServers, count: int) -> None:
    def replicas_hold() -> int:
        total = 0
        for node in cluster.nodes[3:]:
            with redis.Redis(host=node.host, port=node.port) as c:
                total += int(c.dbsize())
        return total

    with trio.fail_after(20):
        while await trio.to_thread.run_sync(replicas_hold) < count:  # noqa: ASYNC110 (another process)
            await trio.sleep(0.05)


async def test_a_primary_killed_under_load_costs_misses_never_a_failed_request(
    redis_cluster: RedisClusterServers, caplog: pytest.LogCaptureFixture
) -> None:
    """SIGKILL a primary while eight clients ask: every request answered right; its keys
    miss until a replica takes over, then caching resumes on every slot; one ERROR."""
    caplog.set_level(logging.INFO, "orchestrion.caches")
    counter = Counter()
    old, new = inputs(0, 60), inputs(1000, 60)
    answers: list[int] = []
    failures: list[BaseException] = []
    victim = redis_cluster.nodes[0]
    with trio.fail_after(DEADLINE):
        async with orchestrion.open_server(
            models=[counted(counter)], cache_config=[*redis_cluster.cache_config, FAST_RETRY]
        ) as server:
            await rounds(server, old)
            await settle(server)
            await _wait_replicated(redis_cluster, len(old))
            stop = trio.Event()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_load_through, server, old, stop, answers, failures)
                await trio.sleep(0.5)
                before = len(answers)
                await trio.to_thread.run_sync(victim.kill)
                await trio.to_thread.run_sync(redis_cluster.wait_failover, victim)
                await trio.sleep(1.0)  # a few retry intervals: the slot map is refreshed
                during = len(answers) - before
                stop.set()
            calls_before = counter.calls
            await rounds(server, old)  # the replicated entries survived the failover
            old_misses = counter.calls - calls_before
            await rounds(server, new)
            await settle(server)
            calls_before = counter.calls
            await rounds(server, new)  # stored on every slot again, the promoted node's too
            new_misses = counter.calls - calls_before
    print(f"{len(answers)} answers, {during} after the kill; old misses {old_misses}")
    assert failures == []
    assert during > 0
    assert old_misses == 0
    assert new_misses == 0
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1, errors
    assert victim.address in errors[0]
    assert any("no longer serves slots" in r.getMessage() for r in caplog.records)


async def test_every_primary_down_is_an_outage_and_start_up_failures_are_clear(
    redis_cluster: RedisClusterServers, redis_server: RedisServer
) -> None:
    """No primary answering: requests run uncached (the actor's outage); a seed that does
    not answer, or a Redis not in cluster mode, stops the start with a clear message."""
    counter = Counter()
    async with orchestrion.open_server(
        models=[counted(counter)], cache_config=[*redis_cluster.cache_config, FAST_RETRY]
    ) as server:
        await rounds(server, inputs(0, 30))
        await settle(server)  # else an entry still on its way is served from the actor
        for node in redis_cluster.nodes:
            await trio.to_thread.run_sync(node.kill)
        await rounds(server, inputs(0, 30) * 2)
        stats = server.cache_statistics()
    assert stats is not None
    assert not stats.available
    assert counter.calls == 90
    nobody = parse_cache_config(
        ["redis,host=127.0.0.1", f"redis,port={free_port()}", "redis,cluster=1"]
    )
    single = parse_cache_config([*redis_server.cache_config, "redis,cluster=true"])
    for settings, words in ((nobody, "cannot reach Redis at the cluster of"), (single, "")):
        assert settings is not None
        with pytest.raises(CacheUnavailableError) as caught:
            await open_cache(settings)
        assert words in str(caught.value)
    assert "cluster" in str(caught.value).lower()


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["redis,host=h", "redis,port=1", "redis,cluster=true", "redis,db=2"], "only database 0"),
        (["redis,host=h", "redis,port=1", "redis,cluster=true", "redis,prefix={x}:"], "hash tag"),
        (["redis,cluster=true", "redis,sentinels=h:1"], "two kinds of Redis"),
        (["redis,sentinels=h:1"], "'sentinel_master' required"),
        (["redis,sentinels=h", "redis,sentinel_master=m"], "'h' is not <host>:<port>"),
        (["redis,cluster=true", "redis,port=1"], "'host' required"),
    ],
)
async def test_settings_that_cannot_work_are_refused(flags: list[str], words: str) -> None:
    """Cluster and Sentinel keys that contradict each other or Redis are start-up errors."""
    settings = parse_cache_config(flags)
    assert settings is not None
    with pytest.raises(ConfigError, match=words.replace("{", r"\{").replace("}", r"\}")):
        await open_cache(settings)


async def test_a_sentinel_failover_costs_misses_never_a_failed_request(
    redis_sentinels: RedisSentinels, caplog: pytest.LogCaptureFixture
) -> None:
    """SIGKILL the primary the Sentinels watch, under load: every request answered right;
    misses until they promote the replica, then caching resumes there."""
    caplog.set_level(logging.INFO, "orchestrion.caches")
    counter = Counter()
    xs, fresh = inputs(0, 20), inputs(500, 20)
    answers: list[int] = []
    failures: list[BaseException] = []
    with trio.fail_after(DEADLINE):
        async with orchestrion.open_server(
            models=[counted(counter)], cache_config=[*redis_sentinels.cache_config, FAST_RETRY]
        ) as server:
            await rounds(server, xs)
            await settle(server)
            stop = trio.Event()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_load_through, server, xs, stop, answers, failures)
                await trio.sleep(0.5)
                await trio.to_thread.run_sync(redis_sentinels.primary.kill)
                await trio.to_thread.run_sync(
                    redis_sentinels.wait_failover, redis_sentinels.primary
                )
                await trio.sleep(1.0)
                stop.set()
            await rounds(server, fresh)
            await settle(server)
            calls_before = counter.calls
            await rounds(server, fresh)
            stats = server.cache_statistics()
    assert failures == []
    assert counter.calls == calls_before  # stored on the promoted replica, and hit
    assert stats is not None
    assert stats.available
    assert redis_sentinels.master_address()[1] == redis_sentinels.replica.port
    again = [r for r in caplog.records if "available again" in r.getMessage()]
    assert again, [r.getMessage() for r in caplog.records]


async def test_an_answer_from_before_a_node_went_down_does_not_bring_it_back(
    redis_cluster: RedisClusterServers, caplog: pytest.LogCaptureFixture
) -> None:
    """Concurrent trips end in any order: a trip that began before a node was found down
    and was answered by it (just before it died) is judged after the failing one. The node
    stays down, and is reported once; an answer from a trip begun later brings it back."""
    from orchestrion.caches._redis_cluster import RedisClusterCache, _Trip

    settings = parse_cache_config([*redis_cluster.cache_config, FAST_RETRY])
    assert settings is not None
    cache = await open_cache(settings)
    assert isinstance(cache, RedisClusterCache)
    node = redis_cluster.nodes[0].address
    try:
        before = trio.current_time()
        await trio.sleep(0.01)
        cache._judge(_Trip(replies=[], failed={node: ConnectionError("refused")}), before)
        cache._judge(_Trip(replies=[], answered={node}), before)  # begun before: stale
        assert node in cache._down
        later = trio.current_time()
        cache._judge(_Trip(replies=[], failed={node: ConnectionError("refused")}), later)
        cache._judge(_Trip(replies=[], answered={node}), trio.current_time())
        assert node not in cache._down
    finally:
        await cache.aclose()
    messages = [r.getMessage() for r in caplog.records if node in r.getMessage()]
    assert [m.split(" (")[0] for m in messages] == [
        f"redis cache: Redis Cluster node {node} unavailable",
        f"redis cache: Redis Cluster node {node} answers again",
    ]
