"""The contract every `ResponseCache` keeps, as one check a cache plugin's author runs in
their own tests (as ``trio.testing.check_two_way_stream`` is for streams).

How this works: `check_response_cache` opens a fresh cache through the author's factory for
each part of the contract and closes it after: a lookup of keys never stored misses; what is
inserted comes back equal (key and revision, tensors of every kind: bytes, BF16, empty,
scalar), in the order asked, hits and misses mixed; an insert under a stored key replaces the
entry; ``usage`` answers a `CacheUsage`; an ``immediate`` cache answers without blocking; and
orchestrion's cache actor drives the cache (a miss stores, the next lookup hits, statistics
add up). Keys carry a revision of their own for each run, so a cache that keeps its contents
between openings (Redis, a file) passes run after run. A broken rule raises AssertionError
saying which; whatever the cache raises is passed on.
"""

from __future__ import annotations

import inspect
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import ml_dtypes
import numpy as np
import trio

from ..caches import CacheUsage, ResponseCache, open_cache_actor
from ..protocols import CacheEntry, InferResponse, cache_key, frozen_outputs

CacheOpener = Callable[[], "ResponseCache | Awaitable[ResponseCache]"]
"""Makes a fresh cache: the plugin's factory with its settings, as a no-argument call."""


async def check_response_cache(open_cache: CacheOpener, *, name: str = "plugin") -> None:
    """Check that the caches ``open_cache`` makes keep orchestrion's cache contract.

    Args:
        open_cache: opens one cache (sync or async), as the server would through the
            plugin's entry point (``lambda: open_my_cache(CacheConfig("mine", {...}))``).
        name: the cache's name in the statistics and messages.

    Raises:
        AssertionError: a rule is broken (the message says which).
    """
    contract = _Contract(open_cache, name, revision=f"contract-{secrets.token_hex(8)}")
    for part in (
        contract.misses_when_empty,
        contract.round_trips_every_kind,
        contract.answers_in_order,
        contract.insert_replaces,
        contract.immediate_answers_inline,
        contract.the_actor_drives_it,
    ):
        await part()


def _expect(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)


