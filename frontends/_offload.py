"""The front ends' heavy work on request and response bodies, off the event loop.

How this works: decoding a request (inflating, parsing JSON, splitting BYTES elements) and
encoding a response cost time in proportion to their size; a large one done on the event loop
holds every other client (a 64 MiB body of BYTES elements held the loop for seconds). Work on
a body of at least `OFF_LOOP_BYTES` runs in a worker thread instead, at most `CODEC_THREADS` at
a time per server process (the rest wait their turn), so a flood of large requests cannot
also hold that many bodies' worth of temporary memory at once; smaller bodies stay on the loop,
where a thread hop (55-107 µs here) would cost more than the work. The thread is waited for,
cancelled or not, so nothing outlives its request.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import trio

T = TypeVar("T")

OFF_LOOP_BYTES = 1 << 20
"""Bodies (or outputs) from this size on are decoded (encoded) in a worker thread."""
CODEC_THREADS = 2
"""Worker threads decoding or encoding large bodies at once (this machine has 2 cores)."""

_LIMITER: trio.lowlevel.RunVar[trio.CapacityLimiter] = trio.lowlevel.RunVar("orchestrion_codec")


async def off_loop(size: int, fn: Callable[..., T], *args: object) -> T:
    """``fn(*args)``: here when ``size`` (bytes of the body it works on) is small, else in a
    worker thread (waited for; errors come back as themselves)."""
    if size < OFF_LOOP_BYTES:
        return fn(*args)
    try:
        limiter = _LIMITER.get()
    except LookupError:
        limiter = trio.CapacityLimiter(CODEC_THREADS)
        _LIMITER.set(limiter)
    return await trio.to_thread.run_sync(fn, *args, limiter=limiter)
