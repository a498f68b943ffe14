"""The ``redis`` cache against a real redis-server: sharing, restarts, outages,
credentials, TLS, batching and the stored format."""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest
import redis
import trio
import trio.lowlevel
import trio.testing
import trustme

import orchestrion
from orchestrion.protocols import CacheUnavailableError
from orchestrion.testing import RedisServer, cached, free_port, model, outcome, tensor

X = np.arange(16, dtype=np.float32)


class Counter:
    """Y = X + 1, counting executions."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, X: Any) -> dict[str, Any]:
        self.calls += 1
        return {"Y": X + 1}


def counted(counter: Counter, name: str = "m", revision: str = "r1") -> orchestrion.Model:
    """The model, as one deploy of it: servers that load it with the same ``revision``
    share its cached answers."""
    m = cached(model(name, counter, [tensor("X")], [tensor("Y")], jit=False))
    return attrs.evolve(m, revision=revision)


def client(server: RedisServer, **kw: Any) -> redis.Redis:
    return redis.Redis(host="127.0.0.1", port=server.port, **kw)


async def wait_until(predicate: Any, what: str) -> None:
    """Poll ``predicate`` for up to 10 s (a real server needs real time)."""
    with trio.move_on_after(10):
        while not predicate():  # noqa: ASYNC110 (state of another process: nothing to wait on)
            await trio.sleep(0.02)
        return
    raise AssertionError(f"timed out waiting for {what}")


async def flush(server: orchestrion.AsyncServer) -> None:
    """Wait until the cache actor has written every queued insert."""
    await wait_until(
        lambda: (s := server.cache_statistics()) is not None and s.queue_depth == 0,
        "the insert queue to drain",
    )
    await trio.testing.wait_all_tasks_blocked(0.01)


async def test_hit_through_redis_stores_data_only_values(redis_server: RedisServer) -> None:
    """A miss is written to Redis under the prefix in orchestrion's format; the next is a hit."""
    counter = Counter()
    async with orchestrion.open_server(
        models=[counted(counter)], cache_config=redis_server.cache_config
    ) as server:
        await server.infer("m", {"X": X})
        await flush(server)
        hit = await server.infer("m", {"X": X})
        stats = server.cache_statistics()
    assert counter.calls == 1
    np.testing.assert_array_equal(hit.outputs["Y"], X + 1)
    assert stats is not None
    assert (stats.hits, stats.misses, stats.insertions) == (1, 1, 1)
    keys = client(redis_server).keys("*")
    assert len(keys) == 1
    assert keys[0].startswith(b"orchestrion:")
    assert len(keys[0]) == 12 + 32
    value = client(redis_server).get(keys[0])
    assert value is not None
    assert value.startswith(b"ORCHCE3\n")
    assert client(redis_server).ttl(keys[0]) == -1  # no TTL unless asked


async def test_a_request_right_after_a_miss_hits(redis_server: RedisServer) -> None:
    """While an insert is still on its way to Redis, its key is answered from the queue."""
    counter = Counter()
    async with orchestrion.open_server(
        models=[counted(counter)], cache_config=redis_server.cache_config
    ) as server:
        for _ in range(5):
            response = await server.infer("m", {"X": X})
            np.testing.assert_array_equal(response.outputs["Y"], X + 1)
        stats = server.cache_statistics()
    assert counter.calls == 1
    assert stats is not None
    assert (stats.hits, stats.misses) == (4, 1)


async def test_two_servers_share_one_redis(redis_server: RedisServer) -> None:
    """What one server computed, another server pointed at the same Redis reuses."""
    first, second = Counter(), Counter()
    config = redis_server.cache_config
    async with (
        orchestrion.open_server(models=[counted(first)], cache_config=config) as a,
        orchestrion.open_server(models=[counted(second)], cache_config=config) as b,
    ):
        await a.infer("m", {"X": X})
        await flush(a)
        response = await b.infer("m", {"X": X})
    np.testing.assert_array_equal(response.outputs["Y"], X + 1)
    assert (first.calls, second.calls) == (1, 0)


