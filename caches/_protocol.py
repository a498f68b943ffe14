"""The interface every response cache implements: built-in (`local`, `redis`) or a plugin.

A cache is found by the ``<name>`` of ``--cache-config <name>,<key>=<value>`` in the Python
entry-point group ``orchestrion.caches``. The entry point names a *factory*: a callable that
takes the `CacheConfig` (name and string options) and returns a `ResponseCache`, or an
awaitable of one when opening it does I/O (connecting, checking credentials). The factory
validates its options and raises `ConfigError` for bad ones and `CacheUnavailableError` when
the backend cannot be reached.

The server owns the cache: one per server, opened before the models load and closed with
`aclose` after the last request. The cache actor calls the cache; a cache never sees two
calls at once unless it declares ``concurrency > 1``. Batched methods let a backend with round
trips (Redis) answer many requests per trip; counting hits and misses is the actor's job, so a
cache reports only what it alone knows (`CacheUsage`).
"""

from __future__ import annotations

import abc
from collections.abc import Awaitable, Callable, Sequence
from typing import ClassVar, TypeAlias

import attrs
import trio

from ..protocols import CacheConfig, CacheEntry, CacheKey


@attrs.frozen(kw_only=True)
class CacheUsage:
    """What a cache knows about its own contents (None: cannot tell cheaply)."""

    entries: int | None = None
    evictions: int | None = None
    used_bytes: int | None = None
    capacity_bytes: int | None = None


class ResponseCache(abc.ABC):
    """A store of responses by `CacheKey`. Subclass it to write a cache plugin.

    Implement `lookup`, `insert` and `aclose` (and `usage` if you can). An in-memory cache
    whose operations never block sets ``immediate = True`` and implements `lookup_nowait`
    and `insert_nowait` instead: the actor then calls them in the requesting task, with no
    channel or thread hop (a local hit costs microseconds).

    Errors: raise `CacheUnavailableError` (``from`` the backend's exception) when the backend
    cannot be used; the actor then serves requests uncached, logs once per outage, and tries
    again after ``retry_interval`` seconds. Raise `CacheWriteRefusedError` from `insert`
    when the backend is up but refused to store some entries (it is full, say): lookups go on,
    the refused entries count as not stored, and one warning is logged. Any other exception
    is treated as an outage and logged with its traceback, since it is a bug in the cache.
    """

    immediate: ClassVar[bool] = False
    """True: use `lookup_nowait`/`insert_nowait` inline."""
    concurrency: int = 1
    """How many batches the actor may have in flight at once (a connection pool's size)."""
    retry_interval: float = 1.0
    """Seconds to serve uncached after a failure before trying the backend again."""

    async def lookup(self, keys: Sequence[CacheKey]) -> Sequence[CacheEntry | None]:
        """The stored entries of ``keys``, in order (None where nothing is stored).

        An entry whose key does not match is discarded by the actor, so a cache may return
        whatever it stored under the digest.
        """
        return [self.lookup_nowait(key) for key in keys]

    async def insert(self, entries: Sequence[CacheEntry]) -> None:
        """Store ``entries`` (each under ``entry.key``), replacing what is there."""
        for entry in entries:
            self.insert_nowait(entry)

    def lookup_nowait(self, key: CacheKey) -> CacheEntry | None:
        """`lookup` of one key without blocking (immediate caches only).

        Raises:
            trio.WouldBlock: this cache cannot answer without waiting.
        """
        raise trio.WouldBlock

    def insert_nowait(self, entry: CacheEntry) -> None:
        """`insert` of one entry without blocking (immediate caches only).

        Raises:
            trio.WouldBlock: this cache cannot store without waiting.
        """
        raise trio.WouldBlock

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Release the cache's resources (connections, files). Called once, last."""

    def usage(self) -> CacheUsage:
        """Entries, evictions and bytes, as far as the cache knows them cheaply."""
        return CacheUsage()


CacheFactory: TypeAlias = Callable[[CacheConfig], "ResponseCache | Awaitable[ResponseCache]"]
"""What an ``orchestrion.caches`` entry point names."""
