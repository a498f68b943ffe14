"""The response cache in a server (the `local` cache): hits, misses, statistics, what is
cached where, LRU eviction, single-flight, and start-up errors."""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np
import pytest
import trio
import trio.lowlevel
import trio.testing

import orchestrion
import orchestrion._server
from orchestrion.caches import LocalCache, ResponseCache
from orchestrion.protocols import (
    CacheEntry,
    CacheKey,
    ConfigError,
    InferenceError,
    InferenceTimeoutError,
    Observer,
    cache_key,
    entry_cost,
    frozen_outputs,
)
from orchestrion.testing import cached, chain, ensemble, model, outcome, step, tensor

LOCAL = "local,size=1048576"
X = np.arange(16, dtype=np.float32)


class Counter:
    """A plain model that counts its executions: Y = X + delta."""

    def __init__(self, delta: float = 1.0) -> None:
        self.calls = 0
        self.delta = delta

    def __call__(self, X: Any) -> dict[str, Any]:
        self.calls += 1
        return {"Y": X + self.delta}


def counted(name: str, counter: Counter, **kw: Any) -> orchestrion.Model:
    return model(name, counter, [tensor("X")], [tensor("Y")], jit=False, **kw)


def stats(server: orchestrion.AsyncServer, name: str) -> orchestrion.ModelStatistics:
    return server.model_statistics(name)[0]


async def test_hit_returns_the_stored_result_without_running() -> None:
    """The second identical request is a hit: success, not an inference or an execution."""
    counter = Counter()
    async with orchestrion.open_server(
        models=[cached(counted("m", counter))], cache_config=LOCAL
    ) as server:
        first = await server.infer("m", {"X": X}, request_id="a")
        second = await server.infer("m", {"X": X}, request_id="b")
        s, c = stats(server, "m"), server.cache_statistics()
    assert counter.calls == 1
    np.testing.assert_array_equal(second.outputs["Y"], X + 1)
    np.testing.assert_array_equal(first.outputs["Y"], X + 1)
    assert (second.request_id, second.model_name, second.model_version) == ("b", "m", 1)
    assert s.inference_stats.success.count == 2
    assert (s.inference_count, s.execution_count) == (1, 1)
    assert s.inference_stats.cache_hit.count == 1
    assert s.inference_stats.cache_miss.count == 1
    assert s.inference_stats.cache_hit.ns > 0
    assert s.inference_stats.cache_miss.ns > 0
    assert c is not None
    assert (c.name, c.lookups, c.hits, c.misses, c.insertions, c.entries) == (
        "local",
        2,
        1,
        1,
        1,
        1,
    )
    assert c.used_bytes is not None
    assert 0 < c.used_bytes <= 1048576
    assert c.utilization == c.used_bytes / 1048576


async def test_changed_bytes_or_shape_miss_and_input_order_does_not_matter() -> None:
    """Any changed byte or shape misses; the same inputs in another order hit."""
    calls = []

    def add(A: Any, B: Any) -> dict[str, Any]:
        calls.append(1)
        return {"S": A + B}

    adder = cached(
        model(
            "add",
            add,
            [tensor("A", dims=(-1,)), tensor("B", dims=(-1,))],
            [tensor("S", dims=(-1,))],
            jit=False,
        )
    )
    a, b = np.arange(4, dtype=np.float32), np.ones(4, np.float32)
    async with orchestrion.open_server(models=[adder], cache_config=LOCAL) as server:
        await server.infer("add", {"A": a, "B": b})
        await server.infer("add", {"B": b, "A": a})  # order: hit
        assert len(calls) == 1
        changed = a.copy()
        changed.view(np.uint8)[5] ^= 1
        await server.infer("add", {"A": changed, "B": b})  # one byte: miss
        await server.infer("add", {"A": a[:2], "B": b[:2]})  # shape: miss
        longer = np.concatenate([a, [0]]).astype(np.float32)
        await server.infer("add", {"A": longer, "B": np.ones(5, np.float32)})
        assert len(calls) == 4


