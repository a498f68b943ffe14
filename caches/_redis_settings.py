"""The ``--cache-config redis`` options, read once for the three ways of reaching Redis, and
the words of its error replies.

How this works: Triton's keys (``host``, ``port``, ``user``, ``password``, ``db``, the
timeouts in ms, ``pool_size``, the TLS files) mean the same thing everywhere. Which Redis they
reach is chosen by one more key:

- nothing more: one Redis server at ``host``:``port``;
- ``cluster=true``: a Redis Cluster, ``host``:``port`` being any one of its nodes (the others
  are found from it);
- ``sentinels=<host>:<port>,...`` with ``sentinel_master=<name>``: the primary that those
  Sentinels name, found again after a failover (``host`` and ``port`` are then not used).

Entries are stored under the same names (``<prefix><32 hex digits>``) in all three, so a
cache can move from one Redis to a cluster without a new key format.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, Literal

import attrs
import redis.exceptions

from ..protocols import CacheConfig, ConfigError, check_option_names, option_bool, option_int

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
    "cluster",
    "sentinels",
    "sentinel_master",
    "sentinel_password",
)
"""Triton's redis cache keys (timeouts in ms), plus ``prefix``, ``ttl`` (s),
``retry_interval`` (ms), ``cluster`` and the Sentinel keys."""

_ENV_USER = ("ORCHESTRION_REDIS_USERNAME", "TRITONCACHE_REDIS_USERNAME")
_ENV_PASSWORD = ("ORCHESTRION_REDIS_PASSWORD", "TRITONCACHE_REDIS_PASSWORD")
_ENV_SENTINEL_PASSWORD = ("ORCHESTRION_REDIS_SENTINEL_PASSWORD",)


def _from_env(config: CacheConfig, key: str, names: Sequence[str]) -> str | None:
    if key in config.options:
        return config.options[key]
    for name in names:
        value = os.environ.get(name)
        if value:
            return value
    return None


@attrs.frozen(kw_only=True)
class RedisSettings:
    """The ``redis`` cache's options, checked. Read them with `redis_settings`."""

    mode: Literal["server", "cluster", "sentinel"]
    host: str
    port: int
    db: int
    user: str | None = attrs.field(repr=False)
    password: str | None = attrs.field(repr=False)
    connect_timeout: float
    """Seconds."""
    socket_timeout: float
    """Seconds."""
    wait_timeout: float
    """Seconds a batch may wait for a pooled connection (one Redis server only)."""
    pool_size: int
    tls: bool
    cert: str | None
    key: str | None
    cacert: str | None
    prefix: str
    ttl: int
    """Seconds; 0: entries do not expire."""
    retry_interval: float
    """Seconds."""
    sentinels: tuple[tuple[str, int], ...] = ()
    sentinel_master: str = ""
    sentinel_password: str | None = attrs.field(default=None, repr=False)

    @property
    def address(self) -> str:
        """Where the cache is, for messages (never a credential)."""
        if self.mode == "sentinel":
            where = ",".join(f"{h}:{p}" for h, p in self.sentinels)
            return f"'{self.sentinel_master}' of the Sentinels at {where}"
        if self.mode == "cluster":
            return f"the cluster of {self.host}:{self.port}"
        return f"{self.host}:{self.port}" + (f"/{self.db}" if self.db else "")

    def connection_kwargs(self) -> dict[str, Any]:
        """redis-py's arguments for one connection: credentials, timeouts, TLS."""
        kwargs: dict[str, Any] = {
            "username": self.user or None,
            "password": self.password or None,
            "socket_connect_timeout": self.connect_timeout,
            "socket_timeout": self.socket_timeout,
        }
        if self.tls:
            kwargs.update(
                ssl=True,
                ssl_certfile=self.cert,
                ssl_keyfile=self.key,
                ssl_ca_certs=self.cacert,
            )
        return kwargs


def _address(config: CacheConfig, text: str) -> tuple[str, int]:
    host, colon, port = text.strip().rpartition(":")
    if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(
            f"--cache-config {config.name},sentinels={config.options['sentinels']}: "
            f"'{text.strip()}' is not <host>:<port> "
            f"(--cache-config {config.name},sentinels=<host>:<port>,<host>:<port>)"
        )
    return host.strip("[]"), int(port)


