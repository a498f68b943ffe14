"""The blocking facade: `Server`, for scripts, notebooks and non-trio applications.

How this works: entering `Server` starts an event loop (trio) in a worker thread through
anyio's blocking portal and opens the `AsyncServer` in it; each method hands its call to that
loop and waits for the answer. The thread belongs to the ``with`` block: leaving it closes the
server and joins the thread. The methods are thread-safe, so an asyncio application can call
them from ``asyncio.to_thread`` without blocking its own loop.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from types import TracebackType
from typing import Any, Concatenate, ParamSpec, Self, TypeVar, Unpack

import anyio.from_thread
import sniffio

from ._options import ServerOptionFields, ServerOptions, chosen
from ._server import AsyncServer, forwarding, open_server
from .actors import Model
from .protocols import (
    InferResponse,
    RequestOptions,
    ServerClosedError,
    check_field_names,
)

P = ParamSpec("P")
R = TypeVar("R")


def _awaited(
    method: Callable[Concatenate[AsyncServer, P], Awaitable[R]],
) -> Callable[Concatenate[Server, P], R]:
    """`AsyncServer`'s ``method`` as `Server`'s: run on the server's thread, waited for."""

    def call(self: Server, /, *args: P.args, **kwargs: P.kwargs) -> R:
        server, portal = self._opened()
        return portal.call(functools.partial(method, server, *args, **kwargs))

    return forwarding(call, method, "Server")


def _on_loop(
    method: Callable[Concatenate[AsyncServer, P], R],
) -> Callable[Concatenate[Server, P], R]:
    """`AsyncServer`'s synchronous ``method`` as `Server`'s: called on the server's thread
    (its state lives there)."""

    def call(self: Server, /, *args: P.args, **kwargs: P.kwargs) -> R:
        server, portal = self._opened()
        result: R = portal.call(_run_sync, functools.partial(method, server, *args, **kwargs))
        return result

    return forwarding(call, method, "Server")


class Server:
    """A blocking orchestrion server: ``with orchestrion.Server(...) as server:``.

    Takes the arguments of `open_server`; models are loaded and compiled on entry.
    """

    def __init__(
        self,
        model_repository: str | os.PathLike[str] | None = None,
        models: Sequence[Model] = (),
        *,
        options: ServerOptions | None = None,
        **fields: Unpack[ServerOptionFields],
    ) -> None:
        self._open = functools.partial(
            open_server, model_repository, models, options=chosen(options, fields)
        )
        self._portal_cm: AbstractContextManager[anyio.from_thread.BlockingPortal] | None = None
        self._portal: anyio.from_thread.BlockingPortal | None = None
        self._server_cm: AbstractContextManager[AsyncServer] | None = None
        self._server: AsyncServer | None = None

    def open(self) -> Self:
        """Start the server (what entering the ``with`` block does), for lifespans that
        cannot hold a ``with`` block (an asyncio web app's start-up hook, say)."""
        return self.__enter__()

    def close(self) -> None:
        """Stop the server and join its thread (what leaving the ``with`` block does)."""
        if self._portal_cm is not None:
            self.__exit__(None, None, None)

    def __enter__(self) -> Self:
        try:
            library = sniffio.current_async_library()
        except sniffio.AsyncLibraryNotFoundError:
            pass
        else:  # blocking here would stall the caller's own event loop
            raise RuntimeError(
                f"orchestrion.Server blocks; it was opened inside a running {library} event "
                "loop: use `async with orchestrion.open_server(...)` in trio code, or open "
                "Server from a worker thread (asyncio.to_thread)"
            )
        self._portal_cm = anyio.from_thread.start_blocking_portal("trio")
        self._portal = self._portal_cm.__enter__()
        try:
            self._server_cm = self._portal.wrap_async_context_manager(self._open())
            self._server = self._server_cm.__enter__()
        except BaseException as exc:
            self._portal_cm.__exit__(type(exc), exc, exc.__traceback__)
            self._portal = self._portal_cm = None
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._portal_cm is not None
        assert self._server_cm is not None
        try:
            self._server_cm.__exit__(exc_type, exc, tb)
        finally:
            self._server = self._server_cm = self._portal = None
            portal_cm, self._portal_cm = self._portal_cm, None
            portal_cm.__exit__(None, None, None)

    def _opened(self) -> tuple[AsyncServer, anyio.from_thread.BlockingPortal]:
        if self._portal is None or self._server is None:
            raise ServerClosedError("the server is not open (use it inside its with block)")
        return self._server, self._portal

    def infer(
        self,
        model_name: str,
        inputs: Mapping[str, Any],
        *,
        options: RequestOptions | None = None,
        **fields: Any,
    ) -> InferResponse:
        """Run one request; see `AsyncServer.infer` for the arguments (`RequestOptions`
        fields by name) and errors."""
        check_field_names(fields, "Server.infer")
        server, portal = self._opened()
        call = functools.partial(server.infer, model_name, inputs, options=options, **fields)
        response: InferResponse = portal.call(call)
        return response

    @property
    def metrics_url(self) -> str | None:
        """See `AsyncServer.metrics_url`."""
        return self._server.metrics_url if self._server is not None else None

    @property
    def model_repository(self) -> Path | None:
        """See `AsyncServer.model_repository`."""
        return self._server.model_repository if self._server is not None else None

    def stream_infer(
        self, model_name: str, inputs: Mapping[str, Any], **kwargs: Any
    ) -> Iterator[InferResponse]:
        """The responses of a decoupled model, as they come; see `AsyncServer.stream_infer`
        for the arguments. Stop iterating (or close the iterator) to stop the model."""
        server, portal = self._opened()
        responses = server.stream_infer(model_name, inputs, **kwargs)

        async def step() -> InferResponse | None:
            try:
                return await responses.__anext__()
            except StopAsyncIteration:
                return None

        try:
            while (response := portal.call(step)) is not None:
                yield response
        finally:
            if self._portal is portal:  # still open: stop the model's generator
                portal.call(responses.aclose)

    # The rest are AsyncServer's methods, declared there once: each runs on the server's
    # thread, awaited or called there, and is answered here.
    model_statistics = _on_loop(AsyncServer.model_statistics)
    metrics_text = _on_loop(AsyncServer.metrics_text)
    cache_statistics = _on_loop(AsyncServer.cache_statistics)
    step_statistics = _on_loop(AsyncServer.step_statistics)
    cache_tier_link = _on_loop(AsyncServer.cache_tier_link)
    metric_families = _on_loop(AsyncServer.metric_families)
    model_config = _on_loop(AsyncServer.model_config)
    model_names = _on_loop(AsyncServer.model_names)
    model_versions = _on_loop(AsyncServer.model_versions)
    output_labels = _on_loop(AsyncServer.output_labels)
    is_decoupled = _on_loop(AsyncServer.is_decoupled)
    use_model_control = _on_loop(AsyncServer.use_model_control)
    is_model_ready = _on_loop(AsyncServer.is_model_ready)
    model_ready = _awaited(AsyncServer.model_ready)
    load_model = _awaited(AsyncServer.load_model)
    unload_model = _awaited(AsyncServer.unload_model)


async def _run_sync(fn: functools.partial[Any]) -> Any:
    """Run a synchronous server method on the event loop thread (its state lives there)."""
    return fn()