async def test_errors_are_never_cached() -> None:
    """A failed request stores nothing: the next identical one runs the model again."""
    calls = []

    def flaky(X: Any) -> dict[str, Any]:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("first call fails")
        return {"Y": X * 3}

    m = cached(model("flaky", flaky, [tensor("X")], [tensor("Y")], jit=False))
    async with orchestrion.open_server(models=[m], cache_config=LOCAL) as server:
        with pytest.raises(InferenceError, match="first call fails"):
            await server.infer("flaky", {"X": X})
        ok = await server.infer("flaky", {"X": X})
        again = await server.infer("flaky", {"X": X})
        s = stats(server, "flaky")
    assert len(calls) == 2
    np.testing.assert_array_equal(ok.outputs["Y"], X * 3)
    np.testing.assert_array_equal(again.outputs["Y"], X * 3)
    assert (s.inference_stats.fail.count, s.inference_stats.success.count) == (1, 2)
    assert (s.inference_stats.cache_miss.count, s.inference_stats.cache_hit.count) == (2, 1)


async def test_enable_without_a_server_cache_runs_uncached() -> None:
    """response_cache on a server with no cache configured: the model just runs (Triton)."""
    counter = Counter()
    async with orchestrion.open_server(models=[cached(counted("m", counter))]) as server:
        await server.infer("m", {"X": X})
        await server.infer("m", {"X": X})
        assert server.cache_statistics() is None
        s = stats(server, "m")
    assert counter.calls == 2
    assert s.inference_stats.cache_hit.count == s.inference_stats.cache_miss.count == 0


async def test_models_without_response_cache_are_not_cached() -> None:
    """A server cache alone caches nothing: each model opts in."""
    counter = Counter()
    async with orchestrion.open_server(
        models=[counted("m", counter)], cache_config=LOCAL
    ) as server:
        await server.infer("m", {"X": X})
        await server.infer("m", {"X": X})
        c = server.cache_statistics()
    assert counter.calls == 2
    assert c is not None
    assert c.lookups == 0


def pipeline(
    first: Counter, second: Counter, *, ensemble_cache: bool, model_cache: bool
) -> list[orchestrion.Model]:
    a = counted("a", first)
    b = counted("b", second)
    pipe = chain("pipe", "a", "b")
    return [
        cached(a, model_cache),
        cached(b, model_cache),
        cached(pipe, ensemble_cache),
    ]


async def test_ensemble_only_caching_skips_every_step() -> None:
    """An ensemble hit runs no composing model; a miss stores the final response."""
    first, second = Counter(1), Counter(10)
    models = pipeline(first, second, ensemble_cache=True, model_cache=False)
    async with orchestrion.open_server(models=models, cache_config=LOCAL) as server:
        one = await server.infer("pipe", {"IN": X})
        two = await server.infer("pipe", {"IN": X})
        pipe, a = stats(server, "pipe"), stats(server, "a")
    np.testing.assert_array_equal(one.outputs["OUT"], X + 11)
    np.testing.assert_array_equal(two.outputs["OUT"], X + 11)
    assert (first.calls, second.calls) == (1, 1)
    assert a.inference_stats.success.count == 1  # the hit never reached it
    assert pipe.inference_stats.success.count == 2
    assert (pipe.inference_stats.cache_hit.count, pipe.inference_stats.cache_miss.count) == (1, 1)
    assert pipe.inference_count == 1


