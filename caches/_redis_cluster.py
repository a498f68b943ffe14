"""The ``redis`` cache on a Redis Cluster (``cluster=true``): entries spread over its slots.

How this works: redis-py's `RedisCluster` finds the cluster from one node (CLUSTER SLOTS),
keeps the map of slots to primaries and one connection pool per node. Entries keep their
names (``<prefix><32 hex digits>``, no hash tag), so they spread over all the slots. A batch
from the cache actor makes one trip to a worker thread, as for one Redis; there its names are
grouped by the primary that owns their slot, every node's commands are written at once and
then each node's replies read: one pipelined round trip per node, the nodes overlapping.
(redis-py's ClusterPipeline does the same, but fails a whole batch when one node cannot be
reached, and retries failed commands one at a time with backoff, holding a worker thread for
seconds: a failover must cost misses, not stalls.)

Failures are per node. A primary that cannot be reached costs misses (and lost inserts) for
the names in its slots only: it is skipped for ``retry_interval`` (one ERROR per node
outage), then tried again. Any sign that the map is stale (a node down, a MOVED or ASK, a
READONLY replica, CLUSTERDOWN) refreshes it from the live nodes, at most once per
``retry_interval``, so once a replica is promoted in a dead primary's place the next batch
reaches it. Only when no primary answers at all does the cache raise `CacheUnavailableError`,
and the actor then serves everything uncached, as for one Redis. Inserts a node did not take
are reported as `CacheWriteRefusedError` (the cluster is up; those entries are not stored).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import redis.exceptions
import trio
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.retry import Retry

from ..protocols import (
    CacheEntry,
    CacheKey,
    CacheUnavailableError,
    CacheWriteRefusedError,
    decode_entry,
    encode_entry,
)
from ._actor import Throttled
from ._protocol import ResponseCache
from ._redis_settings import RedisSettings, credentials_refused, reply_text

_log = logging.getLogger("orchestrion.caches")

_STALE_MAP = (
    redis.exceptions.MovedError,
    redis.exceptions.AskError,
    redis.exceptions.ReadOnlyError,
    redis.exceptions.ClusterDownError,
    redis.exceptions.TryAgainError,
    redis.exceptions.MasterDownError,
)
"""Error replies that mean the node no longer (or not yet) serves the slot."""


@attrs.define(eq=False, slots=True)
class _Trip:
    """What one batch's round trips brought back, for the event loop to judge."""

    replies: list[Any]
    """Per name: the reply, an exception, or None (its node was skipped or not covered)."""
    failed: dict[str, Exception] = attrs.field(factory=dict)
    """Nodes that could not be reached or did not answer in time."""
    answered: set[str] = attrs.field(factory=set)
    stale: bool = False
    """A reply said the slot map is out of date."""
    primaries: set[str] = attrs.field(factory=set)
    """The primaries of the slot map this trip used."""


