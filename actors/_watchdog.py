"""The event loop's watchdog: names the synchronous code that holds the loop.

Everything a server does runs on one trio event loop; synchronous code on it (a model running
inline that hangs on some input, blocking calls in an async model) stalls every request, and
no timeout can fire until it returns. Nothing can interrupt it, but it must not go unseen: a
trio task stamps a heartbeat every ``TICK`` seconds, and a thread of the watchdog's own
checks it. When the heartbeat is older than the threshold, the thread reads the loop
thread's Python stack and logs what holds the loop (the model and the line it is at), then
logs again when the loop runs again, with the time it was held.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from collections.abc import AsyncIterator
from types import FrameType

import trio

from ._fusion import Fusion
from ._runner import ModelRunner

_log = logging.getLogger("orchestrion")

STALL_AFTER = 1.0
"""Seconds the event loop may be held before the watchdog says so."""
TICK = 0.1
"""Seconds between heartbeats, and between the watchdog's checks."""

_INLINE_CODE = ModelRunner._execute_sync.__code__
_FUSED_CODE = Fusion._run_steps.__code__
_WHOLE_GRAPH_CODE = Fusion._run_graph.__code__
_HINT = (
    'A model that can run this long belongs in a worker thread: parameters { key: "execution" '
    'value: { string_value: "thread" } }'
)


def describe_holder(frame: FrameType | None) -> str:
    """What the loop thread is running, from its innermost ``frame``: the model running
    inline (if any) and the line of code it is at, with what to do about it."""
    if frame is None:
        return "code that has already returned"
    code = frame.f_code
    where = f"{code.co_filename}:{frame.f_lineno} in {code.co_name}"
    outer: FrameType | None = frame
    while outer is not None:
        if outer.f_code is _INLINE_CODE or outer.f_code is _FUSED_CODE:
            # The runner executing: the method's own, or the fused step loop's current one.
            runner = outer.f_locals.get("self" if outer.f_code is _INLINE_CODE else "runner")
            if isinstance(runner, ModelRunner):
                model = runner.model
                return (
                    f"model '{model.name}' (version {model.version}) running inline, at "
                    f"{where}; every request waits until it returns. {_HINT}"
                )
        if outer.f_code is _WHOLE_GRAPH_CODE:
            fusion = outer.f_locals.get("self")
            if isinstance(fusion, Fusion):
                return (
                    f"ensemble '{fusion.name}' running fused (one compiled call of its steps), "
                    f"at {where}; every request waits until it returns"
                )
        outer = outer.f_back
    return f"synchronous code at {where}; every request waits until it returns"


@contextlib.asynccontextmanager
async def watch_event_loop(stall_after: float = STALL_AFTER) -> AsyncIterator[None]:
    """Watch the running event loop for the duration of the block (see the module)."""
    loop_thread = threading.get_ident()
    token = trio.lowlevel.current_trio_token()
    stop = threading.Event()
    asked_at: list[float | None] = [None]  # when the pending ping was sent; None: answered

    def answer() -> None:  # runs on the event loop
        asked_at[0] = None

    def watch() -> None:
        held_since: float | None = None
        while not stop.wait(TICK):
            now = time.monotonic()
            asked = asked_at[0]
            if asked is None:
                if held_since is not None:
                    _log.warning("the event loop runs again, after %.1f s", now - held_since)
                    held_since = None
                asked_at[0] = now
                try:
                    token.run_sync_soon(answer)
                except trio.RunFinishedError:
                    return
            elif held_since is None and now - asked >= stall_after:
                held_since = asked
                holder = describe_holder(sys._current_frames().get(loop_thread))
                _log.error("the event loop has been held for %.1f s by %s", now - asked, holder)

    # A ping through trio's entry queue rather than a sleeping task: no timer of its own, so
    # test clocks (trio.testing.MockClock) and idle servers see no periodic deadline. The
    # thread is the block's own: stopping wakes it at once, and the exit joins it.
    thread = threading.Thread(target=watch, name="orchestrion event loop watchdog")
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