async def test_composing_only_caching() -> None:
    """Composing models cache on their own when the ensemble does not."""
    first, second = Counter(1), Counter(10)
    models = pipeline(first, second, ensemble_cache=False, model_cache=True)
    async with orchestrion.open_server(models=models, cache_config=LOCAL) as server:
        for _ in range(3):
            response = await server.infer("pipe", {"IN": X})
            np.testing.assert_array_equal(response.outputs["OUT"], X + 11)
        pipe, a, b = stats(server, "pipe"), stats(server, "a"), stats(server, "b")
    assert (first.calls, second.calls) == (1, 1)
    assert pipe.inference_stats.success.count == 3
    assert pipe.inference_stats.cache_hit.count == pipe.inference_stats.cache_miss.count == 0
    for s in (a, b):
        assert (s.inference_stats.cache_hit.count, s.inference_stats.cache_miss.count) == (2, 1)
        assert s.inference_stats.success.count == 3


async def test_both_levels_cache_independently() -> None:
    """With both levels on, an ensemble hit stops at the ensemble; composing models keep
    their own entries, which direct requests then hit."""
    first, second = Counter(1), Counter(10)
    models = pipeline(first, second, ensemble_cache=True, model_cache=True)
    async with orchestrion.open_server(models=models, cache_config=LOCAL) as server:
        await server.infer("pipe", {"IN": X})
        await server.infer("pipe", {"IN": X})
        direct = await server.infer("a", {"X": X})
        a, pipe = stats(server, "a"), stats(server, "pipe")
        c = server.cache_statistics()
    np.testing.assert_array_equal(direct.outputs["Y"], X + 1)
    assert (first.calls, second.calls) == (1, 1)
    assert (a.inference_stats.cache_miss.count, a.inference_stats.cache_hit.count) == (1, 1)
    assert (pipe.inference_stats.cache_miss.count, pipe.inference_stats.cache_hit.count) == (1, 1)
    assert c is not None
    assert c.entries == 3


async def test_requested_outputs_are_part_of_the_key() -> None:
    """Each set of requested outputs has its own entry; naming every output is 'all'."""
    calls = []

    def two(X: Any) -> dict[str, Any]:
        calls.append(1)
        return {"Y": X + 1, "Z": X * 2}

    m = cached(model("two", two, [tensor("X")], [tensor("Y"), tensor("Z")], jit=False))
    async with orchestrion.open_server(models=[m], cache_config=LOCAL) as server:
        only_y = await server.infer("two", {"X": X}, outputs=["Y"])
        only_y_again = await server.infer("two", {"X": X}, outputs=["Y"])
        assert len(calls) == 1
        both = await server.infer("two", {"X": X})
        both_by_name = await server.infer("two", {"X": X}, outputs=["Z", "Y"])
        assert len(calls) == 2
        only_z = await server.infer("two", {"X": X}, outputs=["Z"])
        assert len(calls) == 3
    assert set(only_y.outputs) == set(only_y_again.outputs) == {"Y"}
    assert set(both.outputs) == set(both_by_name.outputs) == {"Y", "Z"}
    assert set(only_z.outputs) == {"Z"}
    np.testing.assert_array_equal(only_z.outputs["Z"], X * 2)


async def test_a_cached_ensemble_still_prunes() -> None:
    """A miss runs only the steps the request needs, as uncached: a failing branch nobody
    asked for neither runs nor fails the request; asking for it fails, uncached."""
    counter = Counter(1)

    def bad(X: Any) -> dict[str, Any]:
        raise RuntimeError("bad branch")

    models = [
        counted("a", counter),
        model("bad", bad, [tensor("X")], [tensor("Y")], jit=False),
        cached(
            ensemble(
                "fan",
                [tensor("IN")],
                [tensor("P"), tensor("N")],
                [step("a", {"X": "IN"}, {"Y": "P"}), step("bad", {"X": "IN"}, {"Y": "N"})],
            )
        ),
    ]
    async with orchestrion.open_server(models=models, cache_config=LOCAL) as server:
        for _ in range(2):
            only_p = await server.infer("fan", {"IN": X}, outputs=["P"])
            np.testing.assert_array_equal(only_p.outputs["P"], X + 1)
        assert counter.calls == 1  # the second was a hit
        for _ in range(2):
            with pytest.raises(InferenceError, match="bad branch"):
                await server.infer("fan", {"IN": X})
        fan = stats(server, "fan")
    assert (fan.inference_stats.cache_hit.count, fan.inference_stats.fail.count) == (1, 2)


