"""The event loop's watchdog: names the synchronous code that holds the loop.

Everything a server does runs on one trio event loop; synchronous code on it (a model running
inline that hangs on some input, blocking calls in an async model) stalls every request, and
no timeout can fire until it returns. Nothing can interrupt it, but it must not go unseen: a
thread of the watchdog's own pings the loop through trio's entry queue every ``TICK`` seconds.
When a ping has waited longer than the threshold, the thread reads the loop thread's Python
stack (for the line it is at) and the loop's `LoopHolder` (which the runner and fusion set
while a model or a fused ensemble runs inline), and logs what holds the loop; then it logs
again when the loop runs again, with the time it was held. Code that holds the GIL for the
whole time (one long call into C, on the loop or in a worker thread) also keeps the watchdog's
thread from running: the ping it answers late says for how long, and that is logged after.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import AsyncIterator
from types import FrameType
from typing import Protocol

import attrs
import trio

from ..protocols import ConfigError

_log = logging.getLogger("orchestrion")

STALL_AFTER = 1.0
"""Seconds the event loop may be held before the watchdog says so (unless the environment
variable `STALL_VARIABLE` says otherwise)."""
STALL_VARIABLE = "ORCHESTRION_LOOP_STALL_SECONDS"
"""The environment variable that sets the watchdog's threshold in seconds (a process-wide
setting, read when a server opens)."""
TICK = 0.1
"""Seconds between the watchdog's pings of the event loop (and its checks), at most; a
threshold under half a second ticks five times per threshold."""

THREAD_HINT = (
    'A model that can run this long belongs in a worker thread: parameters { key: "execution" '
    'value: { string_value: "thread" } }'
)


class HoldsLoop(Protocol):
    """What can run inline on the event loop: a model's instances, a fused ensemble."""

    def holds_loop_as(self, where: str) -> str:
        """What holds the loop, at ``where`` (a file, line and function), and what to do."""
        ...


@attrs.define(eq=False)
class LoopHolder:
    """What runs inline on one event loop now, set around each inline execution (a plain
    attribute: the watchdog's thread reads it while the loop is held)."""

    runs: HoldsLoop | None = None


_holders: dict[int, LoopHolder] = {}


def loop_holder() -> LoopHolder:
    """The `LoopHolder` of the calling thread's event loop."""
    return _holders.setdefault(threading.get_ident(), LoopHolder())


def describe_holder(frame: FrameType | None, runs: HoldsLoop | None = None) -> str:
    """What the loop thread is running, from its innermost ``frame`` and what its
    `LoopHolder` says runs inline (if anything): the model or fused ensemble and the line of
    code it is at, with what to do about it."""
    if frame is None:
        return "code that has already returned"
    code = frame.f_code
    where = f"{code.co_filename}:{frame.f_lineno} in {code.co_name}"
    if runs is None:
        return f"synchronous code at {where}; every request waits until it returns"
    return runs.holds_loop_as(where)


def stall_threshold() -> float:
    """The watchdog's threshold: `STALL_VARIABLE` when set to a positive number of seconds,
    else `STALL_AFTER`.

    Raises:
        ConfigError: the variable is set to something else.
    """
    text = os.environ.get(STALL_VARIABLE, "")
    if not text:
        return STALL_AFTER
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ConfigError(f"{STALL_VARIABLE}={text!r}: expected a positive number of seconds")
    return value


@contextlib.asynccontextmanager
async def watch_event_loop(stall_after: float | None = None) -> AsyncIterator[None]:
    """Watch the running event loop for the duration of the block (see the module);
    ``stall_after``: the threshold in seconds (None: `stall_threshold`)."""
    if stall_after is None:
        stall_after = stall_threshold()
    tick = min(TICK, stall_after / 5)
    loop_thread = threading.get_ident()
    holder = loop_holder()
    token = trio.lowlevel.current_trio_token()
    stop = threading.Event()
    asked_at: list[float | None] = [None]  # when the pending ping was sent; None: answered
    waited = [0.0]  # how long the last ping waited for the loop

    def answer() -> None:  # runs on the event loop
        asked = asked_at[0]
        if asked is not None:
            waited[0] = time.monotonic() - asked
        asked_at[0] = None

    def watch() -> None:
        held_since: float | None = None
        while not stop.wait(tick):
            now = time.monotonic()
            asked = asked_at[0]
            if asked is None:
                if held_since is not None:
                    _log.warning("the event loop runs again, after %.2f s", now - held_since)
                    held_since = None
                elif waited[0] >= stall_after:
                    # Held, but this thread could not run to see it: the holder held the GIL
                    # (one long C call, on the loop or in a worker thread).
                    _log.error(
                        "the event loop was held for %.2f s by code that held the GIL (a "
                        "long call into C, on the loop or in a worker thread)",
                        waited[0],
                    )
                waited[0] = 0.0
                asked_at[0] = now
                try:
                    token.run_sync_soon(answer)
                except trio.RunFinishedError:
                    return
            elif held_since is None and now - asked >= stall_after:
                held_since = asked
                frame = sys._current_frames().get(loop_thread)
                what = describe_holder(frame, holder.runs)
                _log.error("the event loop has been held for %.2f s by %s", now - asked, what)

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
