"""The ``redis`` cache: responses in a Redis server, shared by every server that uses it.

How this works: redis-py's synchronous client (with the hiredis parser) over a blocking
connection pool of ``pool_size`` connections. redis-py's own asyncio client cannot run on
trio, so each *batch* of operations makes one trip to a worker thread and one pipelined round
trip to Redis; the cache actor gathers the batches (up to ``pool_size`` at once), so the
thread hop is paid per batch, not per request. Values are orchestrion's data-only entry
format (`encode_entry`), under ``<prefix><32 hex digits>``, with an optional TTL. Every
redis-py error becomes a `CacheUnavailableError`, which the actor turns into uncached
service until Redis answers again; except error replies to SETs (a full Redis answers OOM,
a replica READONLY), which become an `CacheWriteRefusedError`: Redis is up and still serves
reads, only the refused entries are lost.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

import redis
import redis.exceptions
import trio
from redis.backoff import NoBackoff
from redis.retry import Retry

from ..protocols import (
    CacheConfig,
    CacheEntry,
    CacheKey,
    CacheUnavailableError,
    CacheWriteRefusedError,
    ConfigError,
    check_option_names,
    decode_entry,
    encode_entry,
    option_bool,
    option_int,
)
from ._actor import Throttled
from ._protocol import ResponseCache

_log = logging.getLogger("orchestrion.caches")

OPTIONS = (
    "host",
    "port",
    "user",
    "password",
    "db",
    "connect_timeout",
    "socket_timeout",
    "pool_size",
    "wait_timeout",
    "tls_enabled",
    "cert",
    "key",
    "cacert",
    "prefix",
    "ttl",
    "retry_interval",
)
"""Triton's redis cache keys (timeouts in ms), plus ``prefix``, ``ttl`` (s) and
``retry_interval`` (ms)."""

_ENV_USER = ("ORCHESTRION_REDIS_USERNAME", "TRITONCACHE_REDIS_USERNAME")
_ENV_PASSWORD = ("ORCHESTRION_REDIS_PASSWORD", "TRITONCACHE_REDIS_PASSWORD")


def _from_env(config: CacheConfig, key: str, names: Sequence[str]) -> str | None:
    if key in config.options:
        return config.options[key]
    for name in names:
        value = os.environ.get(name)
        if value:
            return value
    return None


class RedisCache(ResponseCache):
    """A `ResponseCache` on a Redis server. Open it with `open_redis_cache`."""

    def __init__(
        self,
        client: redis.Redis,
        *,
        address: str,
        prefix: str,
        ttl_s: int,
        concurrency: int,
        retry_interval: float,
    ) -> None:
        self._client = client
        self.address = address
        self.prefix = prefix
        self.ttl_s = ttl_s
        self.concurrency = concurrency
        self.retry_interval = retry_interval
        self._limiter = trio.CapacityLimiter(concurrency)
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
                f"{_reply(refusals[0])}",
                refused=len(refusals),
            ) from refusals[0]

    async def aclose(self) -> None:
        """Close every pooled connection (closing sockets does not block)."""
        _close(self._client)


def _settings(config: CacheConfig) -> dict[str, Any]:
    """redis-py's connection-pool arguments from the ``--cache-config redis`` options.

    Raises:
        ConfigError: a missing ``host``/``port`` or a malformed option.
    """
    check_option_names(config, OPTIONS)
    missing = [k for k in ("host", "port") if not config.options.get(k, "").strip()]
    if missing:
        raise ConfigError(
            f"--cache-config redis: {' and '.join(repr(k) for k in missing)} required "
            "(--cache-config redis,host=<host> --cache-config redis,port=<port>)"
        )
    host = config.options["host"].strip()
    port = option_int(config, "port", minimum=1)
    db = option_int(config, "db", 0, minimum=0)
    connect_ms = option_int(config, "connect_timeout", 1000, minimum=1)
    socket_ms = option_int(config, "socket_timeout", 1000, minimum=1)
    wait_ms = option_int(config, "wait_timeout", 1000, minimum=1)
    # Each pooled connection gets a worker thread; on 2 cores, more than 2 threads fight over
    # the GIL and lose throughput (bench/cache.py: 28k lookups/s at 1, 23k at 2, 14k at 4).
    pool_size = option_int(config, "pool_size", 2, minimum=1)
    option_int(config, "ttl", 0, minimum=0)  # checked here, used by the cache
    option_int(config, "retry_interval", 1000, minimum=1)
    tls = option_bool(config, "tls_enabled")
    files = {k: config.options.get(k) for k in ("cert", "key", "cacert")}
    if not tls and any(files.values()):
        raise ConfigError(
            "--cache-config redis: cert, key and cacert need tls_enabled=true "
            "(--cache-config redis,tls_enabled=true)"
        )
    for option, path in files.items():
        if path and not os.path.isfile(path):
            raise ConfigError(f"--cache-config redis,{option}={path}: no such file")
    user = _from_env(config, "user", _ENV_USER)
    password = _from_env(config, "password", _ENV_PASSWORD)
    address = f"{host}:{port}" + (f"/{db}" if db else "")
    kwargs: dict[str, Any] = {
        "host": host,
        "port": port,
        "db": db,
        "username": user or None,
        "password": password or None,
        "socket_connect_timeout": connect_ms / 1000,
        "socket_timeout": socket_ms / 1000,
        "max_connections": pool_size,
        "timeout": wait_ms / 1000,
        # One immediate retry on a fresh connection: a pooled connection to a Redis that has
        # restarted fails once, and that must not count as an outage.
        # (Never on a timeout: a hung Redis must cost one socket_timeout, not two.)
        "retry": Retry(NoBackoff(), 1, supported_errors=(redis.exceptions.ConnectionError,)),
        "address": address,
    }
    if tls:
        kwargs.update(
            connection_class=redis.SSLConnection,
            ssl_certfile=files["cert"],
            ssl_keyfile=files["key"],
            ssl_ca_certs=files["cacert"],
        )
    return kwargs


async def open_redis_cache(config: CacheConfig) -> RedisCache:
    """The ``redis`` entry point: connects, and PINGs once to fail early.

    Raises:
        ConfigError: a missing ``host``/``port`` or a malformed option.
        CacheUnavailableError: Redis cannot be reached or refuses the credentials.
    """
    kwargs = _settings(config)
    address = kwargs.pop("address")
    tls = kwargs.get("connection_class") is redis.SSLConnection
    pool = redis.BlockingConnectionPool(**kwargs)  # type: ignore[no-untyped-call]
    client = redis.Redis(connection_pool=pool)
    try:
        await trio.to_thread.run_sync(client.ping)
    except (redis.exceptions.AuthenticationError, redis.exceptions.ResponseError) as exc:
        _close(client)
        if isinstance(exc, redis.exceptions.AuthenticationError) or _refused(exc):
            raise CacheUnavailableError(
                f"Redis at {address} rejected the credentials ({exc}); set user and password "
                "in --cache-config or ORCHESTRION_REDIS_USERNAME/ORCHESTRION_REDIS_PASSWORD"
            ) from exc
        raise CacheUnavailableError(f"Redis at {address} refused PING: {exc}") from exc
    except redis.exceptions.RedisError as exc:
        _close(client)
        raise CacheUnavailableError(
            f"cannot reach Redis at {address}{' over TLS' if tls else ''}: {exc}"
        ) from exc
    except BaseException:
        _close(client)
        raise
    return RedisCache(
        client,
        address=address,
        prefix=config.options.get("prefix", "orchestrion:"),
        ttl_s=option_int(config, "ttl", 0, minimum=0),
        concurrency=kwargs["max_connections"],
        retry_interval=option_int(config, "retry_interval", 1000, minimum=1) / 1000,
    )


def _reply(exc: redis.exceptions.ResponseError) -> str:
    """Redis's error reply as Redis wrote it (redis-py strips a known code such as ``OOM``)."""
    code = exc.status_code
    return f"{code} {exc}" if code and not str(exc).startswith(code) else str(exc)


def _refused(exc: Exception) -> bool:
    text = str(exc)
    return any(word in text for word in ("WRONGPASS", "NOAUTH", "invalid password"))


def _close(client: redis.Redis) -> None:
    # A client given its own pool leaves the pool open on close(): disconnect it too.
    client.close()
    client.connection_pool.disconnect()
