"""The cache actor: the one owner of the server's cache, between the models and the backend.

How this works. A request for a model with ``response_cache`` enabled asks `CacheActor.begin`
for its key and gets a `Flight`:

- a *hit* (``flight.entry`` set): the stored response, checked against the key's signature;
- a *shared* result: an identical request was already running the model, and this one waited
  for it (single-flight) instead of running the model again;
- a *miss*: the caller runs the model, then calls ``flight.store(response)``, and always
  ``flight.release()`` (a ``finally``), which wakes the identical requests waiting on it. A
  failed or cancelled run stores nothing; its waiters then run the model themselves, so a
  failure is never handed out as if it were a result.

An *immediate* cache (``local``) is called inline in the requesting task. Any other cache
is driven by ``concurrency`` worker tasks that take operations from one channel and hand
them to the cache in batches (everything queued when a worker comes for work), so a Redis
backend makes one thread hop and one pipelined round trip per batch. Inserts do not make the
request wait: they are queued and the workers write them (dropped, and counted, if the queue
is full); until a queued insert is written, lookups of its key are answered from the queue,
so a request that follows a miss always hits. When the backend fails, the actor answers
"miss" and drops inserts for the cache's ``retry_interval``, logs one error per outage, and
logs again when it recovers. A backend that answers but refuses to store
(`CacheWriteRefusedError`: a full Redis) is not down: lookups go on, the refused entries are
counted as not stored, and one warning is logged when the refusals begin (at most one a
minute).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import attrs
import trio

from ..protocols import (
    CacheEntry,
    CacheKey,
    CacheStatistics,
    CacheUnavailableError,
    CacheWriteRefusedError,
    InferResponse,
    frozen_outputs,
    ungrouped,
)
from ._protocol import ResponseCache

_log = logging.getLogger("orchestrion.caches")

QUEUE_SIZE = 1024
"""Operations that may wait for the workers; lookups beyond it wait for room."""
MAX_BATCH = 256
"""Operations one worker hands to the cache at once."""


@attrs.define(eq=False)
class Throttled:
    """A warning that is logged at most once per ``every`` seconds: a cache that keeps
    meeting bad entries must not flood the log, nor go quiet for good after the first one.
    The warnings held back are logged at DEBUG and counted into the next one."""

    logger: logging.Logger
    every: float = 60.0
    _next_at: float = float("-inf")
    _held: int = 0

    def warning(self, message: str, *args: object) -> bool:
        """Log ``message % args`` as a warning, unless one went out in the last ``every`` s.

        Returns:
            whether it was logged as a warning (False: held back, at DEBUG).
        """
        now = time.monotonic()
        if now < self._next_at:
            self._held += 1
            self.logger.debug(message, *args)
            return False
        if self._held:
            message += " (and %d more like it in the last %.0f s)"
            args = (*args, self._held, self.every)
        self._held = 0
        self._next_at = now + self.every
        self.logger.warning(message, *args)
        return True


@attrs.define(eq=False, slots=True)
class _Lookup:
    key: CacheKey
    done: trio.Event = attrs.field(factory=trio.Event)
    entry: CacheEntry | None = None


@attrs.define(eq=False, slots=True)
class _Insert:
    entry: CacheEntry


@attrs.define(eq=False, slots=True)
class Flight:
    """One request's passage through the cache. Get one from `CacheActor.begin`."""

    _actor: CacheActor
    key: CacheKey
    entry: CacheEntry | None = None
    """The stored (or shared) response; None: run the model, then `store`."""
    shared: bool = False
    """The entry came from an identical request that ran at the same time."""
    lookup_ns: int = 0
    """Time spent finding out (waiting for an identical request included)."""
    insert_ns: int = 0
    _done: trio.Event | None = None
    """Set when this flight leads: identical requests wait on it."""

    def store(self, response: InferResponse) -> None:
        """Cache ``response`` (a successful one) and hand it to the waiting requests."""
        self.store_entry(CacheEntry(key=self.key, outputs=frozen_outputs(response.outputs)))

    def store_entry(self, entry: CacheEntry) -> None:
        """Cache ``entry`` (made for this flight's key: a whole stream, say) and hand it to
        the waiting requests."""
        start = time.perf_counter_ns()
        self.entry = entry
        self._actor._insert(entry)
        self.insert_ns = time.perf_counter_ns() - start

    def reject(self, problem: str) -> None:
        """The entry found does not fit the request (``problem`` says why: a foreign or
        crafted value): count a miss instead of a hit and log it; the caller now runs the
        model, `store`s a right entry over the wrong one, and identical requests wait for it."""
        actor = self._actor
        actor.hits -= 1
        actor.misses += 1
        actor.rejected += 1
        actor._misfits.warning(
            "%s cache: ignoring the entry stored under key %s for a request of '%s' (%s); "
            "treated as a miss",
            actor.name,
            self.key.hex,
            self.key.model_name,
            problem,
        )
        self.entry = None
        if self._done is None and self.key.digest not in actor._flights:
            self._done = trio.Event()
            actor._flights[self.key.digest] = self

    def release(self) -> None:
        """End the flight: wake identical requests (they share `entry`, or run themselves)."""
        done = self._done
        if done is not None:
            self._done = None
            self._actor._landed(self)
            done.set()


