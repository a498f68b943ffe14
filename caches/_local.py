"""The ``local`` cache: a byte-bounded, strict-LRU store in this process's memory.

How this works: an ordered dict from digest to entry, oldest first; a hit moves the entry to
the end, an insert evicts from the front until the new entry fits. Every entry is charged
what it really costs (tensor bytes plus the Python objects around them, see `entry_cost`), so
``size`` bounds the memory the cache holds. An entry that alone exceeds ``size`` is not
stored. Operations never block, so the cache actor calls them inline.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

from ..protocols import (
    CacheConfig,
    CacheEntry,
    CacheKey,
    ConfigError,
    check_option_names,
    entry_cost,
    option_int,
)
from ._protocol import CacheUsage, ResponseCache

_log = logging.getLogger("orchestrion.caches")

MIN_SIZE = 1024
"""Smaller than this, the cache could not hold even a tiny entry's bookkeeping."""
_SLOT_COST = 100
"""What one more ordered-dict slot costs (hash table slot and linked-list node), measured."""


class LocalCache(ResponseCache):
    """Strict LRU over ``capacity_bytes`` of entries, shared by all models of a server."""

    immediate = True

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < MIN_SIZE:
            raise ValueError(f"capacity_bytes must be at least {MIN_SIZE}")
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[bytes, tuple[CacheEntry, int]] = OrderedDict()
        self._used = 0
        self._evictions = 0
        self._warned_oversized = False

    def lookup_nowait(self, key: CacheKey) -> CacheEntry | None:
        """The entry stored under ``key``'s digest, made the most recently used."""
        found = self._entries.get(key.digest)
        if found is None:
            return None
        self._entries.move_to_end(key.digest)
        return found[0]

    def insert_nowait(self, entry: CacheEntry) -> None:
        """Store ``entry``, evicting least recently used entries until it fits.

        An entry larger than the whole cache is not stored (and logged once).
        """
        digest = entry.key.digest
        cost = entry_cost(entry) + _SLOT_COST
        if cost > self.capacity_bytes:
            level = logging.DEBUG if self._warned_oversized else logging.WARNING
            self._warned_oversized = True
            _log.log(
                level,
                "local cache: a response of model '%s' needs %d bytes, more than the whole "
                "cache (size=%d); it is not cached (further ones are logged at debug level)",
                entry.key.model_name,
                cost,
                self.capacity_bytes,
            )
            return
        old = self._entries.pop(digest, None)
        if old is not None:
            self._used -= old[1]
        while self._used + cost > self.capacity_bytes:
            _, (_, evicted_cost) = self._entries.popitem(last=False)
            self._used -= evicted_cost
            self._evictions += 1
        self._entries[digest] = (entry, cost)
        self._used += cost

    def usage(self) -> CacheUsage:
        """Entries, evictions and bytes charged, exactly."""
        return CacheUsage(
            entries=len(self._entries),
            evictions=self._evictions,
            used_bytes=self._used,
            capacity_bytes=self.capacity_bytes,
        )

    async def aclose(self) -> None:
        """Drop every entry."""
        self._entries.clear()
        self._used = 0


def open_local_cache(config: CacheConfig) -> LocalCache:
    """The ``local`` entry point: ``--cache-config local,size=<bytes>``.

    Raises:
        ConfigError: ``size`` missing, not an integer, or too small to hold anything.
    """
    check_option_names(config, ["size"])
    size = option_int(config, "size")
    if size < MIN_SIZE:
        raise ConfigError(
            f"--cache-config local,size={config.options['size']}: a local cache of {size} "
            f"bytes cannot hold any entry (each costs a few hundred bytes of bookkeeping); "
            f"use at least size={MIN_SIZE}"
        )
    return LocalCache(size)
