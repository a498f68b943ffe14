"""The cache actor's view of a backend outage when its workers' operations overlap: an
operation that began before the outage and succeeds after it says nothing about the backend
now, so it must neither end the outage (a second "unavailable" error at the next failure)
nor stop the outage's probe. Seen under load in CI: Redis killed once, two ERROR lines."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import pytest
import trio

from orchestrion.caches import CacheUsage, ResponseCache, open_cache_actor
from orchestrion.protocols import CacheEntry, CacheKey, CacheUnavailableError, cache_key


class _Scripted(ResponseCache):
    """A batched backend (two workers) whose lookups do what the test says, in turn."""

    concurrency = 2
    retry_interval = 0.5

    def __init__(self) -> None:
        self.slow_release = trio.Event()
        self.calls: list[str] = []
        self.script = ["slow success", "failure"]

    async def lookup(self, keys: Sequence[CacheKey]) -> Sequence[CacheEntry | None]:
        what = self.script.pop(0) if self.script else "success"
        self.calls.append(what)
        if what.startswith("slow"):
            await self.slow_release.wait()
        if what.endswith("failure"):
            raise CacheUnavailableError("connection refused")
        return [None] * len(keys)

    async def insert(self, entries: Sequence[CacheEntry]) -> None:
        return None

    async def aclose(self) -> None:
        return None

    def usage(self) -> CacheUsage:
        return CacheUsage(entries=0, used_bytes=0, capacity_bytes=None)


def _key(tag: int) -> CacheKey:
    return cache_key("m", 1, {"X": np.full(4, tag, np.float32)}, revision="outage")


async def test_a_stale_success_neither_ends_an_outage_nor_logs_twice(
    caplog: pytest.LogCaptureFixture, autojump_clock: trio.testing.MockClock
) -> None:
    caplog.set_level(logging.WARNING, "orchestrion.caches")
    cache = _Scripted()
    async with open_cache_actor(cache, "scripted") as actor:

        async def miss(tag: int) -> None:
            flight = await actor.begin(_key(tag))
            assert flight.entry is None
            flight.release()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(miss, 1)  # its lookup hangs: the backend is slow
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(miss, 2)  # the other worker's lookup fails: an outage
            await trio.testing.wait_all_tasks_blocked()
            cache.slow_release.set()  # the slow lookup now succeeds, after the failure
        assert cache.calls == ["slow success", "failure"]
        await miss(3)  # still down (within retry_interval): answered at once, not looked up
        assert cache.calls == ["slow success", "failure"]
        await trio.sleep(cache.retry_interval)
        await miss(4)  # a probe, which succeeds: the outage ends, once
        assert cache.calls == ["slow success", "failure", "success"]
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    again = [r.getMessage() for r in caplog.records if "available again" in r.getMessage()]
    assert len(errors) == 1, errors
    assert "scripted cache unavailable" in errors[0]
    assert len(again) == 1, again


async def test_a_stale_failure_does_not_begin_a_second_outage(
    caplog: pytest.LogCaptureFixture, autojump_clock: trio.testing.MockClock
) -> None:
    """A lookup that hung from before an outage and fails after the backend came back (its
    connection was the one that broke) does not mark the backend down again."""
    caplog.set_level(logging.WARNING, "orchestrion.caches")
    cache = _Scripted()
    cache.script = ["slow failure", "failure", "success", "success"]
    async with open_cache_actor(cache, "scripted") as actor:

        async def miss(tag: int) -> None:
            flight = await actor.begin(_key(tag))
            assert flight.entry is None
            flight.release()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(miss, 1)  # hangs, from before the outage
            await trio.testing.wait_all_tasks_blocked()
            await miss(2)  # fails: the outage begins
            await trio.sleep(cache.retry_interval)
            await miss(3)  # the probe succeeds: the outage ends
            cache.slow_release.set()  # the old lookup fails now, after the recovery
        await miss(4)  # not down: looked up
        assert cache.calls == ["slow failure", "failure", "success", "success"]
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    again = [r.getMessage() for r in caplog.records if "available again" in r.getMessage()]
    assert len(errors) == 1, errors
    assert len(again) == 1, again