class _Contract:
    def __init__(self, open_cache: CacheOpener, name: str, revision: str) -> None:
        self._open = open_cache
        self.name = name
        self.revision = revision

    async def opened(self) -> ResponseCache:
        made = self._open()
        cache = await made if inspect.isawaitable(made) else made
        _expect(isinstance(cache, ResponseCache), f"{self.name}: not a ResponseCache: {cache!r}")
        return cache

    @asynccontextmanager
    async def cache(self) -> AsyncIterator[ResponseCache]:
        cache = await self.opened()
        try:
            yield cache
        finally:
            await cache.aclose()

    def entry(self, tag: float, **outputs: Any) -> CacheEntry:
        key = cache_key("m", 1, {"X": np.full(4, tag, np.float32)}, revision=self.revision)
        return CacheEntry(
            key=key, outputs=frozen_outputs(outputs or {"Y": np.full(8, tag, np.float32)})
        )

    def same(self, got: CacheEntry | None, expected: CacheEntry, where: str) -> None:
        _expect(got is not None, f"{self.name}: {where}: a stored entry was not found")
        assert got is not None
        _expect(
            got.matches(expected.key),
            f"{self.name}: {where}: the entry of another key came back (a lookup answers each "
            "key in its place)",
        )
        _expect(
            list(got.outputs) == list(expected.outputs),
            f"{self.name}: {where}: outputs {list(got.outputs)}, stored {list(expected.outputs)}",
        )
        for output, array in expected.outputs.items():
            value = got.outputs[output]
            _expect(
                (value.dtype, value.shape) == (array.dtype, array.shape),
                f"{self.name}: {where}: output {output} came back as {value.dtype}"
                f"{list(value.shape)}, stored {array.dtype}{list(array.shape)}",
            )
            equal = (
                value.tolist() == array.tolist()
                if array.dtype.kind == "O"
                else np.array_equal(value, array)
            )
            _expect(equal, f"{self.name}: {where}: output {output} came back with other values")

    async def misses_when_empty(self) -> None:
        async with self.cache() as cache:
            found = list(await cache.lookup([self.entry(1).key, self.entry(2).key]))
            _expect(
                found == [None, None],
                f"{self.name}: a lookup of keys never stored must answer None for each, got "
                f"{found!r}",
            )
            _expect(
                isinstance(cache.usage(), CacheUsage),
                f"{self.name}: usage() must return a CacheUsage",
            )

    async def round_trips_every_kind(self) -> None:
        entries = [
            self.entry(10),
            self.entry(
                11,
                S=np.array([[b"", b"a"], [b"\x00\xff", b"long" * 50]], dtype=object),
                B=np.arange(6, dtype=np.float32).astype(ml_dtypes.bfloat16).reshape(2, 3),
                E=np.zeros((0, 3), np.int64),
                Z=np.array(True),
            ),
        ]
        async with self.cache() as cache:
            await cache.insert(entries)
            found = list(await cache.lookup([e.key for e in entries]))
            _expect(len(found) == 2, f"{self.name}: a lookup of 2 keys answered {len(found)}")
            for got, expected in zip(found, entries, strict=True):
                self.same(got, expected, "insert, then lookup")

    async def answers_in_order(self) -> None:
        asked = [self.entry(float(20 + i)) for i in range(10)]
        async with self.cache() as cache:
            await cache.insert(asked[::2])
            found = list(await cache.lookup([e.key for e in asked]))
            _expect(len(found) == 10, f"{self.name}: a lookup of 10 keys answered {len(found)}")
            for i, got in enumerate(found):
                if i % 2:
                    _expect(got is None, f"{self.name}: key {i} of a batch was never stored")
                else:
                    self.same(got, asked[i], f"key {i} of a batch of hits and misses")

    async def insert_replaces(self) -> None:
        first = self.entry(30)
        second = CacheEntry(key=first.key, outputs=frozen_outputs({"Y": np.zeros(2, np.int8)}))
        async with self.cache() as cache:
            before = cache.usage().entries
            await cache.insert([first])
            await cache.insert([second])
            (found,) = await cache.lookup([first.key])
            self.same(found, second, "an insert under a stored key")
            after = cache.usage().entries
            if before is not None and after is not None:
                _expect(
                    after - before == 1,
                    f"{self.name}: two inserts under one key must count one entry, counted "
                    f"{after - before}",
                )

    async def immediate_answers_inline(self) -> None:
        async with self.cache() as cache:
            if not cache.immediate:
                _expect(
                    cache.concurrency >= 1 and cache.retry_interval > 0,
                    f"{self.name}: concurrency must be >= 1 and retry_interval > 0",
                )
                return
            entry = self.entry(40)
            _expect(
                cache.lookup_nowait(entry.key) is None,
                f"{self.name}: lookup_nowait of a key never stored must be None",
            )
            cache.insert_nowait(entry)
            self.same(cache.lookup_nowait(entry.key), entry, "insert_nowait, then lookup_nowait")

    async def the_actor_drives_it(self) -> None:
        cache = await self.opened()
        entry = self.entry(50)
        response = InferResponse(
            model_name="m", model_version=1, outputs=dict(entry.outputs), parameters={"t": 5}
        )
        async with open_cache_actor(cache, self.name) as actor:  # it closes the cache
            flight = await actor.begin(entry.key)
            _expect(flight.entry is None, f"{self.name}: the actor's first lookup must miss")
            flight.store(response)
            flight.release()
            for _ in range(1000):  # a batching cache writes in the background: 10 s at most
                if actor.statistics().insertions:
                    break
                await trio.sleep(0.01)
            hit = await actor.begin(entry.key)
            hit.release()
            self.same(hit.entry, entry, "stored through the cache actor, then looked up")
            stats = actor.statistics()
        counts = (stats.lookups, stats.hits, stats.misses, stats.insertions)
        _expect(
            counts == (2, 1, 1, 1),
            f"{self.name}: through the actor, (lookups, hits, misses, insertions) must be "
            f"(2, 1, 1, 1), got {counts}",
        )
