"""The lock that puts model loads and unloads in a row, which a load's own nested calls pass.

Why: a python-backend model's ``initialize`` runs inside its load (in a worker thread) and may
load or unload other models through Triton's model loading API (``pb_utils.load_model``), as
Triton's QA model ``bls_model_loading`` does. Waiting for the lock there would wait for the
load that waits for the ``initialize``: a deadlock.

How this works: a hold is recorded in a context variable of the holder's task. The worker
thread that loads a model's instances runs through `passing_holds`, which turns the holds of
the task that started it into passes in the thread's own context; trio carries that context
into the task ``trio.from_thread.run`` starts for a nested call, which therefore runs under
the hold instead of waiting for it. Only those calls pass: a task started during the hold (a
model's runner) waits like any other, and a pass lasts only while its hold does.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

import attrs
import trio


@attrs.define(eq=False)
class _Hold:
    lock: LoadLock
    active: bool = True


_HOLDS: contextvars.ContextVar[tuple[_Hold, ...]] = contextvars.ContextVar(
    "orchestrion_load_holds", default=()
)
_PASSES: contextvars.ContextVar[tuple[_Hold, ...]] = contextvars.ContextVar(
    "orchestrion_load_passes", default=()
)
T = TypeVar("T")


def passing_holds(fn: Callable[[], T]) -> Callable[[], T]:
    """``fn``, to run in a worker thread (``trio.to_thread.run_sync``) for the current
    task: the calls it makes back into trio pass the load locks this task holds."""
    holds = _HOLDS.get()

    def run() -> T:
        _PASSES.set(holds)  # in the thread's own copy of the context
        return fn()

    return run


@attrs.define(eq=False)
class LoadLock:
    """A `trio.Lock` for loads and unloads that the calls made from inside a hold pass."""

    _lock: trio.Lock = attrs.field(factory=trio.Lock)

    @contextlib.asynccontextmanager
    async def hold(self) -> AsyncIterator[None]:
        """Hold the lock for the block; at once for a call that passes an active hold of it
        (see `passing_holds`)."""
        if any(h.lock is self and h.active for h in _PASSES.get()):
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
