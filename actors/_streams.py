"""Streams: how a decoupled model's responses reach its caller.

How this works: a decoupled model's ``execute`` is a generator (each ``yield`` one
response). `Streams.stream` runs it in the caller's task, one step at a time: it is
suspended while the caller holds the previous response, so nothing is buffered. The model's
instances are *compute slots* here: a generator holds one only while it computes its next
response (a synchronous step runs in a worker thread), not while its caller is busy, so
streams that feed each other (a decoupled model nested in another's iterations) cannot
deadlock on instances. Streams take the instances in turn. A backend whose code pushes its
responses (`Capabilities.pushes`: Triton's response senders) runs each request's execution
on an instance itself, so its streams hold no slot while they wait.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator, Callable
from typing import TYPE_CHECKING, Any

import attrs
import trio

from ..protocols import InferenceError, InferRequest, ServerClosedError, Tensors, error_of

if TYPE_CHECKING:
    from ._executor import Executor

_END = object()
"""What ``next`` returns when a decoupled model's generator is exhausted."""


@attrs.define(eq=False)
class Streams:
    """A decoupled model's compute slots (one per instance), held per generator step."""

    executor: Executor
    slots: trio.Semaphore = attrs.field(factory=lambda: trio.Semaphore(1))
    _next_instance: int = 0

    def size(self, instances: int) -> None:
        """One compute slot per instance (once the instances are loaded)."""
        self.slots = trio.Semaphore(instances)

    def _unloading(self) -> ServerClosedError:
        return ServerClosedError(f"model '{self.executor.model.name}' is being unloaded")

    async def stream(self, request: InferRequest) -> AsyncGenerator[Tensors, None]:
        """The outputs of each response the model yields for ``request``, as they come.

        Raises:
            InferenceError: ``execute`` raised (after the responses it yielded before).
            ServerClosedError: the model is being unloaded (also mid-stream).
        """
        executor = self.executor
        if executor.closing:
            raise self._unloading()
        instances = executor.instances
        instance = instances[self._next_instance % len(instances)]
        self._next_instance += 1
        pool, backend = executor.pool, executor.backend
        started = time.perf_counter_ns()
        error: BaseException | None = None
        generator: Any = None
        slots: Any = contextlib.nullcontext() if executor.capabilities.pushes else self.slots
        try:
            async with slots:
                args = backend.arguments(request, None, instance.loaded)
                generator = backend.open_stream(instance.loaded, args)
            try:
                step: Callable[[], Any] = _stepper(generator)
                while True:
                    if executor.closing:
                        raise self._unloading()
                    async with slots:
                        raw = await step()
                    if raw is _END:
                        return
                    # An error response that the stream goes on after passes as it came.
                    yield raw if error_of(raw) is not None else pool.checked(raw)
            finally:
                if hasattr(generator, "aclose"):
                    await generator.aclose()
                else:
                    generator.close()
        except (InferenceError, ServerClosedError) as exc:
            error = exc
            raise
        except Exception as exc:
            error = pool.error(exc)
            raise error from exc
        finally:
            if generator is not None:  # it ran: one execution (a stream gave up before not)
                elapsed = time.perf_counter_ns() - started
                timings = None if error is not None else (0, elapsed, 0)  # an error's span
                executor.record(instance, 0, timings, elapsed, 1, False, [request], started)


def _stepper(generator: Any) -> Callable[[], Any]:
    """An awaitable step of ``generator``: the next response, or `_END`."""
    if hasattr(generator, "__anext__"):
        return lambda: anext(generator, _END)

    async def step() -> Any:
        return await trio.to_thread.run_sync(next, generator, _END)

    return step
