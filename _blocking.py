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
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from types import TracebackType
from typing import Any, Self, Unpack

import anyio.from_thread
import sniffio

from ._options import ServerOptionFields, ServerOptions, chosen
from ._server import AsyncServer, CacheTierLink, open_server
from .actors import Model, ModelControlCalls
from .protocols import (
    CacheStatistics,
    InferResponse,
    ModelConfig,
    ModelStatistics,
    RequestOptions,
    ServerClosedError,
    StepStatistics,
    check_field_names,
)


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

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if self._portal is None or self._server is None:
            raise ServerClosedError("the server is not open (use it inside its with block)")
        return self._portal.call(functools.partial(getattr(self._server, method), *args, **kwargs))

    def _sync(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if self._portal is None or self._server is None:
            raise ServerClosedError("the server is not open (use it inside its with block)")
        fn = functools.partial(getattr(self._server, method), *args, **kwargs)
        return self._portal.call(_run_sync, fn)

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
        response: InferResponse = self._call("infer", model_name, inputs, options=options, **fields)
        return response

    def model_statistics(
        self, name: str | None = None, version: int | None = None
    ) -> list[ModelStatistics]:
        """See `AsyncServer.model_statistics`."""
        result: list[ModelStatistics] = self._sync("model_statistics", name, version)
        return result

    def metrics_text(self) -> str:
        """See `AsyncServer.metrics_text`."""
        result: str = self._sync("metrics_text")
        return result

    @property
    def metrics_url(self) -> str | None:
        """See `AsyncServer.metrics_url`."""
        return self._server.metrics_url if self._server is not None else None

    def stream_infer(
        self, model_name: str, inputs: Mapping[str, Any], **kwargs: Any
    ) -> Iterator[InferResponse]:
        """The responses of a decoupled model, as they come; see `AsyncServer.stream_infer`
        for the arguments. Stop iterating (or close the iterator) to stop the model."""
        portal, server = self._portal, self._server
        if portal is None or server is None:
            raise ServerClosedError("the server is not open (use it inside its with block)")
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

    def cache_statistics(self) -> CacheStatistics | None:
        """See `AsyncServer.cache_statistics`."""
        result: CacheStatistics | None = self._sync("cache_statistics")
        return result

    def step_statistics(self, ensemble: str) -> tuple[StepStatistics, ...]:
        """See `AsyncServer.step_statistics`."""
        result: tuple[StepStatistics, ...] = self._sync("step_statistics", ensemble)
        return result

    def cache_tier_link(self) -> CacheTierLink:
        """See `AsyncServer.cache_tier_link` (use the link on the server's thread)."""
        result: CacheTierLink = self._sync("cache_tier_link")
        return result

    def model_config(self, name: str, version: int = -1) -> ModelConfig:
        """See `AsyncServer.model_config`."""
        result: ModelConfig = self._sync("model_config", name, version)
        return result

    def model_names(self) -> list[str]:
        """See `AsyncServer.model_names`."""
        result: list[str] = self._sync("model_names")
        return result

    def model_versions(self, name: str) -> list[int]:
        """See `AsyncServer.model_versions`."""
        result: list[int] = self._sync("model_versions", name)
        return result

    def output_labels(self, name: str, version: int = -1) -> Mapping[str, Sequence[str]]:
        """See `AsyncServer.output_labels`."""
        result: Mapping[str, Sequence[str]] = self._sync("output_labels", name, version)
        return result

    def is_decoupled(self, name: str) -> bool:
        """See `AsyncServer.is_decoupled`."""
        result: bool = self._sync("is_decoupled", name)
        return result

    def use_model_control(self, control: ModelControlCalls | None) -> None:
        """See `AsyncServer.use_model_control`."""
        self._sync("use_model_control", control)

    @property
    def model_repository(self) -> Path | None:
        """See `AsyncServer.model_repository`."""
        return self._server.model_repository if self._server is not None else None

    def is_model_ready(self, name: str, version: int = -1) -> bool:
        """See `AsyncServer.is_model_ready`."""
        result: bool = self._sync("is_model_ready", name, version)
        return result

    def model_ready(self, name: str, version: int = -1) -> bool:
        """See `AsyncServer.model_ready`."""
        result: bool = self._call("model_ready", name, version)
        return result

    def load_model(self, model: str | Model | Sequence[Model]) -> None:
        """See `AsyncServer.load_model`."""
        self._call("load_model", model)

    def unload_model(self, name: str, *, unload_dependents: bool = False) -> None:
        """See `AsyncServer.unload_model`."""
        self._call("unload_model", name, unload_dependents=unload_dependents)


async def _run_sync(fn: functools.partial[Any]) -> Any:
    """Run a synchronous server method on the event loop thread (its state lives there)."""
    return fn()
