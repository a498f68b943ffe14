"""The lock that puts model loads and unloads in a row, which a load's own nested calls pass.

Why: a python-backend model's ``initialize`` runs inside its load (in a worker thread) and may
load or unload other models through Triton's model loading API (``pb_utils.load_model``), as
Triton's QA model ``bls_model_loading`` does. Waiting for the lock there would wait for the
load that waits for the ``initialize``: a deadlock.

How this works: a hold is recorded in a context variable for the holder's own calls; trio
copies the context into the worker thread that runs ``initialize`` and back into the task
that ``trio.from_thread.run`` starts for the nested call, which therefore sees the hold and
runs under it instead of waiting. A hold ends with its ``async with``: a task started during
it (a model's runner) keeps the context but passes no more.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import AsyncIterator

import attrs
import trio


@attrs.define(eq=False)
class _Hold:
    lock: LoadLock
    active: bool = True


_HOLDS: contextvars.ContextVar[tuple[_Hold, ...]] = contextvars.ContextVar(
    "orchestrion_load_holds", default=()
)


@attrs.define(eq=False)
class LoadLock:
    """A `trio.Lock` for loads and unloads that the calls made from inside a hold pass."""

    _lock: trio.Lock = attrs.field(factory=trio.Lock)

    @contextlib.asynccontextmanager
    async def hold(self) -> AsyncIterator[None]:
        """Hold the lock for the block; at once when this context's own hold is active."""
        if any(h.lock is self and h.active for h in _HOLDS.get()):
            yield
            return
        async with self._lock:
            hold = _Hold(self)
            token = _HOLDS.set((*_HOLDS.get(), hold))
            try:
                yield
            finally:
                hold.active = False
                _HOLDS.reset(token)
