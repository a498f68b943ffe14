"""The order of one client stream's responses, as the model's code sent them.

How this works: on one gRPC stream, a decoupled python-backend model may answer several
requests from several threads. Triton's stub sends every response through one queue, so the
client reads them in the order ``send`` was called; here each request's responses travel
through their own task, and trio wakes ready tasks in either order. So the front end's stream
owns a `ResponseOrder`, and each of its decoupled requests an `OrderedRequest`, which it puts
in `RESPONSE_ORDER` while it reads the request's responses. The request's `PushedStream`
claims it, takes a ticket in the sender's thread at each ``send``, and the stream writes each
response once every earlier ticket is written or given up (its request ended without it).

Waits cannot close a cycle: the smallest outstanding ticket's request never waits on the
order, so it writes (or ends) and the next one goes. Only requests of one client stream wait
for one another, as they do in Triton; other clients never do.
"""

from __future__ import annotations

import collections
import contextvars
import threading

import trio

RESPONSE_ORDER: contextvars.ContextVar[OrderedRequest | None] = contextvars.ContextVar(
    "RESPONSE_ORDER", default=None
)
"""The request whose responses the running task writes in order (None: no order asked)."""


class ResponseOrder:
    """One client stream's tickets: the next to write, and those given up out of turn."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # tickets are taken in the models' threads
        self._taken = 0
        self._next = 0
        self._done: set[int] = set()
        self._changed = trio.Event()

    def request(self, model_name: str) -> OrderedRequest:
        """A new request of the stream, for model ``model_name``."""
        return OrderedRequest(self, model_name)

    async def turn(self, ticket: int) -> None:
        """Wait until every ticket before ``ticket`` is written or given up."""
        while True:
            with self._lock:
                if self._next >= ticket:
                    return
                changed = self._changed
            await changed.wait()

    def finish(self, *tickets: int) -> None:
        """``tickets`` are written or given up: later ones may go (trio's thread)."""
        if not tickets:
            return
        with self._lock:
            self._done.update(tickets)
            moved = False
            while self._next in self._done:
                self._done.remove(self._next)
                self._next += 1
                moved = True
        if moved:
            self._changed.set()
            self._changed = trio.Event()

    def _take(self) -> int:
        # Under the lock (the caller's).
        ticket = self._taken
        self._taken += 1
        return ticket


class OrderedRequest:
    """One request's place in its stream's order: the tickets of the responses its model
    sent that are not yet written, oldest first."""

    def __init__(self, order: ResponseOrder, model_name: str) -> None:
        self._order = order
        self._model_name = model_name
        self._claimed = False
        self._closed = False
        self._pending: collections.deque[int] = collections.deque()

    def claim(self, model_name: str) -> bool:
        """Whether the execution of ``model_name`` that asks is the one whose responses
        this request reads: the first of that model to ask (not a model it calls, nor an
        ensemble's step)."""
        if self._claimed or model_name != self._model_name:
            return False
        self._claimed = True
        return True

    def sent(self) -> None:
        """The model sent a response (from any thread): it takes the next ticket."""
        with self._order._lock:
            if not self._closed:
                self._pending.append(self._order._take())

    def next_ticket(self) -> int | None:
        """The ticket of the response about to be written (None: no response waits)."""
        with self._order._lock:
            return self._pending.popleft() if self._pending else None

    def close(self) -> None:
        """The request ended: its unwritten responses give up their turn (trio's thread)."""
        with self._order._lock:
            self._closed = True
            given_up = tuple(self._pending)
            self._pending.clear()
        self._order.finish(*given_up)
