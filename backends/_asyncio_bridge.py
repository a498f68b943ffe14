"""The crossing between an asyncio event loop in another thread and trio.

How this works: code on an asyncio loop calls trio functions without blocking either loop.
Two parts of orchestrion need it: grpcio's asyncio server (the gRPC front end,
`orchestrion.frontends._grpc_service`) and a Triton python-backend model's ``async def
execute``, whose ``async_exec`` BLS calls reach the server's models
(`orchestrion.backends._triton_calls`). `TrioBridge` hands a call to trio with
``TrioToken.run_sync_soon`` (thread-safe, never waits), the call runs as a task in a trio
nursery its owner gives it, and its result comes back with ``loop.call_soon_threadsafe``;
both directions batch their wake-ups (`_Mailbox`). Cancellation crosses too: an awaiting
asyncio task that is cancelled cancels its trio task, and closing the owner's nursery cancels
what is left.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import attrs
import trio

from ..protocols import ServerClosedError

T = TypeVar("T")


@attrs.define(eq=False)
class _Mailbox:
    """Hands items to another thread's event loop, waking it once per batch of items rather
    than once per item (each wake is a syscall and a thread switch)."""

    wake: Callable[[Callable[[], None]], object]
    """Schedules a callback on the other loop, thread-safely."""
    handle: Callable[[Any], None]
    """Runs on the other loop, for each item."""
    _items: collections.deque[Any] = attrs.field(factory=collections.deque)
    _scheduled: bool = False

    def post(self, item: Any) -> None:
        """Queue ``item`` (from any thread); the other loop handles it soon."""
        self._items.append(item)
        if not self._scheduled:
            self._scheduled = True
            try:
                self.wake(self._drain)
            except BaseException:
                self._scheduled = False
                raise

    def _drain(self) -> None:
        # Clear the flag before draining: an item posted after this line schedules a new
        # drain, and one posted before it is drained here (the GIL orders the two).
        self._scheduled = False
        items = self._items
        while items:
            self.handle(items.popleft())


@attrs.define(eq=False)
class _Call:
    """One asyncio-to-trio call in flight."""

    fn: Callable[..., Awaitable[Any]]
    args: tuple[Any, ...]
    future: asyncio.Future[Any]
    replies: _Mailbox
    """The asyncio loop's mailbox, for the outcome."""
    scope: trio.CancelScope | None = None
    abandoned: bool = False

    def deliver(self, result: object = None, error: BaseException | None = None) -> None:
        """Hand the outcome to the asyncio side (from the trio thread)."""
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
            self.replies.post((self.future, result, error))

    def cancel(self) -> None:
        """The asyncio side gave up (runs on the trio thread)."""
        self.abandoned = True
        if self.scope is not None:
            self.scope.cancel()


def _settle(item: tuple[asyncio.Future[Any], object, BaseException | None]) -> None:
    future, result, error = item
    if future.done():  # cancelled meanwhile
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


_CANCEL = object()
"""Marks a cancellation in the bridge's mailbox to trio."""


@attrs.define(eq=False)
class TrioBridge:
    """Runs trio async functions for code on an asyncio loop in another thread.

    Calls and their outcomes cross in batches: when many calls are in flight, one wake of
    the other loop carries all that are ready (`_Mailbox`).
    """

    token: trio.lowlevel.TrioToken
    nursery: trio.Nursery
    _to_trio: _Mailbox = attrs.field(init=False)
    _to_asyncio: dict[asyncio.AbstractEventLoop, _Mailbox] = attrs.field(factory=dict, init=False)

    def __attrs_post_init__(self) -> None:
        self._to_trio = _Mailbox(self.token.run_sync_soon, self._receive)

    async def call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``await fn(*args)`` in trio and return its result (called on asyncio).

        Cancelling the awaiting asyncio task cancels the trio task.
        """
        loop = asyncio.get_running_loop()
        replies = self._to_asyncio.get(loop)
        if replies is None:
            replies = self._to_asyncio[loop] = _Mailbox(loop.call_soon_threadsafe, _settle)
        call = _Call(fn, args, loop.create_future(), replies)
        try:
            self._to_trio.post(call)
        except trio.RunFinishedError:
            raise ServerClosedError("the server is shutting down") from None
        try:
            result: T = await call.future
        except asyncio.CancelledError:
            with contextlib.suppress(trio.RunFinishedError):
                self._to_trio.post((_CANCEL, call))
            raise
        return result

    def run_soon(self, fn: Callable[[], object]) -> None:
        """Run ``fn()`` on the trio thread soon (called on asyncio; never waits). Nothing
        happens once trio has finished."""
        with contextlib.suppress(trio.RunFinishedError):
            self._to_trio.post(fn)

    def _receive(self, item: Any) -> None:
        if isinstance(item, tuple):
            item[1].cancel()
            return
        if not isinstance(item, _Call):
            item()
            return
        try:
            self.nursery.start_soon(self._run, item)
        except RuntimeError:  # the nursery is closed: the server is stopping
            item.deliver(error=ServerClosedError("the server is shutting down"))

    async def _run(self, call: _Call) -> None:
        delivered = False
        try:
            with trio.CancelScope() as call.scope:
                if call.abandoned:
                    call.scope.cancel()
                result = await call.fn(*call.args)
                call.deliver(result)
                delivered = True
        except Exception as exc:
            call.deliver(error=exc)
            delivered = True
        finally:
            if not delivered:
                call.deliver(error=ServerClosedError("the server is shutting down"))


async def call_sync(fn: Callable[..., T], *args: Any) -> T:
    return fn(*args)
