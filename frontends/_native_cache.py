"""The response cache's first tier, in the native front end: hits answered without Python.

How this works: the native front end keys each small inference request on its wire bytes
and answers those it holds itself (see ``native/src/cache.rs``). What it holds comes from
here: when a request's answer is one the response cache may keep (`WireInfer` marks it:
the model caches responses, nothing came from shared memory) and the set of loaded models
has not changed since the request began, the answer's bytes are handed back with the
model's *tag* and that generation. Every load, reload and unload empties the tier
(`CacheTierLink.changes`), so no answer outlives the revision that computed it,
as the cache's revision fingerprint promises. The tier's hits join the model's statistics
and the cache's counters whenever statistics or metrics are read
(`CacheTierLink.statistics_source`), as successes and cache hits, as Triton counts its own.

Everything else about caching (which models, single flight, Redis and plugins behind it,
what is never cached) is decided once, by the server's cache: the tier only repeats bytes
the server has already answered for the same request bytes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import attrs

from .._server import AsyncServer, CacheTierLink
from ._wire_infer import CACHED_MODEL

DEFAULT_TIER_SIZE = 64 * 1024 * 1024
"""Bytes of answers the native front end keeps by default, when the server has a cache."""


@attrs.define(eq=False)
class CacheTier:
    """The Python side of the native front end's cache tier."""

    frontend: Any
    link: CacheTierLink
    _tags: dict[tuple[str, int], int] = attrs.field(factory=dict)
    _models: list[tuple[str, int]] = attrs.field(factory=list)

    def generation(self) -> int:
        """The set of loaded models now (taken when a request begins)."""
        return self.link.generation

    def storing(self, generation: int) -> tuple[int, int] | None:
        """``(tag, generation)`` when the answer just made in this task may be stored."""
        model = CACHED_MODEL.get()
        if model is None:
            return None
        tag = self._tags.get(model)
        if tag is None:
            tag = self._tags[model] = len(self._models)
            self._models.append(model)
        return tag, generation

    def gather(self) -> None:
        """Add the tier's hits since the last call to the models' statistics."""
        for tag, count, total_ns, lookup_ns in self.frontend.take_cache_hits():
            name, version = self._models[tag]
            self.link.count_hits(name, version, count, total_ns, lookup_ns)
        entries, used, _capacity, _evictions = self.frontend.cache_usage()
        self.link.report_usage(entries, used)

    def models_changed(self, generation: int) -> None:
        """Forget every answer: the models changed."""
        self.gather()  # hits of models about to go are counted while they are there
        self.frontend.clear_cache(generation)


@contextlib.contextmanager
def open_cache_tier(
    frontend: Any, server: AsyncServer | None, size: int
) -> Iterator[CacheTier | None]:
    """The tier of ``size`` bytes for ``server`` while the block runs (None, and the tier
    off, when ``size`` is 0 or the server has no cache)."""
    link = server.cache_tier_link() if server is not None else None
    if link is None or size <= 0 or not link.has_cache():
        frontend.enable_cache(0, 0)
        yield None
        return
    tier = CacheTier(frontend, link)
    with link.changes(tier.models_changed), link.statistics_source(tier.gather):
        frontend.enable_cache(size, link.generation)
        try:
            yield tier
        finally:
            frontend.enable_cache(0, 0)
            tier.gather()