async def test_callers_cannot_corrupt_an_entry() -> None:
    """The miss's caller keeps writable arrays of its own; hits get read-only views."""
    counter = Counter()
    async with orchestrion.open_server(
        models=[cached(counted("m", counter))], cache_config=LOCAL
    ) as server:
        first = await server.infer("m", {"X": X})
        first.outputs["Y"][:] = -1  # the caller's own array
        hit = await server.infer("m", {"X": X})
        with pytest.raises(ValueError, match="read-only"):
            hit.outputs["Y"][0] = 7
        again = await server.infer("m", {"X": X})
    np.testing.assert_array_equal(again.outputs["Y"], X + 1)


async def test_versions_do_not_share_entries() -> None:
    """The resolved version is part of the key."""
    one, two = Counter(1), Counter(2)
    models = [cached(counted("m", one, version=1)), cached(counted("m", two, version=2))]
    async with orchestrion.open_server(models=models, cache_config=LOCAL) as server:
        r1 = await server.infer("m", {"X": X}, model_version=1)
        r2 = await server.infer("m", {"X": X}, model_version=2)
        latest = await server.infer("m", {"X": X})
    np.testing.assert_array_equal(r1.outputs["Y"], X + 1)
    np.testing.assert_array_equal(r2.outputs["Y"], X + 2)
    np.testing.assert_array_equal(latest.outputs["Y"], X + 2)
    assert (one.calls, two.calls) == (1, 1)


# -- LRU and sizes -------------------------------------------------------------------------


def entry(tag: int) -> CacheEntry:
    key = cache_key("m", 1, {"X": np.full(4, tag, np.float32)})
    return CacheEntry(key=key, outputs=frozen_outputs({"Y": np.full(64, tag, np.float32)}))


