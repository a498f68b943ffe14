"""The embedding API for trio programs: `open_server` and `AsyncServer`.

How this works: `open_server` opens, on one exit stack, the event-loop watchdog, the tracing,
the response cache's actor, the models (a `ModelRegistry`, whose actors live in a nursery of
their own) and the metrics endpoint, and closes them in reverse order. `AsyncServer` is a thin
face on the registry: ``infer`` turns its arguments into `RequestOptions` and an `InferRequest`
(`new_request`, which checks them), and runs it under the request's trio deadline.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, TypeVar, Unpack

import attrs
import sniffio
import trio
from opentelemetry import trace
from prometheus_client.registry import CollectorRegistry

from ._options import ServerOptionFields, ServerOptions, chosen
from .actors import Model, ModelControlCalls, ModelRegistry, watch_event_loop
from .backends import response_on_host
from .caches import CacheActor, open_cache, open_cache_actor
from .protocols import (
    CacheStatistics,
    CustomMetricFamily,
    InferenceTimeoutError,
    InferRequest,
    InferResponse,
    InvalidRequestError,
    ModelConfig,
    ModelStatistics,
    Observer,
    RequestOptions,
    StepStatistics,
    new_request,
    parse_cache_config,
    ungrouped,
)
from .repository import ConfigReading
from .telemetry import (
    RequestTracing,
    extract_traceparent,
    make_metrics_registry,
    metrics_text,
    open_metrics_endpoint,
    open_request_tracing,
)

_log = logging.getLogger("orchestrion")

_HOOKS = (
    "request_started",
    "request_finished",
    "cache_looked_up",
    "execution_finished",
    "step_started",
    "step_finished",
)


class _GuardedObservers(Observer):
    """Fans each event out to the user's observers, and drops one that raises.

    An observer runs inside the actors; its bug must not fail requests or stop the server
    (the way trio drops an `Instrument` that raises). The error is logged once.
    """

    def __init__(self, observers: Sequence[Observer]) -> None:
        self._live = list(observers)
        for hook in _HOOKS:
            setattr(self, hook, functools.partial(self._fan, hook))

    def _fan(self, hook: str, *args: Any) -> None:
        for observer in tuple(self._live):
            try:
                getattr(observer, hook)(*args)
            except Exception:
                _log.exception("observer %r raised in %s and was removed", observer, hook)
                self._live.remove(observer)


def _observer(observers: Sequence[Observer]) -> Observer | None:
    return _GuardedObservers(observers) if observers else None


@attrs.frozen
class _MetricsSource:
    """What the Prometheus collector reads from a server at each scrape."""

    registry: ModelRegistry
    extra: list[Callable[[], list[CustomMetricFamily]]] = attrs.field(factory=list)
    """More metric families, from what runs around the server (`AsyncServer.metric_families`)."""

    def model_statistics(self) -> list[ModelStatistics]:
        return self.registry.statistics()

    def cache_statistics(self) -> CacheStatistics | None:
        cache = self.registry.cache
        if cache is None:
            return None
        self.registry.gather_statistics()
        return cache.statistics()

    def all_step_statistics(self) -> list[StepStatistics]:
        return self.registry.all_step_statistics()

    def custom_metrics(self) -> list[CustomMetricFamily]:
        families = self.registry.custom_metrics()
        for source in self.extra:
            families.extend(source())
        return families


_Callback = TypeVar("_Callback", bound=Callable[..., Any])


@contextlib.contextmanager
def _listed(callbacks: list[_Callback], callback: _Callback) -> Iterator[None]:
    """``callback`` in ``callbacks`` while the block runs."""
    callbacks.append(callback)
    try:
        yield
    finally:
        callbacks.remove(callback)


@attrs.frozen
class CacheTierLink:
    """A server as a front end with a cache tier of its own sees it (the native front end's
    first tier of the response cache): when its answers stop being valid, whether a model's
    answers may be kept, and where the tier's hits are counted. Use it on the server's
    thread."""

    _registry: ModelRegistry

    @property
    def generation(self) -> int:
        """Counts the changes to the set of loaded models (each load, reload and unload):
        an answer computed at one generation may be kept until the next."""
        return self._registry.generation

    def changes(self, callback: Callable[[int], None]) -> AbstractContextManager[None]:
        """Within the block, ``callback(generation)`` runs right after each change to the
        set of loaded models."""
        return _listed(self._registry.models_listeners, callback)

    def statistics_source(self, gather: Callable[[], None]) -> AbstractContextManager[None]:
        """Within the block, ``gather()`` runs before statistics and metrics are read, to
        bring in what the tier counted (`count_hits`, `report_usage`)."""
        return _listed(self._registry.statistics_sources, gather)

    def has_cache(self) -> bool:
        """Whether the server has a response cache."""
        return self._registry.cache is not None

    def caches(self, name: str, version: int = -1) -> bool:
        """Whether the server caches the answers of ``name`` (it has a cache and the
        model's config enables it)."""
        if self._registry.cache is None:
            return False
        cache = self._registry.resolve(name, version).config.response_cache
        return cache is not None and cache.enable

    def count_hits(
        self, name: str, version: int, count: int, duration_ns: int, lookup_ns: int
    ) -> None:
        """Count ``count`` requests for ``name`` at ``version`` answered by the tier:
        successes and cache hits in the model's statistics and metrics, hits in the
        cache's (``duration_ns``, ``lookup_ns``: their total times)."""
        self._registry.count_cache_hits(name, version, count, duration_ns, lookup_ns)

    def report_usage(self, entries: int, used_bytes: int) -> None:
        """What the tier holds now (in the cache's statistics and metrics)."""
        if self._registry.cache is not None:
            self._registry.cache.frontend_usage(entries, used_bytes)


@attrs.define(eq=False)
class AsyncServer:
    """A running orchestrion server inside a trio program. Get one from `open_server`."""

    _registry: ModelRegistry
    _metrics: CollectorRegistry = attrs.field(init=False)
    """The server's own prometheus-client registry (Triton's metrics and orchestrion's)."""
    metrics_url: str | None = attrs.field(default=None, init=False)
    """Where Prometheus can scrape the metrics (None without ``metrics_port``)."""

    _source: _MetricsSource = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._source = _MetricsSource(self._registry)
        self._metrics = make_metrics_registry(self._source)

    def metrics_text(self) -> str:
        """The Prometheus text a scrape of the metrics endpoint returns now."""
        return metrics_text(self._metrics)

    def metric_families(
        self, source: Callable[[], list[CustomMetricFamily]]
    ) -> AbstractContextManager[None]:
        """Add what ``source`` returns to every scrape while the block runs (what runs
        around the server counts itself: models loaded on demand, say)."""
        return _listed(self._source.extra, source)

    async def infer(
        self,
        model_name: str,
        inputs: Mapping[str, Any],
        *,
        options: RequestOptions | None = None,
        **fields: Any,
    ) -> InferResponse:
        """Run one inference request and return its response.

        ``server.infer("m", {"X": x}, outputs=["Y"], timeout=2.0)``: the keyword arguments
        are the fields of `RequestOptions` (``model_version``, ``outputs``, ``request_id``,
        ``parameters``, ``sequence_id``, ``sequence_start``, ``sequence_end``, ``priority``,
        ``timeout``, ``traceparent``), documented there.

        Args:
            model_name: the model or ensemble to run.
            inputs: input tensors by name (numpy arrays, or anything ``np.asarray`` takes;
                BYTES inputs as arrays of ``bytes`` or ``str``). Data types must match the
                config exactly.
            options: how to run it, made beforehand (None: the defaults).
            **fields: `RequestOptions` fields by name, replacing those of ``options``.

        Returns:
            the response: ``.outputs`` (numpy arrays by name) and ``.parameters``.

        Raises:
            TypeError: a keyword argument that is not a `RequestOptions` field.
            ModelNotFoundError: unknown model or version.
            InvalidRequestError: an argument of the wrong kind; wrong, missing or unexpected
                inputs or outputs.
            InferenceError: the model or an ensemble step failed (the message names it).
            InferenceTimeoutError: ``timeout`` expired.
        """
        request, options = new_request(
            model_name, inputs, options, fields, caller="AsyncServer.infer"
        )
        request = self._traced(request, options.traceparent)
        # Outputs leave the server as numpy arrays, whatever device computed them.
        if request.options.timeout is None:
            return response_on_host(await self._registry.infer(request))
        with trio.move_on_after(request.options.timeout):
            # Work that cannot be interrupted (a synchronous execute) may finish late: its
            # result is then cancelled at the next checkpoint, and counted as a failure.
            return response_on_host(await self._registry.infer(request))
        raise InferenceTimeoutError(
            f"request for model '{model_name}' timed out after {options.timeout} s"
        )

    def _traced(self, request: InferRequest, traceparent: str | None) -> InferRequest:
        """``request`` as a child of the caller's span (a malformed header is ignored)."""
        if traceparent is not None and self._registry.tracing is not None:
            parent = extract_traceparent(traceparent)
            if trace.get_current_span(parent).get_span_context().is_valid:
                return request.with_trace(parent)
        return request

    def model_statistics(
        self, name: str | None = None, version: int | None = None
    ) -> list[ModelStatistics]:
        """Triton-style statistics: every model, every version of ``name``, or one version."""
        return self._registry.statistics(name, version)

    async def stream_infer(
        self,
        model_name: str,
        inputs: Mapping[str, Any],
        *,
        options: RequestOptions | None = None,
        **fields: Any,
    ) -> AsyncGenerator[InferResponse, None]:
        """The responses of a decoupled model (zero or many), as the model produces them.

        ``async with contextlib.aclosing(server.stream_infer(...)) as responses: async for
        response in responses: ...``; leaving early stops the model's generator. The model
        runs at most one response ahead of the caller (nothing is buffered). A model that is
        not decoupled gives its one response. Arguments and errors are those of `infer` (an
        error arrives after the responses sent before it); ``timeout`` is not offered: wrap
        the loop in a trio deadline.

        Raises:
            InvalidRequestError: also for ``options`` with a ``timeout``.
        """
        request, options = new_request(
            model_name,
            inputs,
            options,
            fields,
            caller="AsyncServer.stream_infer",
            refused=("timeout",),
        )
        if options.timeout is not None:
            raise InvalidRequestError(
                "stream_infer takes no timeout (options.timeout): wrap the loop in a trio "
                "deadline instead"
            )
        request = self._traced(request, options.traceparent)
        async with contextlib.aclosing(self._registry.stream_infer(request)) as responses:
            async for response in responses:
                yield response_on_host(response)

    def cache_statistics(self) -> CacheStatistics | None:
        """The response cache's counters and usage (None when the server has no cache)."""
        cache = self._registry.cache
        if cache is None:
            return None
        self._registry.gather_statistics()
        return cache.statistics()

    def cache_tier_link(self) -> CacheTierLink:
        """What a front end that answers repeated requests from a cache tier of its own needs
        of this server (see `CacheTierLink`)."""
        return CacheTierLink(self._registry)

    def step_statistics(self, ensemble: str) -> tuple[StepStatistics, ...]:
        """Live queue depth, in-flight count and blocked time of each step of an ensemble."""
        return self._registry.step_statistics(ensemble)

    def model_config(self, name: str, version: int = -1) -> ModelConfig:
        """The config of a loaded model."""
        return self._registry.resolve(name, version).config

    def output_labels(self, name: str, version: int = -1) -> Mapping[str, Sequence[str]]:
        """The class labels of a loaded model's outputs (`Model.labels`), by output."""
        return self._registry.resolve(name, version).labels

    def is_decoupled(self, name: str) -> bool:
        """Whether ``name`` streams its responses (a decoupled model, or an ensemble with
        one): use `stream_infer` for it."""
        self._registry.resolve(name)
        return self._registry.decoupled(name)

    def use_model_control(self, control: ModelControlCalls | None) -> None:
        """Where a model's own ``pb_utils.load_model`` / ``unload_model`` go: the served
        repository's model control (``orchestrion serve`` sets its own); None refuses them."""
        self._registry.use_model_control(control)

    @property
    def model_repository(self) -> Path | None:
        """The model repository folder the server reads (None without one)."""
        return self._registry.repository

    def model_names(self) -> list[str]:
        """Names of the loaded models and ensembles."""
        return self._registry.model_names()

    def model_versions(self, name: str) -> list[int]:
        """Loaded versions of ``name`` (empty when it is not loaded)."""
        return self._registry.versions(name)

    def is_model_ready(self, name: str, version: int = -1) -> bool:
        """Whether ``name`` (at ``version``) is loaded and serving."""
        return self._registry.is_ready(name, version)

    async def model_ready(self, name: str, version: int = -1) -> bool:
        """What the readiness endpoints answer: `is_model_ready`, and the model's own check
        (a python-backend model's ``is_ready()``, each instance, within 5 s) passes."""
        return await self._registry.passes_readiness(name, version)

    async def load_model(self, model: str | Model | Sequence[Model]) -> None:
        """Load (or reload) a model: a repository folder by name, or Python definitions.

        Loading an ensemble from the repository also loads the composing models it needs.

        Raises:
            ConfigError: the model or the resulting set of models is invalid.
            ModelLoadError: the model's code failed to import, initialise or compile.
        """
        if isinstance(model, str):
            await self._registry.load(await self._registry.read_repository([model]))
        elif isinstance(model, Model):
            await self._registry.load([model])
        else:
            await self._registry.load(list(model))

    async def unload_model(self, name: str, *, unload_dependents: bool = False) -> None:
        """Unload every version of ``name``; requests already running finish first.

        Raises:
            ModelNotFoundError: not loaded.
            ConfigError: ensembles use it and ``unload_dependents`` is False.
        """
        await self._registry.unload(name, unload_dependents=unload_dependents)


@contextlib.asynccontextmanager
async def open_server(
    model_repository: str | os.PathLike[str] | None = None,
    models: Sequence[Model] = (),
    *,
    options: ServerOptions | None = None,
    **fields: Unpack[ServerOptionFields],
) -> AsyncIterator[AsyncServer]:
    """Open an orchestrion server in a nursery of its own; models are ready on entry.

    Args:
        model_repository: a Triton-layout model repository folder, loaded whole.
        models: models defined in Python (`Model`), loaded next to the repository's.
        options: how the server runs (`ServerOptions`: which models load at start, the
            response cache, the metrics endpoint, tracing, observers, how configs are read).
        fields: any field of `ServerOptions` by name (``metrics_port=0``), over ``options``.

    Raises:
        ConfigError: the repository, a config or the cache settings are invalid, or the
            metrics port cannot be bound.
        ModelLoadError: a model's code failed to import, initialise or compile.
        CacheUnavailableError: the cache's backend (Redis) cannot be reached or refuses
            the credentials.
    """
    refuse_other_loops(
        "trio",
        "open_server runs on trio, but was called from {library}; from asyncio (or plain "
        "code) use the blocking orchestrion.Server, see docs/guide.md",
    )
    opened = chosen(options, fields)
    settings = parse_cache_config(opened.cache_config)
    reading = opened.reading()  # its errors before anything opens
    # Closed in reverse order: the metrics endpoint, then the models (requests finish), then
    # the cache they used.
    async with contextlib.AsyncExitStack() as stack:
        await stack.enter_async_context(watch_event_loop())
        tracer = await open_request_tracing(stack, opened.tracing)
        actor: CacheActor | None = None
        if settings is not None:
            cache = await open_cache(settings)
            actor = await stack.enter_async_context(open_cache_actor(cache, settings.name))
        server = await stack.enter_async_context(
            _open_models(model_repository, models, opened, actor, tracer, reading)
        )
        if opened.metrics_port is not None:
            server.metrics_url = await stack.enter_async_context(
                open_metrics_endpoint(server._metrics, opened.metrics_host, opened.metrics_port)
            )
        yield server


def refuse_other_loops(wanted: str, advice: str) -> None:
    """Refuse a call made outside the ``wanted`` event loop (``"trio"``, ``"asyncio"``):
    ``advice`` says what to use there (``{library}`` in it: the caller's loop).

    Raises:
        RuntimeError: the caller runs on another event loop, or on none.
    """
    try:
        library = sniffio.current_async_library()
    except sniffio.AsyncLibraryNotFoundError:
        library = "no event loop"
    if library != wanted:
        raise RuntimeError(advice.format(library=library))


@contextlib.asynccontextmanager
async def _open_models(
    model_repository: str | os.PathLike[str] | None,
    models: Sequence[Model],
    opened: ServerOptions,
    cache: CacheActor | None,
    tracing: RequestTracing | None,
    reading: ConfigReading,
) -> AsyncIterator[AsyncServer]:
    load_models = opened.load_models
    # Errors of loading and of the caller's own block leave as themselves, not wrapped in
    # the exception group of the nursery that owns the actors.
    async with ungrouped(trio.open_nursery()) as nursery:
        registry = ModelRegistry(
            nursery=nursery,
            observer=_observer(opened.observers),
            repository=Path(model_repository) if model_repository is not None else None,
            config_reading=reading,
            cache=cache,
            tracing=tracing,
        )
        found = []
        if model_repository is not None and (load_models is None or load_models):
            found = await registry.read_repository(load_models)
        await registry.load([*found, *models], replace=False)
        try:
            yield AsyncServer(registry)
        except BaseException:
            # Leaving by an error or a cancellation: stop everything now.
            registry.abort()
            raise
        # Leaving normally: requests still running (from other tasks) finish first.
        await registry.close()


Forwarder = TypeVar("Forwarder", bound=Callable[..., Any])


def forwarding(call: Forwarder, method: Callable[..., Any], face: str) -> Forwarder:
    """``call``, a face's forwarder to `AsyncServer`'s ``method``, named, documented and
    signed as ``method`` (``face``: the class it belongs to, ``Server`` or ``AioServer``)."""
    call.__name__ = method.__name__
    call.__qualname__ = f"{face}.{method.__name__}"
    call.__doc__ = method.__doc__
    call.__signature__ = inspect.signature(method)  # type: ignore[attr-defined]
    return call