def _mode(config: CacheConfig) -> Literal["server", "cluster", "sentinel"]:
    cluster = option_bool(config, "cluster")
    sentinel = "sentinels" in config.options or "sentinel_master" in config.options
    if cluster and sentinel:
        raise ConfigError(
            f"--cache-config {config.name}: cluster=true and sentinels name two kinds of "
            "Redis; give one (a Redis Cluster fails over by itself, without Sentinels)"
        )
    if sentinel:
        missing = [
            k for k in ("sentinels", "sentinel_master") if not config.options.get(k, "").strip()
        ]
        if missing:
            raise ConfigError(
                f"--cache-config {config.name}: {' and '.join(repr(k) for k in missing)} "
                f"required with Sentinels (--cache-config {config.name},sentinels=<host>:"
                f"<port>,<host>:<port> --cache-config {config.name},sentinel_master=<name>)"
            )
        return "sentinel"
    return "cluster" if cluster else "server"


def redis_settings(config: CacheConfig) -> RedisSettings:
    """Check the ``--cache-config redis`` options.

    Raises:
        ConfigError: an unknown key, a missing ``host``/``port`` (or Sentinel keys), a
            malformed value, or keys that do not go together.
    """
    check_option_names(config, OPTIONS)
    mode = _mode(config)
    if mode != "sentinel":
        missing = [k for k in ("host", "port") if not config.options.get(k, "").strip()]
        if missing:
            raise ConfigError(
                f"--cache-config {config.name}: {' and '.join(repr(k) for k in missing)} "
                f"required (--cache-config {config.name},host=<host> "
                f"--cache-config {config.name},port=<port>)"
            )
    db = option_int(config, "db", 0, minimum=0)
    if db and mode == "cluster":
        raise ConfigError(
            f"--cache-config {config.name},db={db}: a Redis Cluster has only database 0"
        )
    prefix = config.options.get("prefix", "orchestrion:")
    if mode == "cluster" and "{" in prefix and "}" in prefix.partition("{")[2]:
        # A hash tag would put every entry in one slot, on one node: no cluster at all.
        raise ConfigError(
            f"--cache-config {config.name},prefix={prefix}: braces make a Redis Cluster hash "
            "tag, which would keep every entry on one node; choose a prefix without {...}"
        )
    tls = option_bool(config, "tls_enabled")
    files = {k: config.options.get(k) for k in ("cert", "key", "cacert")}
    if not tls and any(files.values()):
        raise ConfigError(
            f"--cache-config {config.name}: cert, key and cacert need tls_enabled=true "
            f"(--cache-config {config.name},tls_enabled=true)"
        )
    for option, path in files.items():
        if path and not os.path.isfile(path):
            raise ConfigError(f"--cache-config {config.name},{option}={path}: no such file")
    sentinels: tuple[tuple[str, int], ...] = ()
    if mode == "sentinel":
        parts = [p for p in config.options["sentinels"].split(",") if p.strip()]
        sentinels = tuple(_address(config, p) for p in parts)
    return RedisSettings(
        mode=mode,
        host=config.options.get("host", "").strip(),
        port=option_int(config, "port", 6379, minimum=1),
        db=db,
        user=_from_env(config, "user", _ENV_USER) or None,
        password=_from_env(config, "password", _ENV_PASSWORD) or None,
        connect_timeout=option_int(config, "connect_timeout", 1000, minimum=1) / 1000,
        socket_timeout=option_int(config, "socket_timeout", 1000, minimum=1) / 1000,
        wait_timeout=option_int(config, "wait_timeout", 1000, minimum=1) / 1000,
        # Each pooled connection gets a worker thread; on 2 cores, more than 2 threads fight
        # over the GIL and lose throughput (bench/cache.py: 28k lookups/s at 1, 23k at 2,
        # 14k at 4).
        pool_size=option_int(config, "pool_size", 2, minimum=1),
        tls=tls,
        cert=files["cert"],
        key=files["key"],
        cacert=files["cacert"],
        prefix=prefix,
        ttl=option_int(config, "ttl", 0, minimum=0),
        retry_interval=option_int(config, "retry_interval", 1000, minimum=1) / 1000,
        sentinels=sentinels,
        sentinel_master=config.options.get("sentinel_master", "").strip(),
        sentinel_password=_from_env(config, "sentinel_password", _ENV_SENTINEL_PASSWORD),
    )


def reply_text(exc: redis.exceptions.ResponseError) -> str:
    """Redis's error reply as Redis wrote it (redis-py strips a known code such as ``OOM``)."""
    code = exc.status_code
    return f"{code} {exc}" if code and not str(exc).startswith(code) else str(exc)


def credentials_refused(exc: BaseException) -> bool:
    """Whether a reply (or redis-py's error) says the user or password was refused."""
    text = str(exc)
    return any(word in text for word in ("WRONGPASS", "NOAUTH", "invalid password"))