def test_local_cache_is_strict_lru() -> None:
    """A, B; C evicts A; touch B; D evicts C (not B)."""
    a, b, c, d = (entry(i) for i in range(4))
    cost = entry_cost(a) + 100  # what the cache charges per entry (slot included)
    cache = LocalCache(2 * cost + cost // 2)
    cache.insert_nowait(a)
    cache.insert_nowait(b)
    cache.insert_nowait(c)
    assert cache.lookup_nowait(a.key) is None
    assert cache.lookup_nowait(b.key) is b  # touch B
    cache.insert_nowait(d)
    assert cache.lookup_nowait(c.key) is None
    assert cache.lookup_nowait(b.key) is b
    assert cache.lookup_nowait(d.key) is d
    usage = cache.usage()
    assert (usage.entries, usage.evictions, usage.used_bytes) == (2, 2, 2 * cost)


def test_local_cache_replaces_an_entry_without_double_counting() -> None:
    """Inserting the same key again replaces the entry and its byte charge."""
    a = entry(1)
    cache = LocalCache(1 << 20)
    cache.insert_nowait(a)
    cache.insert_nowait(a)
    usage = cache.usage()
    assert (usage.entries, usage.used_bytes) == (1, entry_cost(a) + 100)


def test_entry_cost_counts_the_objects_around_the_data() -> None:
    """An entry's charge is more than its tensor bytes, and grows with them."""
    small, big = (
        entry(1),
        CacheEntry(key=entry(1).key, outputs=frozen_outputs({"Y": np.zeros(1024, np.float32)})),
    )
    assert entry_cost(small) > small.nbytes + 200
    assert entry_cost(big) - entry_cost(small) == big.nbytes - small.nbytes


async def test_oversized_entry_is_not_stored_and_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A response larger than the whole cache is not stored; a warning says so once."""
    calls = []

    def big(X: Any) -> dict[str, Any]:
        calls.append(1)
        return {"Y": np.zeros(4096, np.float32) + X[0]}

    m = cached(model("big", big, [tensor("X")], [tensor("Y", dims=(4096,))], jit=False))
    async with orchestrion.open_server(models=[m], cache_config="local,size=2048") as server:
        for _ in range(3):
            await server.infer("big", {"X": X})
        c = server.cache_statistics()
    assert len(calls) == 3
    assert c is not None
    assert (c.entries, c.misses, c.hits) == (0, 3, 0)
    warnings = [r for r in caplog.records if "more than the whole cache" in r.getMessage()]
    assert len([r for r in warnings if r.levelno == logging.WARNING]) == 1


async def test_lru_evictions_through_the_server() -> None:
    """A small cache keeps the recently used responses and counts evictions."""
    counter = Counter()
    async with orchestrion.open_server(
        models=[cached(counted("m", counter))], cache_config="local,size=3000"
    ) as server:
        inputs = [np.full(16, i, np.float32) for i in range(6)]
        for x in inputs:
            await server.infer("m", {"X": x})
        c = server.cache_statistics()
        assert c is not None
        assert c.evictions is not None
        assert c.evictions > 0
        assert c.entries is not None
        assert c.entries + c.evictions == 6
        await server.infer("m", {"X": inputs[-1]})  # the newest is still there
        assert counter.calls == 6
        await server.infer("m", {"X": inputs[0]})  # the oldest is gone
        assert counter.calls == 7
        assert c.used_bytes is not None
        assert c.used_bytes <= 3000


# -- single-flight ---------------------------------------------------------------------------


def gate_model(name: str, gate: trio.Event, calls: list[int], fail_first: bool = False) -> Any:
    async def execute(X: Any) -> dict[str, Any]:
        calls.append(1)
        await gate.wait()
        if fail_first and len(calls) == 1:
            raise RuntimeError("leader failed")
        return {"Y": X + 5}

    return cached(model(name, execute, [tensor("X")], [tensor("Y")], jit=False, count=16))


async def test_identical_concurrent_misses_run_the_model_once() -> None:
    """16 identical concurrent requests: one execution, 16 correct answers."""
    gate, calls, results = trio.Event(), [], []
    m = gate_model("slow", gate, calls)
    async with orchestrion.open_server(models=[m], cache_config=LOCAL) as server:
        async with trio.open_nursery() as nursery:
            for _ in range(16):
                nursery.start_soon(outcome, server, results, "slow", {"X": X})
            await trio.testing.wait_all_tasks_blocked()
            gate.set()
        s, c = stats(server, "slow"), server.cache_statistics()
    assert len(calls) == 1
    assert len(results) == 16
    for r in results:
        np.testing.assert_array_equal(r.outputs["Y"], X + 5)
    assert s.execution_count == 1
    assert s.inference_stats.success.count == 16
    assert (s.inference_stats.cache_miss.count, s.inference_stats.cache_hit.count) == (1, 15)
    assert c is not None
    assert c.coalesced == 15


async def test_a_failed_leader_is_not_shared() -> None:
    """When the request the others wait for fails, they run the model themselves."""
    gate, calls, results = trio.Event(), [], []
    m = gate_model("slow", gate, calls, fail_first=True)
    async with orchestrion.open_server(models=[m], cache_config=LOCAL) as server:
        async with trio.open_nursery() as nursery:
            for _ in range(8):
                nursery.start_soon(outcome, server, results, "slow", {"X": X})
            await trio.testing.wait_all_tasks_blocked()
            gate.set()
        s = stats(server, "slow")
    errors = [r for r in results if isinstance(r, Exception)]
    answers = [r for r in results if not isinstance(r, Exception)]
    assert len(errors) == 1
    assert isinstance(errors[0], InferenceError)
    assert len(answers) == 7
    for r in answers:
        np.testing.assert_array_equal(r.outputs["Y"], X + 5)
    assert len(calls) == 2  # not handed to the others: one of them led again
    assert (s.inference_stats.fail.count, s.inference_stats.success.count) == (1, 7)


async def test_a_leader_that_times_out_does_not_fail_the_others(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The leader's timeout cancels only the leader; the waiting requests still answer."""
    calls: list[int] = []

    async def execute(X: Any) -> dict[str, Any]:
        calls.append(1)
        await trio.sleep(10)
        return {"Y": X + 5}

    m = cached(model("slow", execute, [tensor("X")], [tensor("Y")], jit=False, count=4))
    results: list[Any] = []
    async with orchestrion.open_server(models=[m], cache_config=LOCAL) as server:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                functools.partial(outcome, timeout=1), server, results, "slow", {"X": X}
            )
            await trio.testing.wait_all_tasks_blocked()
            for _ in range(3):
                nursery.start_soon(outcome, server, results, "slow", {"X": X})
        assert_ok = [r for r in results if not isinstance(r, Exception)]
    assert isinstance(results[0], InferenceTimeoutError)
    assert len(assert_ok) == 3


