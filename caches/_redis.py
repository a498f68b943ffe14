"""The ``redis`` cache: responses in Redis, shared by every server that uses it.

How this works: redis-py's synchronous client (with the hiredis parser) over a connection
pool of ``pool_size`` connections. redis-py's own asyncio client cannot run on trio, so each
*batch* of operations makes one trip to a worker thread and one pipelined round trip to
Redis; the cache actor gathers the batches (up to ``pool_size`` at once), so the thread hop is
paid per batch, not per request. Values are orchestrion's data-only entry format
(`encode_entry`), under ``<prefix><32 hex digits>``, with an optional TTL. Every redis-py
error becomes a `CacheUnavailableError`, which the actor turns into uncached service until
Redis answers again; except error replies to SETs (a full Redis answers OOM, a replica
READONLY), which become an `CacheWriteRefusedError`: Redis is up and still serves reads, only
the refused entries are lost.

The same class serves a primary that Sentinels watch (``sentinels=...``): redis-py's
Sentinel pool asks the Sentinels where the primary is whenever it connects, so after a
failover the first probe of the actor reaches the promoted replica. A Redis Cluster
(``cluster=true``) is `RedisClusterCache`, whose failures are per node.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import redis
import redis.exceptions
import redis.sentinel
import trio
from redis.backoff import NoBackoff
from redis.retry import Retry

from ..protocols import (
    CacheConfig,
    CacheEntry,
    CacheKey,
    CacheUnavailableError,
    CacheWriteRefusedError,
    decode_entry,
    encode_entry,
)
from ._actor import Throttled
from ._protocol import ResponseCache
from ._redis_cluster import open_redis_cluster_cache
from ._redis_settings import RedisSettings, credentials_refused, redis_settings, reply_text

_log = logging.getLogger("orchestrion.caches")


class RedisCache(ResponseCache):
    """A `ResponseCache` on one Redis server, or on the primary that Sentinels name. Open it
    with `open_redis_cache`."""

    def __init__(
        self,
        client: redis.Redis,
        settings: RedisSettings,
        others: Sequence[redis.Redis] = (),
    ) -> None:
        self._client = client
        self._others = list(others)
        self.address = settings.address
        self.prefix = settings.prefix
        self.ttl_s = settings.ttl
        self.concurrency = settings.pool_size
        self.retry_interval = settings.retry_interval
        self._limiter = trio.CapacityLimiter(settings.pool_size)
        self._undecodable = Throttled(_log)

    def _name(self, key: CacheKey) -> str:
        return self.prefix + key.hex

    async def lookup(self, keys: Sequence[CacheKey]) -> Sequence[CacheEntry | None]:
        """One pipelined round trip of GETs for the whole batch."""
        names = [self._name(k) for k in keys]
        values = await trio.to_thread.run_sync(self._get_many, names, limiter=self._limiter)
        return [self._decode(name, value) for name, value in zip(names, values, strict=True)]

    def _get_many(self, names: list[str]) -> list[Any]:
        try:
            if len(names) == 1:
                return [self._client.get(names[0])]
            pipe = self._client.pipeline(transaction=False)
            for name in names:
                pipe.get(name)
            return pipe.execute()
        except redis.exceptions.RedisError as exc:
            raise CacheUnavailableError(f"Redis at {self.address}: {exc}") from exc

    def _decode(self, name: str, value: Any) -> CacheEntry | None:
        if value is None:
            return None
        try:
            return decode_entry(value)
        except ValueError as exc:
            self._undecodable.warning("redis cache: ignoring the value of %s: %s", name, exc)
            return None

    async def insert(self, entries: Sequence[CacheEntry]) -> None:
        """One pipelined round trip of SETs (with the TTL, if any).

        Raises:
            CacheUnavailableError: Redis cannot be reached, or did not answer in time.
            CacheWriteRefusedError: Redis answered some SETs with an error (a full Redis: OOM).
        """
        # Encoding copies the tensors: done in the worker thread, off the event loop.
        await trio.to_thread.run_sync(self._set_many, list(entries), limiter=self._limiter)

    def _set_many(self, entries: list[CacheEntry]) -> None:
        ttl = self.ttl_s or None
        items = [(self._name(e.key), encode_entry(e)) for e in entries]
        try:
            pipe = self._client.pipeline(transaction=False)
            for name, value in items:
                pipe.set(name, value, ex=ttl)
            # An error reply (OOM, READONLY) comes back in its SET's place: the connection is
            # fine and every other reply is read, so one refusal is not taken for an outage.
            replies = pipe.execute(raise_on_error=False)
        except redis.exceptions.RedisError as exc:
            raise CacheUnavailableError(f"Redis at {self.address}: {exc}") from exc
        refusals = [r for r in replies if isinstance(r, redis.exceptions.ResponseError)]
        if refusals:
            raise CacheWriteRefusedError(
                f"Redis at {self.address} refused {len(refusals)} of {len(items)} writes: "
                f"{reply_text(refusals[0])}",
                refused=len(refusals),
            ) from refusals[0]

    async def aclose(self) -> None:
        """Close every pooled connection (closing sockets does not block)."""
        _close(self._client, self._others)


def _pool(settings: RedisSettings) -> tuple[redis.Redis, list[redis.Redis]]:
    """The client of one Redis server or of the primary the Sentinels name, and the
    Sentinels' own clients (to close with it)."""
    # One immediate retry on a fresh connection: a pooled connection to a Redis that has
    # restarted (or to a primary that failed over) fails once, and that must not count as
    # an outage. (Never on a timeout: a hung Redis must cost one socket_timeout, not two.)
    retry = Retry(NoBackoff(), 1, supported_errors=(redis.exceptions.ConnectionError,))
    kwargs = settings.connection_kwargs()
    if settings.mode == "sentinel":
        sentinel_kwargs = {k: v for k, v in kwargs.items() if k not in ("username", "password")} | {
            "password": settings.sentinel_password or None
        }
        sentinel = redis.sentinel.Sentinel(  # type: ignore[no-untyped-call, unused-ignore]
            list(settings.sentinels), sentinel_kwargs=sentinel_kwargs, **kwargs
        )
        client = sentinel.master_for(  # type: ignore[no-untyped-call, unused-ignore]
            settings.sentinel_master,
            db=settings.db,
            max_connections=settings.pool_size,
            retry=retry,
        )
        return client, list(sentinel.sentinels)
    if settings.tls:
        kwargs.pop("ssl")
        kwargs["connection_class"] = redis.SSLConnection
    pool = redis.BlockingConnectionPool(  # type: ignore[no-untyped-call, unused-ignore]
        host=settings.host,
        port=settings.port,
        db=settings.db,
        max_connections=settings.pool_size,
        timeout=settings.wait_timeout,
        retry=retry,
        **kwargs,
    )
    return redis.Redis(connection_pool=pool), []