async def test_servers_running_other_revisions_never_share_entries(
    redis_server: RedisServer,
) -> None:
    """Two servers on one Redis running different revisions of the model (a rolling deploy),
    or Python models left with their random default revision, compute their own answers."""
    calls = [Counter() for _ in range(4)]
    config = redis_server.cache_config
    deployed = [counted(calls[0], revision="r1"), counted(calls[1], revision="r2")]
    unnamed = [cached(model("m", c, [tensor("X")], [tensor("Y")], jit=False)) for c in calls[2:]]
    for first, second in (deployed, unnamed):
        async with (
            orchestrion.open_server(models=[first], cache_config=config) as a,
            orchestrion.open_server(models=[second], cache_config=config) as b,
        ):
            await a.infer("m", {"X": X})
            await flush(a)
            await b.infer("m", {"X": X})
            await flush(b)
            await a.infer("m", {"X": X})  # each its own entry, served to itself
            await b.infer("m", {"X": X})
    assert [c.calls for c in calls] == [1, 1, 1, 1]


async def test_entries_survive_a_server_restart(redis_server: RedisServer) -> None:
    """Leaving the server writes the queued inserts; a new server hits them."""
    counter = Counter()
    async with orchestrion.open_server(
        models=[counted(counter)], cache_config=redis_server.cache_config
    ) as server:
        await server.infer("m", {"X": X})  # insert still queued when we leave
    async with orchestrion.open_server(
        models=[counted(counter)], cache_config=redis_server.cache_config
    ) as server:
        await server.infer("m", {"X": X})
        stats = server.model_statistics("m")[0]
    assert counter.calls == 1
    assert stats.inference_stats.cache_hit.count == 1
    assert stats.execution_count == 0


async def test_prefixes_keep_deployments_apart_and_ttl_applies(redis_server: RedisServer) -> None:
    """Different prefixes never share entries; ttl sets an expiry on stored keys."""
    first, second = Counter(), Counter()
    base = redis_server.cache_config
    async with (
        orchestrion.open_server(
            models=[counted(first)], cache_config=[*base, "redis,prefix=blue:", "redis,ttl=300"]
        ) as blue,
        orchestrion.open_server(
            models=[counted(second)], cache_config=[*base, "redis,prefix=green:"]
        ) as green,
    ):
        await blue.infer("m", {"X": X})
        await flush(blue)
        await green.infer("m", {"X": X})
        await flush(green)
    assert (first.calls, second.calls) == (1, 1)
    redis_client = client(redis_server)
    (blue_key,) = redis_client.keys("blue:*")
    (green_key,) = redis_client.keys("green:*")
    assert 0 < redis_client.ttl(blue_key) <= 300
    assert redis_client.ttl(green_key) == -1


async def test_identical_concurrent_misses_run_once_through_redis(
    redis_server: RedisServer,
) -> None:
    """Single-flight holds across the Redis round trip too: 16 requests, one execution."""
    gate, calls, results = trio.Event(), [], []

    async def execute(X: Any) -> dict[str, Any]:
        calls.append(1)
        await gate.wait()
        return {"Y": X * 2}

    m = cached(model("slow", execute, [tensor("X")], [tensor("Y")], jit=False, count=16))
    async with orchestrion.open_server(
        models=[m], cache_config=redis_server.cache_config
    ) as server:
        async with trio.open_nursery() as nursery:
            for _ in range(16):
                nursery.start_soon(outcome, server, results, "slow", {"X": X})
            await wait_until(lambda: calls, "the leader to run")
            await trio.testing.wait_all_tasks_blocked()
            gate.set()
        stats = server.cache_statistics()
    assert len(calls) == 1
    for r in results:
        np.testing.assert_array_equal(r.outputs["Y"], X * 2)
    assert stats is not None
    assert stats.coalesced == 15
    assert (stats.lookups, stats.hits) == (16, 15)  # the waiters' answers are hits too


async def test_concurrent_lookups_are_batched(redis_server: RedisServer) -> None:
    """64 concurrent requests with distinct inputs need far fewer round trips than lookups."""
    gate, results = trio.Event(), []

    async def execute(X: Any) -> dict[str, Any]:
        await gate.wait()
        return {"Y": X + 1}

    m = cached(model("m", execute, [tensor("X")], [tensor("Y")], jit=False, count=64))
    async with (
        orchestrion.open_server(
            models=[m], cache_config=[*redis_server.cache_config, "redis,pool_size=2"]
        ) as server,
        trio.open_nursery() as nursery,
    ):
        for i in range(64):
            nursery.start_soon(outcome, server, results, "m", {"X": X + i})
        await wait_until(
            lambda: (s := server.cache_statistics()) is not None and s.lookups == 64,
            "every lookup",
        )
        looked_up = server.cache_statistics()
        gate.set()
    assert looked_up is not None
    assert looked_up.misses == 64
    assert looked_up.batches < 16, looked_up
    for i, r in enumerate(sorted(results, key=lambda r: float(r.outputs["Y"][0]))):
        np.testing.assert_array_equal(r.outputs["Y"], X + i + 1)


