"""The contract every `ResponseCache` keeps (`orchestrion.testing.check_response_cache`, the
check a plugin's author runs), run on all three implementations found through the
``orchestrion.caches`` entry points: ``local``, ``redis`` and the third-party example in
``examples/sqlite_cache`` (registered here through a dist-info folder, as pip would); and the
check itself, on caches that each break one rule."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio

import orchestrion
from orchestrion.caches import ResponseCache, available_caches, open_cache
from orchestrion.protocols import CacheEntry, CacheKey, frozen_outputs
from orchestrion.testing import RedisServer, cached, check_response_cache, model, tensor

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


def test_every_cache_is_installed_as_an_entry_point(sqlite_plugin: None) -> None:
    """local and redis come with orchestrion; the example registers like any plugin."""
    assert {"local", "redis", "sqlite"} <= set(available_caches())


async def test_every_cache_keeps_the_contract(cache_config: list[str]) -> None:
    """orchestrion.testing.check_response_cache, the check a plugin author runs, passes on
    each implementation (run twice: a cache that keeps its contents between openings, as
    Redis and SQLite do, still passes)."""
    for _ in range(2):
        await check_response_cache(lambda: opened(cache_config), name=cache_config[0])


class _Forgetful(ResponseCache):
    """A cache that breaks one rule each, chosen by ``flaw``."""

    immediate = True

    def __init__(self, flaw: str) -> None:
        self.flaw = flaw
        self.stored: dict[bytes, CacheEntry] = {}

    def lookup_nowait(self, key: CacheKey) -> CacheEntry | None:
        found = self.stored.get(key.digest)
        if found is not None and self.flaw == "bf16" and "B" in found.outputs:
            outputs = dict(found.outputs)
            outputs["B"] = outputs["B"].astype(np.float32)
            return CacheEntry(key=found.key, outputs=frozen_outputs(outputs))
        return found

    def insert_nowait(self, entry: CacheEntry) -> None:
        if self.flaw == "keeps first" and entry.key.digest in self.stored:
            return
        self.stored[entry.key.digest] = entry

    async def lookup(self, keys: Sequence[CacheKey]) -> Sequence[CacheEntry | None]:
        found = [self.lookup_nowait(key) for key in keys]
        return found[::-1] if self.flaw == "reorders" else found

    async def aclose(self) -> None:
        pass


@pytest.mark.parametrize(
    ("flaw", "message"),
    [
        ("bf16", "output B came back as float32[2, 3], stored bfloat16[2, 3]"),
        ("reorders", "insert, then lookup: the entry of another key came back"),
        ("keeps first", "an insert under a stored key: output Y came back as float32[8]"),
    ],
)
async def test_the_check_names_the_rule_a_cache_breaks(flaw: str, message: str) -> None:
    with pytest.raises(AssertionError, match=re.escape(message)):
        await check_response_cache(lambda: _Forgetful(flaw), name="forgetful")


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