class RedisClusterCache(ResponseCache):
    """A `ResponseCache` on a Redis Cluster. Open it with ``open_redis_cache`` and
    ``cluster=true``."""

    def __init__(self, client: RedisCluster, settings: RedisSettings) -> None:
        self._client = client
        self.address = settings.address
        self.prefix = settings.prefix
        self.ttl_s = settings.ttl
        self.concurrency = settings.pool_size
        self.retry_interval = settings.retry_interval
        self._limiter = trio.CapacityLimiter(settings.pool_size)
        self._undecodable = Throttled(_log)
        self._down: dict[str, float] = {}
        """Nodes skipped until the given `trio.current_time`."""
        self._down_since: dict[str, float] = {}
        """When each node in ``_down`` was found down: an answer from a trip that began
        before then (concurrent trips end in any order) says nothing of it now."""
        self._refresh_at: float | None = None
        """When the slot map may be refreshed next (None: it is believed right)."""
        self._primaries: set[str] = {n.name for n in client.get_primaries()}  # type: ignore[no-untyped-call]

    def _name(self, key: CacheKey) -> str:
        return self.prefix + key.hex

    # -- the event loop's side: which nodes to use, what their answers mean -------------

    async def _run(self, names: list[str], command: Callable[[int, str], tuple[Any, ...]]) -> _Trip:
        now = trio.current_time()
        skip = {name for name, until in self._down.items() if now < until}
        refresh = self._refresh_at is not None and now >= self._refresh_at
        if self._primaries and self._primaries <= skip:
            skip, refresh = set(), True  # every primary is down: this call is the probe
        if refresh:
            self._refresh_at = now + self.retry_interval
        trip = await trio.to_thread.run_sync(
            self._trip, names, command, frozenset(skip), refresh, limiter=self._limiter
        )
        self._judge(trip, now)
        return trip

    def _judge(self, trip: _Trip, began: float) -> None:
        now = trio.current_time()
        if trip.primaries:
            self._primaries = trip.primaries
        for name in list(self._down):
            if name in trip.answered:
                if began < self._down_since.get(name, began):
                    continue  # it answered before it went down
                del self._down[name]
                _log.warning("redis cache: Redis Cluster node %s answers again", name)
            elif name not in self._primaries and name not in trip.failed:
                del self._down[name]
                _log.warning(
                    "redis cache: Redis Cluster node %s no longer serves slots (a replica "
                    "took its place); caching resumed for them",
                    name,
                )
        for name, exc in trip.failed.items():
            if name not in self._down:
                self._down_since[name] = now
                _log.error(
                    "redis cache: Redis Cluster node %s unavailable (%s); requests for its "
                    "slots run uncached, retrying every %.1f s",
                    name,
                    exc,
                    self.retry_interval,
                )
            self._down[name] = now + self.retry_interval
        if (trip.failed or trip.stale) and self._refresh_at is None:
            self._refresh_at = now
        elif not trip.failed and not trip.stale and not self._down:
            self._refresh_at = None
        if self._primaries and self._primaries <= set(self._down) and not trip.answered:
            first = next(iter(trip.failed.values()), None)
            raise CacheUnavailableError(
                f"Redis at {self.address}: no primary answers ({first})"
            ) from first

    # -- the worker thread's side: the round trips -------------------------------------

    def _trip(
        self,
        names: list[str],
        command: Callable[[int, str], tuple[Any, ...]],
        skip: frozenset[str],
        refresh: bool,
    ) -> _Trip:
        if refresh:
            self._refresh()
        trip = _Trip(replies=[None] * len(names))
        groups: dict[str, tuple[ClusterNode, list[int]]] = {}
        nodes = self._client.nodes_manager
        for index, name in enumerate(names):
            try:
                slot = self._client.keyslot(name)  # type: ignore[no-untyped-call]
                node = nodes.get_node_from_slot(slot)
            except redis.exceptions.SlotNotCoveredError:
                trip.stale = True
                continue
            if node.name not in skip:
                groups.setdefault(node.name, (node, []))[1].append(index)
        trip.primaries = {n.name for n in self._client.get_primaries()}  # type: ignore[no-untyped-call]
        sent = []
        for name, (node, indices) in groups.items():
            pool = node.redis_connection.connection_pool
            connection = None
            try:
                connection = pool.get_connection()
                packed = connection.pack_commands([command(i, names[i]) for i in indices])
                connection.send_packed_command(packed)
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
                trip.failed[name] = exc
                if connection is not None:
                    connection.disconnect()
                    pool.release(connection)
                continue
            sent.append((name, pool, connection, indices))
        for name, pool, connection, indices in sent:
            try:
                self._read(trip, connection, indices)
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
                trip.failed[name] = exc
                connection.disconnect()  # replies may still be on their way: never reuse
            else:
                trip.answered.add(name)
            finally:
                pool.release(connection)
        return trip

    @staticmethod
    def _read(trip: _Trip, connection: Any, indices: list[int]) -> None:
        for index in indices:
            try:
                trip.replies[index] = connection.read_response()
            except redis.exceptions.ResponseError as exc:
                trip.replies[index] = exc  # read whole: the connection stays in step
                trip.stale = trip.stale or isinstance(exc, _STALE_MAP)

    def _refresh(self) -> None:
        """Read the slot map again from any live node (a failover, a resharding)."""
        try:
            self._client.nodes_manager.initialize()
        except (redis.exceptions.RedisError, redis.exceptions.RedisClusterException) as exc:
            _log.debug("redis cache: refreshing the Redis Cluster's slot map failed: %s", exc)

    # -- the cache ---------------------------------------------------------------------

    async def lookup(self, keys: Sequence[CacheKey]) -> Sequence[CacheEntry | None]:
        """One pipelined round trip of GETs per primary that owns some of the keys; keys
        of a node that is down are misses."""
        names = [self._name(k) for k in keys]
        trip = await self._run(names, lambda _, name: ("GET", name))
        return [self._decode(name, reply) for name, reply in zip(names, trip.replies, strict=True)]

    def _decode(self, name: str, reply: Any) -> CacheEntry | None:
        if reply is None or isinstance(reply, Exception):
            return None
        try:
            return decode_entry(reply)
        except ValueError as exc:
            self._undecodable.warning("redis cache: ignoring the value of %s: %s", name, exc)
            return None

    async def insert(self, entries: Sequence[CacheEntry]) -> None:
        """One pipelined round trip of SETs per primary (with the TTL, if any).

        Raises:
            CacheUnavailableError: no primary answers.
            CacheWriteRefusedError: some entries were not stored (their node is down, or
                answered an error: OOM, MOVED during a failover).
        """
        names = [self._name(e.key) for e in entries]
        ttl = ("EX", self.ttl_s) if self.ttl_s else ()
        # Encoding copies the tensors: done in the worker thread, off the event loop.
        trip = await self._run(names, lambda i, name: ("SET", name, encode_entry(entries[i]), *ttl))
        refused = [r for r in trip.replies if r is None or isinstance(r, Exception)]
        if refused:
            first = next((r for r in refused if isinstance(r, Exception)), None)
            failure = next(iter(trip.failed.values()), None)
            why = (
                reply_text(first)
                if isinstance(first, redis.exceptions.ResponseError)
                else "their node is unavailable" + (f" ({failure})" if failure else "")
            )
            raise CacheWriteRefusedError(
                f"Redis at {self.address} did not store {len(refused)} of {len(names)} "
                f"entries: {why}",
                refused=len(refused),
            ) from first

    async def aclose(self) -> None:
        """Close every node's connections (closing sockets does not block)."""
        self._client.close()