async def test_undecodable_values_are_misses(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A value that is not an intact entry (another writer, corruption) is a logged miss."""
    counter = Counter()
    async with orchestrion.open_server(
        models=[counted(counter)], cache_config=redis_server.cache_config
    ) as server:
        await server.infer("m", {"X": X})
        await flush(server)
        redis_client = client(redis_server)
        (key,) = redis_client.keys("orchestrion:*")
        redis_client.set(key, redis_client.get(key)[:-3])  # type: ignore[index]
        response = await server.infer("m", {"X": X})
    np.testing.assert_array_equal(response.outputs["Y"], X + 1)
    assert counter.calls == 2
    assert any("truncated" in r.getMessage() for r in caplog.records)


async def test_redis_outage_under_load(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Redis killed under load: every request is answered correctly, one error is logged;
    when Redis is back, caching resumes by itself."""
    caplog.set_level(logging.INFO, logger="orchestrion.caches")
    counter = Counter()
    answered: list[tuple[int, Any]] = []
    config = [*redis_server.cache_config, "redis,retry_interval=50"]

    async def client_task(server: orchestrion.AsyncServer, rounds: int) -> None:
        for i in range(rounds):
            x = X + (i % 5)
            response = await server.infer("m", {"X": x})
            answered.append((i % 5, response.outputs["Y"]))
            await trio.lowlevel.checkpoint()

    async with orchestrion.open_server(models=[counted(counter)], cache_config=config) as server:
        async with trio.open_nursery() as nursery:
            for _ in range(4):
                nursery.start_soon(client_task, server, 60)
            await wait_until(lambda: len(answered) >= 40, "some answers with Redis up")
            redis_server.kill()
        before = server.cache_statistics()
        async with trio.open_nursery() as nursery:  # and more load while it is down
            for _ in range(4):
                nursery.start_soon(client_task, server, 30)
        assert len(answered) == 360
        for offset, y in answered:
            np.testing.assert_array_equal(y, X + offset + 1)
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 1, [r.getMessage() for r in errors]
        assert "redis cache unavailable" in errors[0].getMessage()
        down = server.cache_statistics()
        assert before is not None
        assert down is not None
        assert not down.available
        assert down.errors >= 1

        redis_server.start()  # same port, empty
        hits = down.hits

        async def hits_resumed() -> bool:
            await server.infer("m", {"X": X})
            stats = server.cache_statistics()
            return stats is not None and stats.available and stats.hits > hits

        with trio.move_on_after(10):
            while not await hits_resumed():  # noqa: ASYNC110 (Redis is another process)
                await trio.sleep(0.02)
        stats = server.cache_statistics()
        assert stats is not None
        assert stats.available
        assert stats.hits > hits
    assert any("available again" in r.getMessage() for r in caplog.records)
    assert len([r for r in caplog.records if r.levelno >= logging.ERROR]) == 1


async def test_a_full_redis_refuses_writes_without_an_outage(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A Redis at maxmemory (noeviction) answers every SET with OOM: lookups still hit, the
    refused entries are counted as not stored, one warning and no error; freed, it stores
    again (and a second refusal soon after is logged at debug level only)."""
    caplog.set_level(logging.DEBUG, logger="orchestrion.caches")
    counter = Counter()

    async def stored(count: int) -> None:
        await wait_until(
            lambda: (
                (s := server.cache_statistics()) is not None
                and s.insertions + s.insert_failures == count
            ),
            f"{count} inserts written or refused",
        )

    async def answered(x: Any) -> None:
        response = await server.infer("m", {"X": x})
        np.testing.assert_array_equal(response.outputs["Y"], x + 1)

    async with orchestrion.open_server(
        models=[counted(counter)], cache_config=redis_server.cache_config
    ) as server:
        await server.infer("m", {"X": X})
        await stored(1)
        redis_server.fill()
        async with trio.open_nursery() as nursery:  # at once: refused SETs share round trips
            for i in range(1, 33):
                nursery.start_soon(answered, X + i)
                nursery.start_soon(answered, X)
        await stored(33)
        full = server.cache_statistics()
        client(redis_server).config_set("maxmemory", 0)
        await server.infer("m", {"X": X - 1})
        await stored(34)
        redis_server.fill()
        await server.infer("m", {"X": X - 2})
        await stored(35)
        stats = server.cache_statistics()
    assert full is not None
    assert full.available
    assert (full.hits, full.misses, full.errors) == (32, 33, 0)
    assert (full.insertions, full.insert_failures) == (1, 32)
    assert stats is not None
    assert (stats.insertions, stats.insert_failures, stats.errors) == (2, 33, 0)
    assert counter.calls == 35
    assert len(client(redis_server).keys("orchestrion:*")) == 2
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "redis cache refused to store responses" in warnings[0]
    assert "OOM command not allowed" in warnings[0]
    assert sum("cache takes writes again" in r.getMessage() for r in caplog.records) == 1
    held = [r for r in caplog.records if "refused to store" in r.getMessage()]
    assert [r.levelno for r in held] == [logging.WARNING, logging.DEBUG]


async def test_unreachable_redis_fails_start_up() -> None:
    """Nothing listening on the port: a clear start-up error."""
    port = free_port()
    with pytest.raises(CacheUnavailableError, match=f"cannot reach Redis at 127.0.0.1:{port}"):
        async with orchestrion.open_server(
            models=[], cache_config=["redis,host=127.0.0.1", f"redis,port={port}"]
        ):
            pass


@pytest.fixture
def secured_redis(tmp_path: Path) -> Any:
    """A Redis that requires a password (default user) and has a user 'alice'."""
    server = RedisServer(
        tmp_path,
        ["--requirepass", "s3cret", "--user", "alice", "on", ">wonder", "~*", "&*", "+@all"],
    )
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.parametrize(
    ("extra", "env", "message"),
    [
        ([], {}, "rejected the credentials"),
        (["redis,password=wrong"], {}, "rejected the credentials"),
        (["redis,user=alice", "redis,password=nope"], {}, "rejected the credentials"),
        ([], {"ORCHESTRION_REDIS_PASSWORD": "wrong"}, "rejected the credentials"),
    ],
)
async def test_wrong_credentials_fail_start_up(
    secured_redis: RedisServer,
    monkeypatch: pytest.MonkeyPatch,
    extra: list[str],
    env: dict[str, str],
    message: str,
) -> None:
    """NOAUTH and WRONGPASS become a start-up error that names the problem."""
    for name in (
        "ORCHESTRION_REDIS_USERNAME",
        "ORCHESTRION_REDIS_PASSWORD",
        "TRITONCACHE_REDIS_USERNAME",
        "TRITONCACHE_REDIS_PASSWORD",
    ):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(CacheUnavailableError, match=message):
        async with orchestrion.open_server(
            models=[], cache_config=[*secured_redis.cache_config, *extra]
        ):
            pass


@pytest.mark.parametrize(
    ("extra", "env"),
    [
        (["redis,password=s3cret"], {}),
        (["redis,user=alice", "redis,password=wonder"], {}),
        ([], {"ORCHESTRION_REDIS_PASSWORD": "s3cret"}),
        ([], {"TRITONCACHE_REDIS_USERNAME": "alice", "TRITONCACHE_REDIS_PASSWORD": "wonder"}),
    ],
)
async def test_credentials_from_flags_or_environment(
    secured_redis: RedisServer,
    monkeypatch: pytest.MonkeyPatch,
    extra: list[str],
    env: dict[str, str],
) -> None:
    """user/password come from the flags, orchestrion's variables or Triton's."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    counter = Counter()
    async with orchestrion.open_server(
        models=[counted(counter)], cache_config=[*secured_redis.cache_config, *extra]
    ) as server:
        await server.infer("m", {"X": X})
        await flush(server)
        await server.infer("m", {"X": X})
    assert counter.calls == 1


@pytest.fixture(scope="module")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A throwaway CA, a server certificate for 127.0.0.1 and a client certificate."""
    folder = tmp_path_factory.mktemp("tls")
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(folder / "ca.pem"))
    server = ca.issue_cert("127.0.0.1", "localhost")
    server.private_key_pem.write_to_path(str(folder / "server.key"))
    server.cert_chain_pems[0].write_to_path(str(folder / "server.pem"))
    client_cert = ca.issue_cert("orchestrion-client")
    client_cert.private_key_pem.write_to_path(str(folder / "client.key"))
    client_cert.cert_chain_pems[0].write_to_path(str(folder / "client.pem"))
    return {p.stem + p.suffix: str(p) for p in folder.iterdir()}


async def test_tls_with_client_certificates(tmp_path: Path, certificates: dict[str, str]) -> None:
    """tls_enabled with cert, key and cacert talks to a TLS-only Redis (mutual TLS)."""
    server = RedisServer(
        tmp_path,
        [
            "--tls-cert-file",
            certificates["server.pem"],
            "--tls-key-file",
            certificates["server.key"],
            "--tls-ca-cert-file",
            certificates["ca.pem"],
        ],
        tls=True,
    )
    server.start()
    try:
        counter = Counter()
        tls = [
            "redis,tls_enabled=true",
            f"redis,cert={certificates['client.pem']}",
            f"redis,key={certificates['client.key']}",
            f"redis,cacert={certificates['ca.pem']}",
        ]
        async with orchestrion.open_server(
            models=[counted(counter)], cache_config=[*server.cache_config, *tls]
        ) as orch:
            await orch.infer("m", {"X": X})
            await flush(orch)
            await orch.infer("m", {"X": X})
        assert counter.calls == 1
        with pytest.raises(CacheUnavailableError, match="cannot reach Redis"):
            async with orchestrion.open_server(models=[], cache_config=server.cache_config):
                pass
    finally:
        server.stop()


def plus_one() -> orchestrion.Model:
    return cached(model("m", lambda X: {"Y": X + 1}, [tensor("X")], [tensor("Y")], jit=False))


async def test_a_hung_redis_holds_a_request_for_at_most_socket_timeout(
    redis_server: RedisServer,
) -> None:
    """With Redis stopped (SIGSTOP), a request waits about socket_timeout, not twice that."""
    config = [*redis_server.cache_config, "redis,socket_timeout=1000"]
    assert redis_server.process is not None
    pid = redis_server.process.pid
    async with orchestrion.open_server(models=[plus_one()], cache_config=config) as server:
        await server.infer("m", {"X": X})
        os.kill(pid, signal.SIGSTOP)
        try:
            start = time.monotonic()
            response = await server.infer("m", {"X": X + 1})
            took = time.monotonic() - start
        finally:
            os.kill(pid, signal.SIGCONT)
    np.testing.assert_array_equal(response.outputs["Y"], X + 2)
    assert took < 1.6, f"a request took {took:.2f} s with socket_timeout=1 s (2 s: retried)"


async def test_requests_during_an_outage_probe_are_served_uncached_at_once(
    redis_server: RedisServer,
) -> None:
    """While Redis is known to be down, only one request probes it; the others do not wait."""
    config = [
        *redis_server.cache_config,
        "redis,socket_timeout=300",
        "redis,retry_interval=100",
        "redis,pool_size=1",
    ]
    assert redis_server.process is not None
    pid = redis_server.process.pid
    finished: list[str] = []

    async def one(server: orchestrion.AsyncServer, x: Any, name: str) -> None:
        await server.infer("m", {"X": x})
        finished.append(name)

    async with orchestrion.open_server(models=[plus_one()], cache_config=config) as server:
        os.kill(pid, signal.SIGSTOP)
        try:
            await server.infer("m", {"X": X})  # finds the outage
            stats = server.cache_statistics()
            assert stats is not None
            assert not stats.available
            await trio.sleep(0.15)  # past retry_interval: the next request probes Redis
            async with trio.open_nursery() as nursery:
                nursery.start_soon(one, server, X + 1, "probe")
                await trio.sleep(0.02)
                for i in range(4):
                    nursery.start_soon(one, server, X + 10 + i, f"request {i}")
        finally:
            os.kill(pid, signal.SIGCONT)
    # The probe hangs for its socket timeout; the others were answered uncached before it.
    assert finished[-1] == "probe", finished


async def test_closing_the_server_closes_its_redis_connections(
    redis_server: RedisServer,
) -> None:
    """After open_server exits, no connection of its cache is left open on Redis."""
    async with orchestrion.open_server(
        models=[plus_one()], cache_config=redis_server.cache_config
    ) as server:
        await server.infer("m", {"X": X})
        await server.infer("m", {"X": X + 1})
    monitor = redis.Redis(host="127.0.0.1", port=redis_server.port)
    try:
        monitor.client_setname("monitor")
        others = [c for c in monitor.client_list() if c["name"] != "monitor"]
    finally:
        monitor.close()
    assert server is not None  # the caller still holds the server (for its statistics)
    assert others == [], f"{len(others)} connection(s) still open after the server closed"