async def test_a_local_hit_is_a_checkpoint() -> None:
    """A hit never blocks: it still honours cancellation and lets other tasks run."""
    counter = Counter()
    turns = 0

    async def sibling() -> None:
        nonlocal turns
        while True:
            turns += 1
            await trio.lowlevel.checkpoint()

    async with orchestrion.open_server(
        models=[cached(counted("m", counter))], cache_config=LOCAL
    ) as server:
        await server.infer("m", {"X": X})
        with trio.CancelScope() as scope:
            scope.cancel()
            await server.infer("m", {"X": X})
        assert scope.cancelled_caught
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sibling)
            await trio.lowlevel.checkpoint()
            before = turns
            for _ in range(10):
                await server.infer("m", {"X": X})
            assert turns - before >= 5
            nursery.cancel_scope.cancel()
        s = stats(server, "m")
    assert counter.calls == 1
    assert s.inference_stats.fail.count == 1  # the cancelled hit


# -- observers and interfaces ------------------------------------------------------------------


async def test_observers_see_cache_lookups() -> None:
    """Observers get one cache_looked_up event per cached request, hit or not."""
    seen: list[tuple[str, bool]] = []

    class Watch(Observer):
        def cache_looked_up(
            self, model_name: str, version: int, request: Any, hit: bool, duration_ns: int
        ) -> None:
            assert duration_ns >= 0
            seen.append((model_name, hit))

    async with orchestrion.open_server(
        models=[cached(counted("m", Counter()))], cache_config=LOCAL, observers=[Watch()]
    ) as server:
        await server.infer("m", {"X": X})
        await server.infer("m", {"X": X})
    assert seen == [("m", False), ("m", True)]


def test_blocking_server_with_a_cache() -> None:
    """The blocking facade takes cache_config and reports cache statistics."""
    counter = Counter()
    with orchestrion.Server(models=[cached(counted("m", counter))], cache_config=LOCAL) as server:
        server.infer("m", {"X": X})
        server.infer("m", {"X": X})
        c = server.cache_statistics()
    assert counter.calls == 1
    assert c is not None
    assert c.hits == 1


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ("nosuch,size=1", "no cache named 'nosuch' is installed (installed: local, redis"),
        ("local,bytes=1", "unknown key 'bytes' (known: size)"),
        ("local,size=", "'size' must be an integer"),
        ("local,size=lots", "'size' must be an integer"),
        ("local,size=100", "cannot hold any entry"),
        ("local,size=0", "cannot hold any entry"),
        ("redis,host=localhost", "'port' required"),
        (["redis,host=h", "redis,port=x"], "'port' must be an integer"),
        (["redis,host=h", "redis,port=1", "redis,pool_size=0"], "'pool_size' must be at least 1"),
        (["redis,host=h", "redis,port=1", "redis,cert=/x"], "need tls_enabled=true"),
        (
            ["redis,host=h", "redis,port=1", "redis,tls_enabled=yes", "redis,cacert=/no/file"],
            "cacert=/no/file: no such file",
        ),
        (["redis,host=h", "redis,port=1", "redis,tls_enabled=maybe"], "must be true or false"),
        ("local", "malformed"),
    ],
)
async def test_cache_settings_errors_at_start_up(config: Any, message: str) -> None:
    """Bad cache settings stop the server at start-up with a message naming the flag."""
    with pytest.raises(ConfigError, match=re.escape(message)):
        async with orchestrion.open_server(models=[], cache_config=config):
            pass


