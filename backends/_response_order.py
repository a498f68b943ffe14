"""The order of one client stream's responses of a model, as the model's code sent them.

How this works: on one gRPC stream, a decoupled python-backend model may answer several
requests from several threads. Triton's stub sends every response of a model instance
through one queue, so the client reads them in the order ``send`` was called; here each
request's responses travel through their own task, and trio wakes ready tasks in either
order. So the front end's stream keeps a `ResponseOrder` per model, and each of its decoupled
requests an `OrderedRequest`, which it puts in `RESPONSE_ORDER` while it reads the request's
responses. The request's `PushedStream` claims it and takes a ticket in the sender's thread at
each ``send`` (the final flag alone included), and the stream writes each response once every
earlier ticket of the model is written or given up. A ticket is given up when its response is
dropped (its request's reader left: a timeout, a cancellation, an error) or its request ends
without writing it.

Waits cannot close a cycle: the smallest outstanding ticket's request never waits on the
order, so it writes or gives it up, and the next one goes. A response waits only for those
the same model sent before on the same stream: other models, streams and clients never wait.
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
    """One model's tickets on one client stream: the next to write, those given up out of
    turn, and the writers waiting for theirs."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        """Guards the tickets taken and each request's pending ones (taken in the models'
        threads); the rest is trio's thread's alone."""
        self._taken = 0
        self._next = 0
        self._done: set[int] = set()
        self._waiting: dict[int, trio.Event] = {}

    def request(self, model_name: str) -> OrderedRequest:
        """A new request of the stream, for model ``model_name``."""
        return OrderedRequest(self, model_name)

    def take(self) -> int:
        """The next ticket (with `lock` held)."""
        ticket = self._taken
        self._taken += 1
        return ticket

    def writers_waiting(self) -> int:
        """Responses held back until the model's earlier ones are out."""
        return len(self._waiting)

    async def turn(self, ticket: int) -> None:
        """Wait until every ticket before ``ticket`` is written or given up."""
        if self._next < ticket:
            event = self._waiting.setdefault(ticket, trio.Event())
            try:
                await event.wait()
            finally:
                if not event.is_set():  # cancelled: no longer waiting
                    del self._waiting[ticket]

    def finish(self, *tickets: int) -> None:
        """``tickets`` are written or given up: the next ones may go."""
        self._done.update(t for t in tickets if t >= self._next)
        while self._next in self._done:
            self._done.remove(self._next)
            self._next += 1
            waiter = self._waiting.pop(self._next, None)
            if waiter is not None:
                waiter.set()


class OrderedRequest:
    """One request's place in its model's order on the stream: the tickets of the responses
    the model sent for it that are not yet written, oldest first (one sender's responses
    take their tickets and reach the reader one at a time, in that order)."""

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
        if self._claimed or self._closed or model_name != self._model_name:
            return False
        self._claimed = True
        return True

    def sent(self) -> int | None:
        """The model sends a response or its final flag (from any thread): its ticket (None
        once the request has ended)."""
        with self._order.lock:
            if self._closed:
                return None
            ticket = self._order.take()
            self._pending.append(ticket)
            return ticket

    def dropped(self, ticket: int) -> None:
        """The response of ``ticket`` never reached the reader: it gives up its turn."""
        with self._order.lock:
            if ticket not in self._pending:
                return  # written, or given up with the rest at close
            self._pending.remove(ticket)
        self._order.finish(ticket)

    def next_ticket(self) -> int | None:
        """The ticket of the response about to be written (None: none was taken)."""
        with self._order.lock:
            return self._pending.popleft() if self._pending else None

    async def turn(self, ticket: int) -> None:
        """Wait until the model's responses sent before ``ticket``'s are out."""
        await self._order.turn(ticket)

    def written(self, ticket: int) -> None:
        """``ticket``'s response is written (or will never be): the next may go."""
        self._order.finish(ticket)

    def close(self) -> None:
        """The request ended: its unwritten responses give up their turn."""
        with self._order.lock:
            self._closed = True
            given_up = tuple(self._pending)
            self._pending.clear()
        self._order.finish(*given_up)