@attrs.define(eq=False)
class CacheActor:
    """Owns a `ResponseCache`: lookups, inserts, single-flight, batching, outage handling."""

    cache: ResponseCache
    name: str
    lookups: int = 0
    hits: int = 0
    frontend_hits: int = 0
    """Hits answered by a tier in front of the cache (counted in ``hits`` too)."""
    _frontend_usage: tuple[int, int] | None = None
    misses: int = 0
    coalesced: int = 0
    insertions: int = 0
    insert_failures: int = 0
    errors: int = 0
    batches: int = 0
    lookup_ns: int = 0
    insert_ns: int = 0
    _available: bool = True
    _probing: bool = False
    """A lookup is testing whether the backend is back."""
    _retry_at: float = 0.0
    _epoch: int = 0
    """Outages begun and ended so far: an operation that began before the latest change and
    ends after it says nothing about the backend now (a slow batch of another worker), so
    it neither ends nor begins an outage."""
    _flights: dict[bytes, Flight] = attrs.field(factory=dict)
    _pending: dict[bytes, CacheEntry] = attrs.field(factory=dict)
    """Entries queued for a batched backend: hits until written (read your own writes)."""
    rejected: int = 0
    """Entries found that did not fit their request (counted as misses too)."""
    _send: trio.MemorySendChannel[_Lookup | _Insert] | None = None
    _misfits: Throttled = attrs.field(factory=lambda: Throttled(_log))
    _refusing: bool = False
    """The backend refuses writes (since the last insert it took whole)."""
    _refusal_warned: bool = False
    """The warning for the refusals going on now went out (not held back)."""
    _refusals: Throttled = attrs.field(factory=lambda: Throttled(_log))

    # -- the request side ------------------------------------------------------------------

    async def begin(self, key: CacheKey) -> Flight:
        """Look ``key`` up, or join an identical request that is running the model.

        Returns:
            a flight: ``entry`` set on a hit (or a shared result); otherwise the caller
            runs the model, calls `Flight.store` on success and `Flight.release` always.
        """
        start = time.perf_counter_ns()
        while (leader := self._flights.get(key.digest)) is not None and leader.key == key:
            done = leader._done
            assert done is not None
            await done.wait()
            if leader.entry is not None:
                self.coalesced += 1
                self.lookups += 1  # answered by the cache layer: a hit, like any other
                self.hits += 1
                return Flight(
                    self,
                    key,
                    entry=leader.entry,
                    shared=True,
                    lookup_ns=time.perf_counter_ns() - start,
                )
            # The leader failed or was cancelled and shares nothing (never a failure): look
            # again; the first of the waiters to get here leads, the others wait for it.
        flight = Flight(self, key)
        pending = self._pending.get(key.digest)
        if pending is not None and pending.matches(key):  # stored, on its way to the backend
            flight.entry = self._accept(key, pending)
            await trio.lowlevel.checkpoint()
            flight.lookup_ns = time.perf_counter_ns() - start
            self.lookup_ns += flight.lookup_ns
            return flight
        if self.cache.immediate:
            flight.entry = self._lookup_now(key)
            if flight.entry is not None:
                # A hit awaits nothing else: still a cancellation and a scheduling point.
                await trio.lowlevel.checkpoint()
        else:
            # Lead before the first wait, so identical requests arriving meanwhile join.
            flight._done = trio.Event()
            self._flights[key.digest] = flight
            try:
                flight.entry = await self._lookup_queued(key)
            except BaseException:
                flight.release()
                raise
        if flight.entry is None and flight._done is None:
            flight._done = trio.Event()
            self._flights[key.digest] = flight
        flight.lookup_ns = time.perf_counter_ns() - start
        self.lookup_ns += flight.lookup_ns
        return flight

    def _landed(self, flight: Flight) -> None:
        if self._flights.get(flight.key.digest) is flight:
            del self._flights[flight.key.digest]

    def _accept(self, key: CacheKey, entry: CacheEntry | None) -> CacheEntry | None:
        self.lookups += 1
        if entry is not None and not entry.matches(key):
            self.rejected += 1
            self._misfits.warning(
                "%s cache: an entry stored under the key of a request for '%s' belongs to "
                "another request (a digest collision, or another writer); treated as a miss",
                self.name,
                key.model_name,
            )
            entry = None
        if entry is None:
            self.misses += 1
        else:
            self.hits += 1
        return entry

    def _lookup_now(self, key: CacheKey) -> CacheEntry | None:
        if not self._usable():
            return self._accept(key, None)
        try:
            entry = self.cache.lookup_nowait(key)
        except Exception as exc:
            self._failed(exc)
            entry = None
        else:
            self._recovered()
        return self._accept(key, entry)

    async def _lookup_queued(self, key: CacheKey) -> CacheEntry | None:
        if self._send is None or not self._usable():
            return self._accept(key, None)
        op = _Lookup(key)
        try:
            await self._send.send(op)
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            return self._accept(key, None)  # closing: run uncached
        await op.done.wait()
        return self._accept(key, op.entry)

    def _insert(self, entry: CacheEntry) -> None:
        if not self._available:  # inserts never probe a backend that is down
            self.insert_failures += 1
            return
        if self.cache.immediate:
            start = time.perf_counter_ns()
            try:
                self.cache.insert_nowait(entry)
            except CacheWriteRefusedError as exc:
                self._refused(exc, 1)
            except Exception as exc:
                self._failed(exc)
                self.insert_failures += 1
            else:
                self._recovered()
                self._accepted()
                self.insertions += 1
            self.insert_ns += time.perf_counter_ns() - start
            return
        if self._send is None:  # the actor has stopped (the server is being torn down)
            self.insert_failures += 1
            return
        try:
            self._send.send_nowait(_Insert(entry))
        except (trio.WouldBlock, trio.ClosedResourceError, trio.BrokenResourceError):
            self.insert_failures += 1
        else:
            self._pending[entry.key.digest] = entry

    # -- outages ---------------------------------------------------------------------------

    def _usable(self) -> bool:
        """Whether a lookup may go to the backend now. While it is down, one lookup per
        ``retry_interval`` probes it; every other request is answered "miss" at once
        instead of queueing behind a probe that may hang for a socket timeout."""
        if self._available:
            return True
        if self._probing or trio.current_time() < self._retry_at:
            return False
        self._probing = True
        return True

    def _failed(self, exc: Exception, epoch: int | None = None) -> None:
        """An operation failed; ``epoch``: `_epoch` when it began (None: it ran
        synchronously, just now)."""
        self.errors += 1
        if epoch is not None and epoch != self._epoch:
            return  # stale: it began before the outage began or ended
        self._probing = False
        self._retry_at = trio.current_time() + self.cache.retry_interval
        if not self._available:
            _log.debug("%s cache still unavailable: %s", self.name, exc)
            return
        self._available = False
        self._epoch += 1
        _log.error(
            "%s cache unavailable, serving requests uncached and retrying every %.1f s: %s",
            self.name,
            self.cache.retry_interval,
            exc,
            exc_info=not isinstance(exc, CacheUnavailableError),
        )

    def _recovered(self, epoch: int | None = None) -> None:
        """An operation succeeded; ``epoch`` as for `_failed`."""
        if epoch is not None and epoch != self._epoch:
            return  # stale: it began before the outage began or ended
        self._probing = False
        if not self._available:
            self._available = True
            self._epoch += 1
            _log.warning("%s cache is available again; caching resumed", self.name)

    def _refused(self, exc: CacheWriteRefusedError, count: int) -> None:
        """The backend answered but did not store ``exc.refused`` of ``count`` entries: not
        an outage (lookups go on); warn once when the refusals begin, at most once a minute
        (a Redis just at its limit takes a write now and then, refuses the next ones)."""
        refused = max(0, min(exc.refused, count))
        self.insert_failures += refused
        self.insertions += count - refused
        if self._refusing:
            _log.debug("%s cache still refuses writes: %s", self.name, exc)
            return
        self._refusing = True
        self._refusal_warned = self._refusals.warning(
            "%s cache refused to store responses (%s); stored ones are still served, new ones "
            "are not cached until it takes writes again",
            self.name,
            exc,
        )

    def _accepted(self) -> None:
        """An insert was stored whole: the refusals, if any, are over."""
        if self._refusing:
            self._refusing = False
            level = logging.INFO if self._refusal_warned else logging.DEBUG
            _log.log(level, "%s cache takes writes again; responses are stored", self.name)

    # -- the workers -----------------------------------------------------------------------

    async def serve(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Run the workers (none for an immediate cache) until `close`."""
        if self.cache.immediate:
            task_status.started()
            return
        send, receive = trio.open_memory_channel[_Lookup | _Insert](QUEUE_SIZE)
        self._send = send
        try:
            async with receive, trio.open_nursery() as nursery:
                for _ in range(max(1, self.cache.concurrency)):
                    nursery.start_soon(self._worker, receive.clone())
                task_status.started()
        finally:
            self._send = None
            with contextlib.suppress(trio.ClosedResourceError):
                while True:  # answer what no worker will: those requests run uncached
                    try:
                        op = receive.receive_nowait()
                    except (trio.WouldBlock, trio.EndOfChannel):
                        break
                    if isinstance(op, _Lookup):
                        op.done.set()

    async def _worker(self, receive: trio.MemoryReceiveChannel[_Lookup | _Insert]) -> None:
        async with receive:
            async for op in receive:
                batch = [op]
                while len(batch) < MAX_BATCH:
                    try:
                        batch.append(receive.receive_nowait())
                    except (trio.WouldBlock, trio.EndOfChannel):
                        break
                try:
                    await self._run_batch(batch)
                finally:  # cancelled or not, nobody may wait for this batch forever
                    for item in batch:
                        if isinstance(item, _Lookup):
                            item.done.set()

    async def _run_batch(self, batch: list[_Lookup | _Insert]) -> None:
        lookups = [op for op in batch if isinstance(op, _Lookup)]
        inserts = [op.entry for op in batch if isinstance(op, _Insert)]
        if lookups and (self._available or self._probing):
            self.batches += 1
            epoch = self._epoch
            try:
                found = await self.cache.lookup([op.key for op in lookups])
                if len(found) != len(lookups):
                    raise RuntimeError(
                        f"{type(self.cache).__name__}.lookup returned {len(found)} results "
                        f"for {len(lookups)} keys"
                    )
            except Exception as exc:
                self._failed(exc, epoch)
            else:
                self._recovered(epoch)
                for op, entry in zip(lookups, found, strict=True):
                    op.entry = entry
        for op in lookups:
            op.done.set()
        if not inserts:
            return
        try:
            await self._store_batch(inserts)
        finally:
            for entry in inserts:
                if self._pending.get(entry.key.digest) is entry:
                    del self._pending[entry.key.digest]

    async def _store_batch(self, inserts: list[CacheEntry]) -> None:
        if not self._available:
            self.insert_failures += len(inserts)
            return
        start = time.perf_counter_ns()
        self.batches += 1
        epoch = self._epoch
        try:
            await self.cache.insert(inserts)
        except CacheWriteRefusedError as exc:
            self._refused(exc, len(inserts))
        except Exception as exc:
            self._failed(exc, epoch)
            self.insert_failures += len(inserts)
        else:
            self._recovered(epoch)
            self._accepted()
            self.insertions += len(inserts)
        self.insert_ns += time.perf_counter_ns() - start

    def close(self) -> None:
        """Accept no more operations; the workers finish what is queued, then end."""
        if self._send is not None:
            self._send.close()

    # -- statistics ------------------------------------------------------------------------

    def count_hits(self, count: int) -> None:
        """Count ``count`` lookups that hit in a tier in front of this cache (the native
        front end's), so the cache-wide counters add up."""
        self.lookups += count
        self.hits += count
        self.frontend_hits += count

    def frontend_usage(self, entries: int, used_bytes: int) -> None:
        """What the tier in front of this cache holds now."""
        self._frontend_usage = (entries, used_bytes)

    def statistics(self) -> CacheStatistics:
        """A snapshot of the actor's counters and the cache's usage."""
        usage = self.cache.usage()
        depth = 0
        if self._send is not None:
            depth = self._send.statistics().current_buffer_used
        return CacheStatistics(
            name=self.name,
            lookups=self.lookups,
            hits=self.hits,
            misses=self.misses,
            coalesced=self.coalesced,
            insertions=self.insertions,
            insert_failures=self.insert_failures,
            errors=self.errors,
            batches=self.batches,
            lookup_ns=self.lookup_ns,
            insert_ns=self.insert_ns,
            queue_depth=depth,
            available=self._available,
            entries=usage.entries,
            evictions=usage.evictions,
            used_bytes=usage.used_bytes,
            capacity_bytes=usage.capacity_bytes,
            frontend_hits=self.frontend_hits,
            frontend_entries=self._frontend_usage[0] if self._frontend_usage else None,
            frontend_bytes=self._frontend_usage[1] if self._frontend_usage else None,
        )


@contextlib.asynccontextmanager
async def open_cache_actor(cache: ResponseCache, name: str) -> AsyncIterator[CacheActor]:
    """Run a `CacheActor` that owns ``cache``; ``cache.aclose()`` runs on the way out.

    Leaving normally lets the workers write the inserts still queued. Errors of the body
    leave as themselves (not wrapped in the workers' nursery's exception group).
    """
    actor = CacheActor(cache, name)
    try:
        async with ungrouped(trio.open_nursery()) as nursery:
            await nursery.start(actor.serve)
            yield actor  # an error here cancels the workers (the nursery's own doing)
            actor.close()
    finally:
        with trio.CancelScope(shield=True) as scope:
            scope.deadline = trio.current_time() + 10  # a stuck backend cannot hold us forever
            await cache.aclose()
