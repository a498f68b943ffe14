"""The contract every `ResponseCache` keeps, run on all three implementations found through
the ``orchestrion.caches`` entry points: ``local``, ``redis`` and the third-party example in
``examples/sqlite_cache`` (registered here through a dist-info folder, as pip would)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import trio

import orchestrion
from orchestrion.caches import (
    CacheUsage,
    ResponseCache,
    available_caches,
    open_cache,
    open_cache_actor,
)
from orchestrion.protocols import (
    CacheEntry,
    InferResponse,
    cache_key,
    frozen_outputs,
)
from orchestrion.testing import RedisServer, cached, model, tensor

EXAMPLE = Path(__file__).parents[2] / "examples" / "sqlite_cache"
KINDS = ["local", "redis", "sqlite"]


@pytest.fixture
def sqlite_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the example plugin importable and visible to importlib.metadata."""
    site = tmp_path / "site"
    info = site / "orchestrion_sqlite_cache-0.1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: orchestrion-sqlite-cache\nVersion: 0.1.0\n"
    )
    (info / "entry_points.txt").write_text(
        "[orchestrion.caches]\nsqlite = orchestrion_sqlite_cache:open_sqlite_cache\n"
    )
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.syspath_prepend(str(EXAMPLE))


@pytest.fixture(params=KINDS)
def cache_config(request: pytest.FixtureRequest, tmp_path: Path, sqlite_plugin: None) -> Any:
    """``--cache-config`` values for each implementation (Redis started for the test)."""
    kind = request.param
    if kind == "local":
        yield ["local,size=1048576"]
    elif kind == "sqlite":
        yield [f"sqlite,path={tmp_path / 'cache.db'}"]
    else:
        server = RedisServer(tmp_path)
        server.start()
        try:
            yield server.cache_config
        finally:
            server.stop()


async def opened(flags: list[str]) -> ResponseCache:
    settings = orchestrion.protocols.parse_cache_config(flags)
    assert settings is not None
    return await open_cache(settings)


def make_entry(tag: float, **outputs: Any) -> CacheEntry:
    key = cache_key("m", 1, {"X": np.full(4, tag, np.float32)}, revision="contract")
    return CacheEntry(
        key=key, outputs=frozen_outputs(outputs or {"Y": np.full(8, tag, np.float32)})
    )


def same(a: CacheEntry | None, b: CacheEntry) -> None:
    assert a is not None
    assert a.matches(b.key)
    assert a.key == b.key
    assert list(a.outputs) == list(b.outputs)
    for name, array in b.outputs.items():
        got = a.outputs[name]
        assert (got.dtype, got.shape) == (array.dtype, array.shape)
        if array.dtype.kind == "O":
            assert got.tolist() == array.tolist()
        else:
            np.testing.assert_array_equal(got, array)


def test_every_cache_is_installed_as_an_entry_point(sqlite_plugin: None) -> None:
    """local and redis come with orchestrion; the example registers like any plugin."""
    assert {"local", "redis", "sqlite"} <= set(available_caches())


async def test_lookup_of_an_empty_cache_misses(cache_config: list[str]) -> None:
    """Nothing stored: every key of a batch is None."""
    cache = await opened(cache_config)
    try:
        found = await cache.lookup([make_entry(1).key, make_entry(2).key])
        assert list(found) == [None, None]
        assert isinstance(cache.usage(), CacheUsage)
    finally:
        await cache.aclose()


async def test_insert_then_lookup_round_trips(cache_config: list[str]) -> None:
    """What is inserted comes back equal: the key (revision included) and tensors of every
    kind."""
    entries = [
        make_entry(1),
        make_entry(
            2,
            S=np.array([[b"", b"a"], [b"\x00\xff", b"long" * 50]], dtype=object),
            B=np.arange(6, dtype=np.float32).astype(ml_dtypes.bfloat16).reshape(2, 3),
            E=np.zeros((0, 3), np.int64),
            Z=np.array(True),
        ),
    ]
    cache = await opened(cache_config)
    try:
        await cache.insert(entries)
        found = await cache.lookup([e.key for e in entries])
        for got, expected in zip(found, entries, strict=True):
            same(got, expected)
    finally:
        await cache.aclose()


async def test_batches_keep_their_order(cache_config: list[str]) -> None:
    """A batch of lookups answers each key in place, hits and misses mixed."""
    stored = [make_entry(float(i)) for i in range(0, 10, 2)]
    asked = [make_entry(float(i)) for i in range(10)]
    cache = await opened(cache_config)
    try:
        await cache.insert(stored)
        found = await cache.lookup([e.key for e in asked])
        for i, got in enumerate(found):
            if i % 2:
                assert got is None
            else:
                same(got, asked[i])
    finally:
        await cache.aclose()


async def test_insert_replaces(cache_config: list[str]) -> None:
    """Inserting under a stored key replaces the entry (and counts it once)."""
    first = make_entry(1)
    second = CacheEntry(key=first.key, outputs=frozen_outputs({"Y": np.zeros(2, np.int8)}))
    cache = await opened(cache_config)
    try:
        await cache.insert([first])
        await cache.insert([second])
        (found,) = await cache.lookup([first.key])
        same(found, second)
        entries = cache.usage().entries
        assert entries is None or entries == 1
    finally:
        await cache.aclose()


async def test_the_actor_drives_every_cache(cache_config: list[str]) -> None:
    """Through the cache actor: a miss stores, the next lookup hits, statistics add up."""
    cache = await opened(cache_config)
    entry = make_entry(7)
    response = InferResponse(
        model_name="m", model_version=1, outputs=dict(entry.outputs), parameters={"tag": 7}
    )
    async with open_cache_actor(cache, cache_config[0].split(",")[0]) as actor:
        flight = await actor.begin(entry.key)
        assert flight.entry is None
        flight.store(response)
        flight.release()
        for _ in range(100):  # inserts of batched caches are written in the background
            if actor.statistics().insertions:
                break
            await trio.sleep(0.01)
        hit = await actor.begin(entry.key)
        hit.release()
        same(hit.entry, entry)
        stats = actor.statistics()
    assert (stats.lookups, stats.hits, stats.misses, stats.insertions) == (2, 1, 1, 1)
    assert stats.available


async def test_a_server_uses_every_cache(cache_config: list[str]) -> None:
    """End to end: the second identical request is a hit on each implementation."""
    calls: list[int] = []

    def execute(X: Any) -> dict[str, Any]:
        calls.append(1)
        return {"Y": X * 2}

    m = cached(model("m", execute, [tensor("X")], [tensor("Y")], jit=False))
    x = np.arange(16, dtype=np.float32)
    async with orchestrion.open_server(models=[m], cache_config=cache_config) as server:
        await server.infer("m", {"X": x})
        for _ in range(100):
            stats = server.cache_statistics()
            assert stats is not None
            if stats.insertions:
                break
            await trio.sleep(0.01)
        response = await server.infer("m", {"X": x})
    np.testing.assert_array_equal(response.outputs["Y"], x * 2)
    assert len(calls) == 1
