"""The calls a Triton python-backend model's code makes back into the server: BLS
(``InferenceRequest(...).exec()`` / ``async_exec()``, ``_triton_requests.py``), and which
of them a model's code names (`waits_on_server`, `bls_only`: where its executions may run).

How this works: each call of a model's ``execute`` runs under one `Execution` (a context
variable, so it follows the code into the worker thread that runs ``execute`` and into the
asyncio task of an ``async def execute``). The execution owns a trio nursery for the duration
of the call. A BLS call crosses from the model's thread to trio: from a worker thread with
``trio.from_thread.run``, which runs it in the task of the request being executed, so the
caller's deadline and cancellation reach the called model; from an execution inline on the
event loop (a short model whose only waits are synchronous BLS calls) with
``greenback.await_``, in the same task, through the portal that task holds; from the
asyncio loop of an async model through a `TrioBridge` whose tasks live in the execution's
nursery. A decoupled BLS
call's responses are pumped by a task of that nursery into a channel the model's iterator
reads one at a time (no buffering); when ``execute`` returns, whatever the model left
unfinished is cancelled.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import os
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import attrs
import greenback
import trio

from ..protocols import (
    ERROR_CODES,
    Cancellation,
    InferenceTimeoutError,
    InferRequest,
    InferResponse,
    InvalidRequestError,
    ModelNotFoundError,
    ModelReportedError,
    OrchestrionError,
    ServerClosedError,
    TritonClass,
)
from ._asyncio_bridge import TrioBridge
from ._base import ServerCalls
from ._function import on_host
from ._triton_api import (
    InferenceResponse,
    Tensor,
    TritonError,
    TritonModelException,
)

if TYPE_CHECKING:
    from ..protocols import Model

T = TypeVar("T")


class Callee(Protocol):
    """What a BLS call needs of its request (``_triton_requests.InferenceRequest``)."""

    def as_request(self, parent: InferRequest | None) -> InferRequest:
        """The request as the server takes it (``parent``: the request being executed)."""

    def timeout(self) -> int:
        """Its timeout in microseconds (0: none)."""


def _on_the_event_loop() -> bool:
    try:
        trio.lowlevel.current_trio_token()
    except RuntimeError:
        return False
    return True


def in_trio_worker_thread() -> bool:
    """Whether this thread was started by ``trio.to_thread.run_sync`` (so ``from_thread``
    calls run in the task that started it)."""
    try:
        trio.from_thread.check_cancelled()
    except trio.Cancelled:
        return True
    except RuntimeError:
        return False
    return True


def cancelled_here() -> bool:
    """Whether the request executed in this worker thread was cancelled (False in a thread
    trio did not start: an async execute's loop, a thread of the model's own)."""
    try:
        trio.from_thread.check_cancelled()
    except trio.Cancelled:
        return True
    except RuntimeError:
        return False
    return False


def error_response(error: BaseException) -> InferenceResponse:
    """A BLS call's failure as the response Triton gives (``response.error()``): a
    model's own error keeps its code."""
    if isinstance(error, ModelReportedError):
        return InferenceResponse(error=TritonError(str(error), ERROR_CODES.index(error.code)))
    if isinstance(error, ModelNotFoundError):
        code = TritonError.NOT_FOUND
    elif isinstance(error, InvalidRequestError):
        code = TritonError.INVALID_ARG
    elif isinstance(error, ServerClosedError | InferenceTimeoutError):
        code = TritonError.UNAVAILABLE
    elif isinstance(error, trio.Cancelled):
        return InferenceResponse(
            error=TritonError("the request was cancelled", TritonError.CANCELLED)
        )
    else:
        code = TritonError.INTERNAL
    text = str(error) if isinstance(error, OrchestrionError) else f"{type(error).__name__}: {error}"
    return InferenceResponse(error=TritonError(text, code))


def model_response(response: InferResponse) -> InferenceResponse:
    """A server response as the model's code sees it."""
    tensors = [Tensor(name, on_host(array)) for name, array in response.outputs.items()]
    return InferenceResponse.of(tensors, response.parameters)


