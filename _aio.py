"""The embedding API for asyncio applications: ``async with orchestrion.aio.open_server(...)``.

How this works: the server runs on trio, in a thread that the ``async with`` block owns
(started on entry, joined on exit). Each call crosses from the application's asyncio loop to
trio through a `TrioBridge` (the crossing the gRPC front end uses): the call is handed to trio
without blocking either loop, runs as a task in a nursery of the server's, and its result
comes back as an asyncio future; cancelling the awaiting asyncio task cancels the trio task.
No call takes a thread of its own (``asyncio.to_thread(server.infer, ...)`` with the blocking
`Server` takes one per request). A stream's responses are pumped by one trio task into a
channel that the asyncio side reads one response at a time, so a reader that stops reading
stops the model, as in trio.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping, Sequence
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, TypeVar, Unpack

import trio

from ._options import ServerOptionFields, ServerOptions, chosen
from ._server import AsyncServer, forwarding, refuse_other_loops
from ._server import open_server as open_trio_server
from .actors import Model
from .backends import TrioBridge, call_sync
from .protocols import (
    InferResponse,
    RequestOptions,
    ServerClosedError,
    check_field_names,
)

T = TypeVar("T")


P = ParamSpec("P")
R = TypeVar("R")


def _awaited(
    method: Callable[Concatenate[AsyncServer, P], Awaitable[R]],
) -> Callable[Concatenate[AioServer, P], Coroutine[Any, Any, R]]:
    """`AsyncServer`'s ``method`` as `AioServer`'s: run as a trio task, awaited here."""

    async def call(self: AioServer, /, *args: P.args, **kwargs: P.kwargs) -> R:
        result: R = await self._call(functools.partial(method, self._server, *args, **kwargs))
        return result

    return forwarding(call, method, "AioServer")


def _on_loop(
    method: Callable[Concatenate[AsyncServer, P], R],
) -> Callable[Concatenate[AioServer, P], Coroutine[Any, Any, R]]:
    """`AsyncServer`'s synchronous ``method`` as `AioServer`'s: called on the trio thread (its
    state lives there), awaited here."""

    async def call(self: AioServer, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return await self._sync(functools.partial(method, self._server, *args, **kwargs))

    return forwarding(call, method, "AioServer")


class AioServer:
    """A running orchestrion server inside an asyncio program. Get one from
    `orchestrion.aio.open_server`; its methods are those of `AsyncServer`, awaited."""

    def __init__(self, server: AsyncServer, bridge: TrioBridge) -> None:
        self._server = server
        self._bridge = bridge
        self._open = True

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        if not self._open:
            raise ServerClosedError("the server is not open (use it inside its async with block)")
        return await self._bridge.call(fn, *args)

    async def _sync(self, fn: Callable[..., T], *args: Any) -> T:
        result: T = await self._call(call_sync, fn, *args)
        return result

    async def infer(
        self,
        model_name: str,
        inputs: Mapping[str, Any],
        *,
        options: RequestOptions | None = None,
        **fields: Any,
    ) -> InferResponse:
        """Run one request; see `AsyncServer.infer` for the arguments (`RequestOptions`
        fields by name) and errors. Cancelling the awaiting task cancels the request."""
        check_field_names(fields, "AioServer.infer")
        call = functools.partial(self._server.infer, model_name, inputs, options=options, **fields)
        response: InferResponse = await self._call(call)
        return response

    async def stream_infer(
        self,
        model_name: str,
        inputs: Mapping[str, Any],
        *,
        options: RequestOptions | None = None,
        **fields: Any,
    ) -> AsyncIterator[InferResponse]:
        """The responses of a decoupled model, as they come; see `AsyncServer.stream_infer`.
        ``async with contextlib.aclosing(server.stream_infer(...)) as responses``: leaving
        early stops the model."""
        check_field_names(fields, "AioServer.stream_infer")
        send, receive = trio.open_memory_channel[InferResponse](0)
        responses = self._server.stream_infer(model_name, inputs, options=options, **fields)
        scope = trio.CancelScope()

        async def pump() -> None:
            with scope:
                async with send, contextlib.aclosing(responses) as each:
                    async for response in each:
                        await send.send(response)

        pumping = asyncio.ensure_future(self._call(pump))
        try:
            while True:
                try:
                    response: InferResponse = await self._call(receive.receive)
                except trio.EndOfChannel:
                    break
                yield response
            await pumping  # the stream's error, if it ended by one
        finally:
            if not pumping.done():
                with contextlib.suppress(ServerClosedError):
                    await self._sync(scope.cancel)
                with contextlib.suppress(asyncio.CancelledError, ServerClosedError):
                    await pumping
            with contextlib.suppress(ServerClosedError):
                await self._sync(receive.close)

    @property
    def metrics_url(self) -> str | None:
        """See `AsyncServer.metrics_url`."""
        return self._server.metrics_url

    @property
    def model_repository(self) -> Path | None:
        """See `AsyncServer.model_repository`."""
        return self._server.model_repository

    # The rest are AsyncServer's methods, declared there once: each runs on the server's
    # trio thread, awaited or called there, and is awaited here.
    model_statistics = _on_loop(AsyncServer.model_statistics)
    metrics_text = _on_loop(AsyncServer.metrics_text)
    cache_statistics = _on_loop(AsyncServer.cache_statistics)
    step_statistics = _on_loop(AsyncServer.step_statistics)
    model_config = _on_loop(AsyncServer.model_config)
    model_names = _on_loop(AsyncServer.model_names)
    model_versions = _on_loop(AsyncServer.model_versions)
    output_labels = _on_loop(AsyncServer.output_labels)
    is_decoupled = _on_loop(AsyncServer.is_decoupled)
    is_model_ready = _on_loop(AsyncServer.is_model_ready)
    use_model_control = _on_loop(AsyncServer.use_model_control)
    model_ready = _awaited(AsyncServer.model_ready)
    load_model = _awaited(AsyncServer.load_model)
    unload_model = _awaited(AsyncServer.unload_model)


@contextlib.asynccontextmanager
async def open_server(
    model_repository: str | os.PathLike[str] | None = None,
    models: Sequence[Model] = (),
    *,
    options: ServerOptions | None = None,
    **fields: Unpack[ServerOptionFields],
) -> AsyncIterator[AioServer]:
    """Open an orchestrion server from asyncio code; models are ready on entry.

    Takes the arguments of `orchestrion.open_server`. The server's trio loop runs in a thread
    this block owns; leaving the block lets running requests finish, then stops it.

    Raises:
        the errors of `orchestrion.open_server` (a bad repository or config, a model that
        fails to load, an unreachable cache), and RuntimeError outside an asyncio loop.
    """
    refuse_other_loops(
        "asyncio",
        "orchestrion.aio.open_server runs in asyncio code, but was called from {library}; "
        "in trio use orchestrion.open_server, in plain code orchestrion.Server",
    )
    opener = functools.partial(
        open_trio_server, model_repository, models, options=chosen(options, fields)
    )
    loop = asyncio.get_running_loop()
    started: asyncio.Future[tuple[AsyncServer, TrioBridge, trio.lowlevel.TrioToken, trio.Event]]
    started = loop.create_future()
    ended: asyncio.Future[None] = loop.create_future()
    thread = threading.Thread(
        target=_run_trio, args=(opener, loop, started, ended), name="orchestrion server (trio)"
    )
    thread.start()
    try:
        server, bridge, token, stop = await asyncio.shield(started)
    except BaseException:
        await asyncio.wait([ended])  # the thread has returned (its error is the start's)
        ended.exception()  # retrieved: raised once, as the start's error
        thread.join()
        raise
    aio_server = AioServer(server, bridge)
    try:
        yield aio_server
    finally:
        aio_server._open = False
        with contextlib.suppress(trio.RunFinishedError):
            token.run_sync_soon(stop.set)
        await asyncio.shield(ended)  # the trio thread has returned once this is done
        thread.join()
        exc = ended.exception()
        if exc is not None:
            raise exc


def _settle(
    future: asyncio.Future[Any], result: Any = None, error: BaseException | None = None
) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _run_trio(
    opener: Callable[[], Any],
    loop: asyncio.AbstractEventLoop,
    started: asyncio.Future[Any],
    ended: asyncio.Future[None],
) -> None:
    """The server's thread: run trio until the asyncio side asks it to stop."""

    async def serve() -> None:
        async with opener() as server, trio.open_nursery() as nursery:
            stop = trio.Event()
            bridge = TrioBridge(trio.lowlevel.current_trio_token(), nursery)
            token = trio.lowlevel.current_trio_token()
            loop.call_soon_threadsafe(_settle, started, (server, bridge, token, stop))
            await stop.wait()
            nursery.cancel_scope.cancel()  # calls still crossing when the block was left

    error: BaseException | None = None
    try:
        trio.run(serve)
    except BaseException as exc:  # handed to the asyncio side, which raises it
        error = exc
    with contextlib.suppress(RuntimeError):  # the asyncio loop has closed: nobody waits
        if not started.done():
            loop.call_soon_threadsafe(
                _settle, started, None, error or ServerClosedError("the server stopped")
            )
        loop.call_soon_threadsafe(_settle, ended, None, error)
