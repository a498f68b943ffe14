"""A python-backend model's own readiness check: its ``is_ready()``, as Triton's python
backend calls it when a client asks whether the model is ready.

How this works: each instance whose object has ``is_ready`` is asked in a worker thread (an
``async def is_ready`` runs on the model's asyncio loop, or on a loop of its own when the
model has none); the asker waits at most `READINESS_TIMEOUT` for every instance's answer.
One call per instance is in flight at a time: an asker that comes while one runs waits for
that call's answer instead of making another, and a call that outlasts its asker's wait
runs on to the end in the backend's nursery, its answer given to whoever waits then. Not
ready: ``False``, an exception, an answer that is not a bool, or no answer in time; the
model serves requests all the same (readiness is what a load balancer reads).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import trio

_log = logging.getLogger("orchestrion")

READINESS_TIMEOUT = 5.0
"""Seconds a readiness check waits for the instances' ``is_ready()``, as Triton's."""


@attrs.define(eq=False)
class ReadinessCall:
    """One call of an instance's ``is_ready()``: done, and its answer."""

    done: trio.Event = attrs.field(factory=trio.Event)
    ready: bool = False


@attrs.define(eq=False)
class Readiness:
    """The readiness checks of one model's instances."""

    model_name: str
    loop: Callable[[], asyncio.AbstractEventLoop | None]
    """The model's asyncio loop (an ``async def execute``'s), or None."""
    _calls: dict[int, ReadinessCall] = attrs.field(factory=dict)
    """The call in flight of each instance (by the id of its object)."""

    async def check(self, nursery: trio.Nursery, instances: Sequence[tuple[Any, str]]) -> bool:
        """Whether every instance (its object and name) that has ``is_ready`` answers True
        within `READINESS_TIMEOUT` (True at once where none has it)."""
        calls = [self._call(nursery, obj, name) for obj, name in instances if _asks(obj)]
        if not calls:
            return True
        with trio.move_on_after(READINESS_TIMEOUT):
            for call in calls:
                await call.done.wait()
            return all(call.ready for call in calls)
        _log.warning(
            "model '%s': is_ready() gave no answer within %g s: not ready",
            self.model_name,
            READINESS_TIMEOUT,
        )
        return False

    def _call(self, nursery: trio.Nursery, obj: Any, name: str) -> ReadinessCall:
        call = self._calls.get(id(obj))
        if call is None:
            call = self._calls[id(obj)] = ReadinessCall()
            nursery.start_soon(self._run, obj, name, call)
        return call

    async def _run(self, obj: Any, name: str, call: ReadinessCall) -> None:
        try:
            call.ready = await trio.to_thread.run_sync(self._ask, obj, name)
        finally:
            del self._calls[id(obj)]
            call.done.set()

    def _ask(self, obj: Any, name: str) -> bool:
        """``obj.is_ready()``, here (a worker thread): its answer, False on any failure."""
        try:
            answer = obj.is_ready()
            if inspect.iscoroutine(answer):
                loop = self.loop()
                if loop is None:
                    answer = asyncio.run(answer)
                else:
                    answer = asyncio.run_coroutine_threadsafe(answer, loop).result()
        except Exception as exc:
            _log.warning(
                "model '%s': instance '%s': is_ready() raised: not ready: %s: %s",
                self.model_name,
                name,
                type(exc).__name__,
                exc,
            )
            return False
        if not isinstance(answer, bool):
            _log.warning(
                "model '%s': instance '%s': is_ready() must return a boolean value, got %s: "
                "not ready",
                self.model_name,
                name,
                type(answer).__name__,
            )
            return False
        return answer


def _asks(obj: Any) -> bool:
    return callable(getattr(obj, "is_ready", None))
