"""An SQLite response cache for orchestrion, written as a third-party cache plugin.

How a cache plugs in
--------------------
orchestrion finds a cache by the ``<name>`` of ``--cache-config <name>,<key>=<value>`` (the
same strings as ``open_server(cache_config=[...])``) in the Python entry-point group
``orchestrion.caches``. This distribution declares, in its ``pyproject.toml``::

    [project.entry-points."orchestrion.caches"]
    sqlite = "orchestrion_sqlite_cache:open_sqlite_cache"

so, once it is installed, ``--cache-config sqlite,path=/var/cache/orchestrion.db`` makes the
server import this module and call the *factory* `open_sqlite_cache` with the parsed
`CacheConfig` (the cache's name and its options, all strings). The factory checks the options
(a `ConfigError` that names the flag for a bad one), opens the backend (a
`CacheUnavailableError` when it cannot), and returns a `ResponseCache` (here through an
awaitable, since opening a file is blocking I/O). The server then owns the cache: its cache
actor calls `lookup` and `insert` with *batches* of operations, reads `usage` for the cache
statistics, and calls `aclose` once, after the last request.

How this cache works
--------------------
One table holds each entry as orchestrion's data-only entry format (`encode_entry`; nothing
is ever pickled) under its key's 16-byte digest, with a ``used`` stamp from a counter that
grows with every insert and hit. When an insert takes the table past ``max_entries``, the rows
with the lowest stamps (the least recently used) are deleted. SQLite calls block, so every
batch of lookups or inserts is one trip to a worker thread (`trio.to_thread.run_sync`) and one
transaction there; the cache has one connection (``concurrency = 1``), guarded by a lock
because trio may run successive trips on different threads.

The file belongs to one server at a time: the connection holds SQLite's lock on it for as
long as the cache is open (``locking_mode=EXCLUSIVE``), so a second server that opens the same
file fails with `CacheUnavailableError` instead of sharing it; to share a cache between
servers use ``redis``. This is also what lets the cache count its entries and bytes in memory
(`usage`) instead of asking SQLite. Entries outlive the server: a server that reopens the file
finds them, and the least recently used order, where the last one left them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import trio

from orchestrion.caches import CacheUsage, ResponseCache
from orchestrion.protocols import (
    CacheConfig,
    CacheEntry,
    CacheKey,
    CacheUnavailableError,
    ConfigError,
    check_option_names,
    decode_entry,
    encode_entry,
    option_int,
)

__all__ = ["DEFAULT_MAX_ENTRIES", "OPTIONS", "SqliteCache", "open_sqlite_cache"]

_log = logging.getLogger("orchestrion.caches.sqlite")

OPTIONS = ("path", "max_entries")
"""The keys of ``--cache-config sqlite,<key>=<value>``: ``path`` (required) and
``max_entries``."""
DEFAULT_MAX_ENTRIES = 100_000
"""How many entries the file holds when ``max_entries`` is not given."""
BUSY_TIMEOUT_S = 2.0
"""How long opening waits for another process to let go of the file."""

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS entries ("
    " digest BLOB PRIMARY KEY NOT NULL,"
    " value BLOB NOT NULL,"
    " used INTEGER NOT NULL)",
    "CREATE INDEX IF NOT EXISTS entries_by_use ON entries (used)",
)


@dataclass
class _Change:
    """What one transaction did to the counters; applied only once it has committed."""

    entries: int = 0
    used_bytes: int = 0
    evictions: int = 0


class SqliteCache(ResponseCache):
    """A `ResponseCache` in an SQLite file, bounded by a number of entries (LRU).

    Open it with `open_sqlite_cache` (``--cache-config sqlite,path=...``), which makes it in
    a worker thread and turns SQLite's errors into orchestrion's.
    """

    immediate = False
    concurrency = 1

    def __init__(self, path: str, *, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        """Open (or create) the cache file at ``path``, which holds up to ``max_entries``.

        This blocks on file I/O; from async code, call it in a thread (as
        `open_sqlite_cache` does).

        Raises:
            ValueError: ``max_entries`` is below 1.
            sqlite3.Error: the file cannot be opened, is not an SQLite database, or is held
                by another process.
        """
        if max_entries < 1:
            raise ValueError("max_entries must be at least 1")
        self.path = path
        self.max_entries = max_entries
        self._lock = threading.Lock()
        self._warned_undecodable = False
        self._evictions = 0
        db = sqlite3.connect(
            path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False
        )
        try:
            # Exclusive before WAL: then SQLite keeps no shared-memory index, and no other
            # process can use the file while this connection is open.
            db.execute("PRAGMA locking_mode = EXCLUSIVE")
            db.execute("PRAGMA journal_mode = WAL")
            db.execute("PRAGMA synchronous = NORMAL")  # a crash may lose entries, never corrupt
            db.execute("BEGIN IMMEDIATE")
            for statement in _SCHEMA:
                db.execute(statement)
            entries, used_bytes, clock = db.execute(
                "SELECT count(*), coalesce(sum(length(value)), 0), coalesce(max(used), 0)"
                " FROM entries"
            ).fetchone()
            db.execute("COMMIT")
        except BaseException:
            db.close()
            raise
        self._db = db
        self._entries = int(entries)
        self._used_bytes = int(used_bytes)
        self._clock = int(clock)
        self._usage = self._snapshot()

    async def lookup(self, keys: Sequence[CacheKey]) -> Sequence[CacheEntry | None]:
        """The entries stored under ``keys``' digests, in one thread trip and transaction.

        Each hit becomes the most recently used entry. A row that does not decode is a miss
        (and left to age out, or be replaced by the next insert of its key).

        Raises:
            CacheUnavailableError: SQLite failed (or the cache is closed).
        """
        digests = [key.digest for key in keys]
        return await trio.to_thread.run_sync(self._lookup_blocking, digests)

    async def insert(self, entries: Sequence[CacheEntry]) -> None:
        """Store ``entries``, replacing what is stored under their digests, and evict the
        least recently used entries beyond ``max_entries``; one thread trip and transaction.

        Raises:
            CacheUnavailableError: SQLite failed (or the cache is closed).
        """
        await trio.to_thread.run_sync(self._insert_blocking, list(entries))

    def usage(self) -> CacheUsage:
        """Entries, evictions (since this cache was opened) and stored bytes, exactly."""
        return self._usage

    async def aclose(self) -> None:
        """Close the connection (in a thread: closing checkpoints the write-ahead log)."""
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(self._close_blocking)

    # The methods below run in a worker thread, one at a time (the lock).

    def _lookup_blocking(self, digests: list[bytes]) -> list[CacheEntry | None]:
        found: list[CacheEntry | None] = []
        with self._transaction() as (db, _):
            for digest in digests:
                row = db.execute("SELECT value FROM entries WHERE digest = ?", (digest,)).fetchone()
                entry = None if row is None else self._decode(digest, row[0])
                if entry is not None:
                    db.execute(
                        "UPDATE entries SET used = ? WHERE digest = ?", (self._tick(), digest)
                    )
                found.append(entry)
        return found

    def _insert_blocking(self, entries: list[CacheEntry]) -> None:
        rows = [(entry.key.digest, encode_entry(entry)) for entry in entries]  # before locking
        with self._transaction() as (db, change):
            for digest, value in rows:
                old = db.execute(
                    "SELECT length(value) FROM entries WHERE digest = ?", (digest,)
                ).fetchone()
                if old is None:
                    change.entries += 1
                else:
                    change.used_bytes -= int(old[0])
                db.execute(
                    "INSERT INTO entries (digest, value, used) VALUES (?, ?, ?)"
                    " ON CONFLICT (digest) DO UPDATE SET value = excluded.value,"
                    " used = excluded.used",
                    (digest, value, self._tick()),
                )
                change.used_bytes += len(value)
            excess = self._entries + change.entries - self.max_entries
            if excess > 0:
                victims = db.execute(
                    "SELECT digest, length(value) FROM entries ORDER BY used LIMIT ?", (excess,)
                ).fetchall()
                db.executemany("DELETE FROM entries WHERE digest = ?", [(d,) for d, _ in victims])
                change.entries -= len(victims)
                change.used_bytes -= sum(int(size) for _, size in victims)
                change.evictions += len(victims)

    def _close_blocking(self) -> None:
        with self._lock:
            self._db.close()

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[tuple[sqlite3.Connection, _Change]]:
        """The connection inside one write transaction, committed when the block ends, and
        a `_Change` to fill in, added to the counters once the transaction has committed.

        Raises:
            CacheUnavailableError: from any `sqlite3.Error` (the transaction rolled back).
        """
        change = _Change()
        with self._lock:
            try:
                self._db.execute("BEGIN IMMEDIATE")
                try:
                    yield self._db, change
                    self._db.execute("COMMIT")
                except BaseException:
                    with contextlib.suppress(sqlite3.Error):
                        self._db.execute("ROLLBACK")
                    raise
            except sqlite3.Error as exc:
                raise CacheUnavailableError(f"SQLite cache {self.path}: {exc}") from exc
            if change != _Change():
                self._entries += change.entries
                self._used_bytes += change.used_bytes
                self._evictions += change.evictions
                self._usage = self._snapshot()  # one assignment: never half an update

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _decode(self, digest: bytes, value: object) -> CacheEntry | None:
        try:
            if not isinstance(value, bytes):  # a row written by something else
                raise ValueError(f"stored as {type(value).__name__}, not as a blob")
            return decode_entry(value)
        except ValueError as exc:
            level = logging.DEBUG if self._warned_undecodable else logging.WARNING
            self._warned_undecodable = True
            _log.log(level, "sqlite cache %s: ignoring entry %s: %s", self.path, digest.hex(), exc)
            return None

    def _snapshot(self) -> CacheUsage:
        return CacheUsage(
            entries=self._entries, evictions=self._evictions, used_bytes=self._used_bytes
        )


async def open_sqlite_cache(config: CacheConfig) -> SqliteCache:
    """The ``sqlite`` entry point: ``--cache-config sqlite,path=<file>`` (and optionally
    ``--cache-config sqlite,max_entries=<n>``, default 100000).

    The file is created if it does not exist; its folder must exist.

    Raises:
        ConfigError: an unknown key, no ``path``, a ``path`` whose folder does not exist or
            that is not an SQLite database, or a ``max_entries`` that is not an integer >= 1.
        CacheUnavailableError: the file cannot be used (held by another server, I/O error).
    """
    check_option_names(config, OPTIONS)
    flag = f"--cache-config {config.name}"
    path = config.options.get("path", "")
    if not path.strip():
        raise ConfigError(f"{flag}: 'path' is required ({flag},path=<file>)")
    max_entries = option_int(config, "max_entries", DEFAULT_MAX_ENTRIES, minimum=1)
    return await trio.to_thread.run_sync(_open_blocking, flag, path, max_entries)


def _open_blocking(flag: str, raw_path: str, max_entries: int) -> SqliteCache:
    """`open_sqlite_cache`'s file checks and opening, in a worker thread."""
    path = os.path.expanduser(raw_path)
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ConfigError(f"{flag},path={raw_path}: the folder {folder} does not exist")
    if os.path.isdir(path):
        raise ConfigError(f"{flag},path={raw_path}: is a folder, not a file")
    try:
        return SqliteCache(path, max_entries=max_entries)
    except sqlite3.Error as exc:
        code = (getattr(exc, "sqlite_errorcode", None) or 0) & 0xFF  # the primary result code
        if code in (sqlite3.SQLITE_NOTADB, sqlite3.SQLITE_CANTOPEN):
            raise ConfigError(
                f"{flag},path={raw_path}: cannot use it as a cache file: {exc}"
            ) from exc
        if code == sqlite3.SQLITE_BUSY:
            raise CacheUnavailableError(
                f"SQLite cache {path} is in use by another process ({exc}); a cache file "
                "serves one server at a time (share a cache between servers with redis)"
            ) from exc
        raise CacheUnavailableError(f"cannot open SQLite cache {path}: {exc}") from exc