async def open_redis_cache(config: CacheConfig) -> ResponseCache:
    """The ``redis`` entry point: connects, and PINGs once to fail early.

    Returns:
        a `RedisCache` (one server, or the primary Sentinels name), or a
        `RedisClusterCache` with ``cluster=true``.

    Raises:
        ConfigError: a missing ``host``/``port`` or a malformed option.
        CacheUnavailableError: Redis cannot be reached or refuses the credentials.
    """
    settings = redis_settings(config)
    if settings.mode == "cluster":
        return await open_redis_cluster_cache(settings)
    client, others = _pool(settings)
    address = settings.address
    try:
        await trio.to_thread.run_sync(client.ping)
    except (redis.exceptions.AuthenticationError, redis.exceptions.ResponseError) as exc:
        _close(client, others)
        if isinstance(exc, redis.exceptions.AuthenticationError) or credentials_refused(exc):
            raise CacheUnavailableError(
                f"Redis at {address} rejected the credentials ({exc}); set user and password "
                "in --cache-config or ORCHESTRION_REDIS_USERNAME/ORCHESTRION_REDIS_PASSWORD"
            ) from exc
        raise CacheUnavailableError(f"Redis at {address} refused PING: {exc}") from exc
    except redis.exceptions.RedisError as exc:
        _close(client, others)
        raise CacheUnavailableError(
            f"cannot reach Redis at {address}{' over TLS' if settings.tls else ''}: {exc}"
        ) from exc
    except BaseException:
        _close(client, others)
        raise
    return RedisCache(client, settings, others)


def _close(client: redis.Redis, others: Sequence[redis.Redis] = ()) -> None:
    # A client given its own pool leaves the pool open on close(): disconnect it too.
    for each in (client, *others):
        each.close()
        each.connection_pool.disconnect()