@attrs.define(eq=False)
class Execution:
    """One call of a model's ``execute``: what its BLS calls and senders need."""

    model_name: str
    calls: ServerCalls | None
    token: trio.lowlevel.TrioToken | None
    nursery: trio.Nursery
    """Where BLS tasks and decoupled pumps run: the call's own nursery (an async
    execute), or the backend's (a synchronous one: `finish` cancels its pumps)."""
    parent: InferRequest | None = None
    """The request being executed (its trace context goes with BLS calls)."""
    _bridge: TrioBridge | None = None
    _pumps: set[trio.CancelScope] = attrs.field(factory=set)
    """The decoupled BLS calls still running (each leaves when it ends)."""
    waited_ns: int = 0
    """How long its calls waited on the server (BLS): not the execution's own time (from
    the event loop, through a greenback portal, the loop runs other work meanwhile)."""

    def context(self) -> contextvars.Context:
        """A copy of the current context with this execution current: the model's code
        runs in it (in its worker thread, or as its asyncio task)."""
        context = contextvars.copy_context()
        context.run(_EXECUTION.set, self)
        return context

    def to_trio(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``await fn(*args)`` in trio and wait for it, from any thread but trio's own.

        Raises:
            TritonModelException: called on the event loop, or the server has stopped.
        """
        started = time.perf_counter_ns()
        try:
            if in_trio_worker_thread():
                return trio.from_thread.run(fn, *args)
            if _on_the_event_loop() and greenback.has_portal():
                return greenback.await_(fn(*args))
            self._not_on_the_event_loop()
            try:
                return trio.from_thread.run(fn, *args, trio_token=self.token)
            except trio.RunFinishedError:
                raise TritonModelException("the server has stopped") from None
        finally:
            self.waited_ns += time.perf_counter_ns() - started

    def to_trio_sync(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` on the trio thread and wait for it (see `to_trio`)."""
        if in_trio_worker_thread():
            return trio.from_thread.run_sync(fn, *args)
        if _on_the_event_loop() and greenback.has_portal():
            return fn(*args)
        self._not_on_the_event_loop()
        try:
            return trio.from_thread.run_sync(fn, *args, trio_token=self.token)
        except trio.RunFinishedError:
            raise TritonModelException("the server has stopped") from None

    def _not_on_the_event_loop(self) -> None:
        if _on_the_event_loop():
            raise TritonModelException(
                f"model '{self.model_name}': a call into the server (BLS) cannot wait on the "
                "server's event loop; run the model in a worker thread (drop its 'execution' "
                "parameter, or set it to 'thread')"
            )
        if self.token is None:
            raise TritonModelException(f"model '{self.model_name}' runs without a server")

    def finish(self) -> None:
        """The call returned: cancel the decoupled BLS calls it left unfinished."""
        if not self._pumps:
            return
        pumps, self._pumps = self._pumps, set()

        def cancel() -> None:
            for scope in pumps:
                scope.cancel()

        if _on_the_event_loop():
            cancel()
        else:
            with contextlib.suppress(trio.RunFinishedError):
                self.to_trio_sync(cancel)

    @property
    def bridge(self) -> TrioBridge:
        """The crossing for ``async_exec`` from the model's asyncio loop."""
        if self._bridge is None:
            assert self.token is not None, "an async execute runs in a server"
            self._bridge = TrioBridge(self.token, self.nursery)
        return self._bridge

    def _server(self, call: str) -> ServerCalls:
        return server_calls(self.calls, self.model_name, call)

    async def infer(self, request: Callee) -> InferenceResponse:
        """One BLS call; its failure is the response's error, as Triton gives it."""
        calls = self._server("InferenceRequest.exec")
        try:
            wire = request.as_request(self.parent)
            timeout = request.timeout()
            with trio.fail_after(timeout / 1e6) if timeout else contextlib.nullcontext():
                return model_response(await calls.infer(wire))
        except trio.TooSlowError:
            return InferenceResponse(
                error=TritonError("Request timeout expired", TritonError.UNAVAILABLE)
            )
        except Exception as exc:
            return error_response(exc)

    async def open_stream(self, request: Callee) -> ResponseIterator:
        """A decoupled BLS call: its responses come through the returned iterator."""
        calls = self._server("InferenceRequest.exec(decoupled=True)")
        cancellation = Cancellation()
        wire = attrs.evolve(request.as_request(self.parent), cancellation=cancellation)
        send, receive = trio.open_memory_channel[InferenceResponse](0)
        scope = trio.CancelScope()
        self._pumps.add(scope)
        self.nursery.start_soon(_pump, calls, wire, send, scope, self._pumps)
        return ResponseIterator(self, receive, cancellation)

    async def open_stream_answered(self, request: Callee) -> ResponseIterator:
        """`open_stream`, given once the first response has come (or the call has ended),
        as Triton's ``async_exec(decoupled=True)``: an async caller that then iterates does
        not hold its asyncio loop waiting for that first one."""
        iterator = await self.open_stream(request)
        await iterator.take_first()
        return iterator


async def _pump(
    calls: ServerCalls,
    request: InferRequest,
    send: trio.MemorySendChannel[InferenceResponse],
    scope: trio.CancelScope,
    pumps: set[trio.CancelScope],
) -> None:
    """Feed a decoupled BLS call's responses to its iterator, one at a time."""
    try:
        await _pump_all(calls, request, send, scope)
    finally:
        pumps.discard(scope)


async def _pump_all(
    calls: ServerCalls,
    request: InferRequest,
    send: trio.MemorySendChannel[InferenceResponse],
    scope: trio.CancelScope,
) -> None:
    with scope, contextlib.suppress(trio.BrokenResourceError):
        async with send:
            try:
                final = False
                async with contextlib.aclosing(calls.stream_infer(request)) as responses:
                    async for response in responses:
                        final = response.final
                        await send.send(  # (an error value: only a gRPC stream's own)
                            model_response(response)
                            if response.error is None
                            else error_response(response.error)
                        )
                if not final:  # the final flag came alone: Triton's empty last response
                    await send.send(InferenceResponse())
            except Exception as exc:
                await send.send(error_response(exc))


class ResponseIterator:
    """The responses of a decoupled BLS call, one per ``next()`` (which waits for it)."""

    def __init__(
        self,
        execution: Execution,
        receive: trio.MemoryReceiveChannel[InferenceResponse],
        cancellation: Cancellation,
    ) -> None:
        self._execution = execution
        self._receive = receive
        self._cancellation = cancellation
        self._ended = False
        self._first: InferenceResponse | None = None

    async def take_first(self) -> None:
        """Wait (on trio) for the first response, which `__next__` then gives at once."""
        try:
            self._first = await self._receive.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            self._ended = True

    def __iter__(self) -> ResponseIterator:
        return self

    def __next__(self) -> InferenceResponse:
        if self._first is not None:
            first, self._first = self._first, None
            return first
        if self._ended:
            raise StopIteration
        try:
            return self._execution.to_trio(self._receive.receive)
        except (trio.EndOfChannel, trio.ClosedResourceError):
            self._ended = True
            raise StopIteration from None
        except trio.Cancelled as exc:  # the request being executed was cancelled
            self._ended = True
            return error_response(exc)

    def cancel(self) -> None:
        """Ask for the call's cancellation, as Triton's: the called model sees it
        (``request.is_cancelled()``) and ends its stream when it chooses, usually with a
        CANCELLED error response; the responses it sends meanwhile still come here."""
        self._cancellation.cancel()


_EXECUTION: contextvars.ContextVar[Execution] = contextvars.ContextVar("orchestrion_execution")


_SERVING: list[tuple[tuple[str, str], Execution]] = []
"""The code places of the models serving now (see `code_places`), each with the execution
that BLS calls from threads the model started itself run under."""
_SERVING_LOCK = threading.Lock()


@contextlib.contextmanager
def serving(places: Sequence[tuple[str, str]], execution: Execution) -> Iterator[None]:
    """While a model serves (from the end of its ``initialize`` to the start of its
    ``finalize``, as Triton's stub allows): a BLS call from a thread the model started
    itself, which carries no execution, runs under ``execution`` (no parent request), found
    from the code that made the call (the innermost of the caller's frames in ``places``)."""
    entries = [(place, execution) for place in places]
    with _SERVING_LOCK:
        _SERVING.extend(entries)
    try:
        yield
    finally:
        with _SERVING_LOCK:
            for entry in entries:
                _SERVING.remove(entry)


def code_places(source: str, cls: type) -> list[tuple[str, str]]:
    """Where a model's code lies, as (a folder or file, a prefix of the qualified names of
    its functions): its version folder and its model folder (a ``model.py`` at ``source``:
    any function), or its class's file and the class's own functions (a class defined
    beside other models' classes)."""
    if source.endswith(".py"):
        return [(str(Path(source).parent), ""), (str(Path(source).parents[1]), "")]
    with contextlib.suppress(TypeError):
        file = inspect.getsourcefile(cls)
        if file is not None:
            return [(file, cls.__qualname__ + ".")]
    return []


def _serving_caller() -> Execution | None:
    """The execution of the serving model whose code called (None: no model's code among
    the callers, or two models' code places match it alike)."""
    with _SERVING_LOCK:
        serving = list(_SERVING)
    frame = sys._getframe(1) if serving else None
    while frame is not None:
        code = frame.f_code
        file, name = code.co_filename, code.co_qualname
        found = [
            (len(place), execution)
            for (place, prefix), execution in serving
            if (file == place or file.startswith(place + os.sep)) and name.startswith(prefix)
        ]
        if found:
            longest = max(length for length, _ in found)
            executions = {id(e): e for length, e in found if length == longest}
            return next(iter(executions.values())) if len(executions) == 1 else None
        frame = frame.f_back
    return None


def server_calls(calls: ServerCalls | None, model_name: str, call: str) -> ServerCalls:
    """``calls``, for the model's ``call`` into the server.

    Raises:
        TritonModelException: the model runs without a server (made in Python, alone).
    """
    if calls is None:
        raise TritonModelException(f"{call}: model '{model_name}' runs without a server to call")
    return calls


def current_execution(call: str) -> Execution:
    """The execution whose code is running here.

    Raises:
        TritonModelException: outside a model's ``execute`` (``call`` named).
    """
    try:
        return _EXECUTION.get()
    except LookupError:
        pass
    execution = _serving_caller()
    if execution is None:
        # Triton's words first (its QA looks for them in the log of a model whose
        # initialize or finalize makes a BLS call), then where the call may be made.
        raise TritonModelException(
            f"BLS is only supported during the 'execute' function. ({call} was called "
            "outside a model's execute and outside a thread of a serving model: from "
            "initialize, finalize or code of no loaded model)"
        )
    return execution


_SERVER_CALLS = ("InferenceRequest", "get_response_sender", "is_model_ready", "async_exec")
"""Names in a model's code that can wait on the server (BLS calls, senders)."""


_OFF_THE_LOOP = (
    "get_response_sender",
    "async_exec",
    "threading",
    "Thread",
    "concurrent.futures",
    "multiprocessing",
)
"""Names in a model's code that rule out waiting through a portal: a response sender (its
answers may come from elsewhere while ``execute`` waits), threads or pools of the model's
own (a BLS call from one would wait on the event loop that its ``execute`` is blocking)."""


def bls_only(model: Model) -> bool:
    """Whether the model's code waits on the server only through synchronous BLS calls
    (``InferenceRequest(...).exec()``, ``is_model_ready``), none of them from a thread of
    its own: it can wait through a greenback portal from the event loop."""
    texts = _code_texts(model)
    return texts is not None and not any(n in t for t in texts for n in _OFF_THE_LOOP)


def _code_texts(model: Model) -> list[str] | None:
    """The model's code files (its folder's, helpers included), or its class's source;
    None when they cannot be read."""
    source = model.source
    try:
        if source.endswith(".py"):
            folder = Path(source).parent
            return [p.read_text(errors="replace") for p in sorted(folder.rglob("*.py"))]
        code = model.code
        return [inspect.getsource(code.model_class)] if isinstance(code, TritonClass) else None
    except (OSError, TypeError):
        return None


def waits_on_server(model: Model) -> bool:
    """Whether the model's code may wait on the server: its code files (the model's folder,
    helpers beside ``model.py`` included) name a BLS call or a response sender. Such code
    must never run on the event loop; other code is measured like any plain-Python model's
    (inline when its executions prove short). Code that cannot be read counts as waiting."""
    texts = _code_texts(model)
    if texts is None:
        return True
    return any(name in text for text in texts for name in _SERVER_CALLS)