def _cluster_client(settings: RedisSettings) -> RedisCluster:
    """Connect (CLUSTER SLOTS from the seed node): blocking, for a worker thread."""
    return RedisCluster(
        host=settings.host,
        port=settings.port,
        # Partial coverage is a failover in progress: the covered slots serve on.
        require_full_coverage=False,
        # Failures are handled per node by the cache, never retried in redis-py's loops.
        retry=Retry(NoBackoff(), 0),
        **settings.connection_kwargs(),
    )


async def open_redis_cluster_cache(settings: RedisSettings) -> RedisClusterCache:
    """Find the cluster from its seed node and PING every primary, to fail early.

    Raises:
        CacheUnavailableError: no node can be reached, one is not in cluster mode, or the
            credentials are refused.
    """
    address = settings.address
    try:
        client = await trio.to_thread.run_sync(_cluster_client, settings)
    except (redis.exceptions.RedisError, redis.exceptions.RedisClusterException) as exc:
        cause = exc.__cause__ or exc
        if isinstance(cause, redis.exceptions.AuthenticationError) or credentials_refused(cause):
            raise CacheUnavailableError(
                f"Redis at {address} rejected the credentials ({cause}); set user and "
                "password in --cache-config or ORCHESTRION_REDIS_USERNAME/"
                "ORCHESTRION_REDIS_PASSWORD"
            ) from exc
        raise CacheUnavailableError(
            f"cannot reach Redis at {address}{' over TLS' if settings.tls else ''}: {cause}"
        ) from exc
    try:
        await trio.to_thread.run_sync(lambda: client.ping(target_nodes=RedisCluster.PRIMARIES))
    except redis.exceptions.RedisError as exc:
        client.close()
        raise CacheUnavailableError(f"Redis at {address}: a primary refused PING: {exc}") from exc
    except BaseException:
        client.close()
        raise
    return RedisClusterCache(client, settings)