# -- single-flight after a cancelled or failed leader (batched cache) ------------------


class GatedCache(ResponseCache):
    """A batched (non-immediate) cache whose lookups wait for ``gate``."""

    def __init__(self) -> None:
        self.entries: dict[bytes, CacheEntry] = {}
        self.gate = trio.Event()

    async def lookup(self, keys: Sequence[CacheKey]) -> Sequence[CacheEntry | None]:
        await self.gate.wait()
        return [self.entries.get(k.digest) for k in keys]

    async def insert(self, entries: Sequence[CacheEntry]) -> None:
        for entry in entries:
            self.entries[entry.key.digest] = entry

    async def aclose(self) -> None:
        pass


async def test_followers_of_a_cancelled_leader_still_get_the_stored_entry(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The leader is cancelled during its lookup: the 8 identical requests waiting on it
    are answered from the entry the cache holds, without running the model."""
    cache = GatedCache()
    key = cache_key("m", 1, {"X": X}, revision="stored")
    cache.entries[key.digest] = CacheEntry(key=key, outputs=frozen_outputs({"Y": X + 1}))

    async def open_gated(settings: Any) -> ResponseCache:
        return cache

    monkeypatch.setattr(orchestrion._server, "open_cache", open_gated)
    calls: list[int] = []

    def execute(X: Any) -> dict[str, Any]:
        calls.append(1)
        return {"Y": X + 1}

    m = cached(model("m", execute, [tensor("X")], [tensor("Y")], jit=False))
    m = attrs.evolve(m, revision="stored")  # the revision the stored entry was made by
    async with orchestrion.open_server(models=[m], cache_config="gated,x=1") as server:
        async with trio.open_nursery() as nursery:
            leader = trio.CancelScope()

            async def lead() -> None:
                with leader:
                    await server.infer("m", {"X": X})

            nursery.start_soon(lead)
            await trio.testing.wait_all_tasks_blocked()
            for _ in range(8):
                nursery.start_soon(server.infer, "m", {"X": X})
            await trio.testing.wait_all_tasks_blocked()
            leader.cancel()
            await trio.testing.wait_all_tasks_blocked()
            cache.gate.set()
        hits = server.model_statistics("m")[0].inference_stats.cache_hit.count
    assert (len(calls), hits) == (0, 8)


def test_throttled_warnings_hold_back_and_count_repeats(caplog: pytest.LogCaptureFixture) -> None:
    """A warning that repeats is logged once per window; the ones held back go to DEBUG and
    are counted into the next warning."""
    from orchestrion.caches._actor import Throttled

    caplog.set_level(logging.DEBUG, logger="test.throttled")
    throttled = Throttled(logging.getLogger("test.throttled"), every=3600.0)
    for n in range(3):
        throttled.warning("bad entry %d", n)
    levels = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert levels == [
        (logging.WARNING, "bad entry 0"),
        (logging.DEBUG, "bad entry 1"),
        (logging.DEBUG, "bad entry 2"),
    ]
    throttled._next_at = 0.0  # the window has passed
    throttled.warning("bad entry %d", 3)
    assert caplog.records[-1].levelno == logging.WARNING
    assert caplog.records[-1].getMessage() == "bad entry 3 (and 2 more like it in the last 3600 s)"
