"""Routing requests to loaded models: admission, the response cache, per-request accounting.

How this works. `RequestRouter.infer` resolves the model and version in the `LoadedModels`,
checks the inputs against the config (a refused request counts as REJECTED on its model), and
keeps Triton's per-model statistics, a span when tracing, and the observer's events around
the call. Ensembles call back into it for their steps (it is their `Router`), so composing
models are counted exactly like direct requests. How a request runs (at once in the
caller's task, alone past a batcher, or queued) is its runner's choice, behind one call
(`ModelRunner.infer`); an ensemble's step actors also ask `ready_now` / `infer_now`, to run a
ready step in the task that made it ready.

A model (or ensemble) with ``response_cache`` enabled on a server with a cache goes through
the cache actor instead: a hit answers without running anything (for an ensemble, without
running any step); a miss runs exactly what an uncached request would, and stores the
response. A request for only some outputs has their names in its key: an ensemble prunes its
steps for them, so its response (even whether it fails) depends on them.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator, Mapping
from typing import Any, Protocol

import attrs
import trio
from opentelemetry.trace import Span

from ..backends import host_tensors, response_on_host
from ..caches import CacheActor, Flight
from ..protocols import (
    CacheEntry,
    InferRequest,
    InferResponse,
    InvalidRequestError,
    LoadOverride,
    ModelConfig,
    ModelControlError,
    ModelNotFoundError,
    Observer,
    OrchestrionError,
    cache_key,
    frozen_outputs,
    load_override_from_files,
    shared_outputs,
    stored_outputs_problem,
    stream_entry,
    stream_responses,
)
from ..telemetry import UNSAMPLED, RequestTracing
from ._batch_queue import batch_size
from ._ensemble_fusion import fusable
from ._executor import Executor
from ._loaded_models import LoadedModels, Runner

STREAM_ENTRY_LIMIT = 256 * 1024 * 1024
"""Bytes of outputs a stream may have and still be stored whole (its copies are held until
it ends): a longer stream is served, and not cached."""


class ModelControlCalls(Protocol):
    """The model control a served repository has (``frontends/_control.py``)."""

    async def load(self, name: str, override: LoadOverride | None = None) -> None:
        """Load (or reload) ``name`` as a load request would."""
        ...

    async def unload(self, name: str, parameters: Mapping[str, object] | None = None) -> None:
        """Unload ``name`` as an unload request would."""
        ...


def caches(config: ModelConfig) -> bool:
    """Whether ``config`` asks for its responses to be cached."""
    cache = config.response_cache
    return cache is not None and cache.enable


@attrs.define(eq=False)
class RequestRouter:
    """Admits requests for the loaded models and runs them, through the cache when theirs
    caches; the `Router` of every ensemble's steps."""

    models: LoadedModels
    observer: Observer | None
    """Receives runtime events; None when nobody listens (the hot path skips the calls)."""
    cache: CacheActor | None = None
    """The server's response cache; None when the server has none."""
    tracing: RequestTracing | None = None
    """Spans of every request; None when the server does not trace."""
    control: ModelControlCalls | None = None
    """Where a model's own ``pb_utils.load_model`` / ``unload_model`` go: the served
    repository's model control (``orchestrion serve``); None: they are refused."""

    @property
    def generation(self) -> int:
        """Counts the changes to the set of loaded runners (`LoadedModels.generation`)."""
        return self.models.generation

    async def load_model(
        self, name: str, config: str | None, files: Mapping[str, bytes] | None
    ) -> None:
        """A model's code loads ``name`` (``pb_utils.load_model``), as a load request of
        the served repository's model control would.

        Raises:
            ModelControlError: no model control (an embedded server), or not explicit mode.
        """
        await self._control("load_model").load(name, load_override_from_files(config, files))

    async def unload_model(self, name: str, unload_dependents: bool) -> None:
        """A model's code unloads ``name`` (``pb_utils.unload_model``)."""
        parameters = {"unload_dependents": unload_dependents}
        await self._control("unload_model").unload(name, parameters)

    def _control(self, call: str) -> ModelControlCalls:
        if self.control is None:
            raise ModelControlError(
                f"{call} from a model's code needs a served repository's model control "
                "(orchestrion serve --model-control-mode=explicit); in-process, load and "
                "unload with the server's load_model / unload_model"
            )
        return self.control

    def resolve(self, name: str, version: int = -1) -> Runner:
        """The runner of ``name`` at ``version`` (`LoadedModels.resolve`)."""
        return self.models.resolve(name, version)

    def model_config(self, name: str, version: int = -1) -> ModelConfig:
        """The config of ``name`` at ``version`` as loaded (a mapped step's items need it)."""
        return self.models.resolve(name, version).config

    def decoupled(self, model_name: str) -> bool:
        """Whether ``model_name`` streams: a decoupled model, or an ensemble with one."""
        return self.models.decoupled(model_name)

    def is_ready(self, name: str, version: int = -1) -> bool:
        """Whether ``name`` (at ``version``; -1 or 0: any) is loaded and serving."""
        try:
            self.models.resolve(name, version)
        except OrchestrionError:  # not loaded, or the server is closing
            return False
        return True

    async def _admitted(
        self, request: InferRequest, from_ensemble: bool = False
    ) -> tuple[Runner, InferRequest]:
        """`_admit`, in a worker thread when checking the inputs takes long (BYTES tensors of
        many elements, each of which is looked at): on the event loop it would hold every
        other request meanwhile."""
        runner = self.models.resolve(request.model_name, request.model_version)
        if runner.checker.costly(request.inputs):
            return await trio.to_thread.run_sync(self._admit, request, from_ensemble, runner)
        return self._admit(request, from_ensemble, runner)

    def _admit(
        self, request: InferRequest, from_ensemble: bool = False, runner: Runner | None = None
    ) -> tuple[Runner, InferRequest]:
        """Resolve the model (unless ``runner`` is it) and check the request against its
        config."""
        if runner is None:
            runner = self.models.resolve(request.model_name, request.model_version)
        inputs = runner.checker.inputs(request.inputs, adapt_batching=from_ensemble)
        wanted = request.requested_outputs
        if wanted is not None and not wanted <= runner.output_names:
            unknown = sorted(wanted - runner.output_names)
            raise InvalidRequestError(
                f"model '{runner.config.name}': requested unknown outputs "
                + ", ".join(f"'{o}'" for o in unknown)
                + f" (outputs: {', '.join(sorted(runner.output_names))})"
            )
        if inputs is request.inputs:
            return runner, request
        return runner, request.derive(
            model_name=request.model_name,
            model_version=request.model_version,
            inputs=inputs,
            requested_outputs=wanted,
        )

    def _rejected(self, request: InferRequest, error: InvalidRequestError) -> None:
        """Count a request its model refused (bad inputs) as a REJECTED failure."""
        if isinstance(error, ModelNotFoundError):
            return  # no model to count it on
        versions = self.models.runners.get(request.model_name)
        if versions:
            version = request.model_version
            runner = versions.get(version) if version > 0 else versions[max(versions)]
            if runner is not None:
                runner.stats.request_finished(error, 0, 0)

    def _started(
        self, runner: Runner, request: InferRequest, from_ensemble: bool
    ) -> tuple[int, InferRequest, Span | None]:
        runner.stats.pending += 1
        span = None
        if self.tracing is not None and request.trace is not UNSAMPLED:
            batch = batch_size(runner.config.max_batch_size, request.inputs)
            span, request = self.tracing.start_request(
                runner.config.name, runner.version, request, batch, from_ensemble
            )
        if self.observer is not None:
            self.observer.request_started(runner.config.name, runner.version, request)
        return time.perf_counter_ns(), request, span

    def _finished(
        self,
        runner: Runner,
        request: InferRequest,
        start: int,
        error: BaseException | None,
        span: Span | None,
        cache_hit: bool | None = None,
    ) -> None:
        duration = time.perf_counter_ns() - start
        stats = runner.stats
        stats.pending -= 1
        batch = batch_size(runner.config.max_batch_size, request.inputs)
        stats.request_finished(error, duration, batch, bool(cache_hit))
        if span is not None:
            RequestTracing.end_request(span, error, cache_hit)
        if self.observer is not None:
            self.observer.request_finished(
                runner.config.name, runner.version, request, error, duration
            )

    async def infer(self, request: InferRequest, *, from_ensemble: bool = False) -> InferResponse:
        """Check ``request`` against its model's config and run it.

        A requested output the model leaves out of its answer is left out of the response,
        as Triton does (a python-backend model may answer with fewer outputs).

        Args:
            request: the request.
            from_ensemble: the request is an ensemble step's: a leading batch of 1 is added
                or removed where only one side batches (Triton's rule inside ensembles).

        Raises:
            ModelNotFoundError: unknown model or version.
            InvalidRequestError: bad inputs or requested outputs (nothing ran).
            InferenceError: the model or a step of the ensemble failed.
        """
        try:
            runner, request = await self._admitted(request, from_ensemble)
            if self.models.decoupled(runner.config.name):
                raise InvalidRequestError(
                    f"model '{runner.config.name}' is decoupled (it sends zero or many "
                    "responses per request): call stream_infer"
                )
        except InvalidRequestError as exc:
            self._rejected(request, exc)
            raise
        if self.cache is not None and caches(runner.config):
            return await self._infer_cached(self.cache, runner, request, from_ensemble)
        start, request, span = self._started(runner, request, from_ensemble)
        try:
            response = await runner.infer(request)  # the runner picks the quickest way
        except BaseException as exc:
            self._finished(runner, request, start, exc, span)
            raise
        self._finished(runner, request, start, None, span)
        return response

    async def _infer_cached(
        self,
        cache: CacheActor,
        runner: Runner,
        request: InferRequest,
        from_ensemble: bool,
    ) -> InferResponse:
        start, request, span = self._started(runner, request, from_ensemble)
        hit: bool | None = None
        try:
            flight = await self._looked_up(cache, runner, request)
            try:
                hit = flight.entry is not None
                if flight.entry is not None:
                    response = InferResponse(
                        model_name=runner.config.name,
                        model_version=runner.version,
                        request_id=request.options.request_id,
                        outputs=shared_outputs(flight.entry, request.requested_outputs),
                        parameters=runner.response_parameters(request),
                    )
                else:
                    response = await self._run_for_cache(runner, request, flight)
            finally:
                flight.release()
        except BaseException as exc:
            self._finished(runner, request, start, exc, span, hit)
            raise
        self._finished(runner, request, start, None, span, hit)
        return response

    async def _looked_up(self, cache: CacheActor, runner: Runner, request: InferRequest) -> Flight:
        """``request``'s flight through the cache, its lookup counted and traced; an entry
        that does not fit the request (a foreign one) is rejected: a miss."""
        wanted = request.requested_outputs
        if wanted is not None and wanted >= runner.output_names:
            wanted = None  # everything: the same response as asking for nothing
        key = cache_key(
            runner.config.name,
            runner.version,
            host_tensors(request.inputs),  # a jitted step's outputs are on their device
            wanted,
            revision=self.models.revision(runner),
        )
        looking = time.perf_counter_ns()
        flight = await cache.begin(key)
        try:
            if flight.entry is not None and not flight.shared:
                problem = self._entry_problem(runner, request, flight.entry, wanted)
                if problem is not None:
                    flight.reject(problem)
            hit = flight.entry is not None
            if self.tracing is not None:
                self.tracing.record(
                    "cache_lookup",
                    request,
                    looking,
                    looking + flight.lookup_ns,
                    {"orchestrion.cache.hit": hit, "orchestrion.cache.shared": flight.shared},
                )
            # A shared result's wait is the other request's model run, not a lookup.
            runner.stats.cache_looked_up(hit, 0 if flight.shared else flight.lookup_ns)
            if self.observer is not None:
                self.observer.cache_looked_up(
                    runner.config.name, runner.version, request, hit, flight.lookup_ns
                )
        except BaseException:
            flight.release()
            raise
        return flight

    def _entry_problem(
        self,
        runner: Runner,
        request: InferRequest,
        entry: CacheEntry,
        wanted: frozenset[str] | None,
    ) -> str | None:
        """Why a stored entry cannot answer ``request`` (None: it can): a stream's entry
        must be one, and each of its responses must fit the config."""
        batch = batch_size(runner.config.max_batch_size, request.inputs)
        if not self.models.decoupled(runner.config.name):
            return stored_outputs_problem(runner.config, entry.outputs, batch, wanted)
        responses = stream_responses(entry, None)
        if responses is None:
            return "not the entry of a whole stream"
        for outputs, _ in responses:
            problem = stored_outputs_problem(runner.config, outputs, batch, wanted)
            if problem is not None:
                return problem
        return None

    async def _run_for_cache(
        self, runner: Runner, request: InferRequest, flight: Flight
    ) -> InferResponse:
        """Run a miss exactly as asked (pruned like an uncached request) and store it."""
        response = response_on_host(await runner.infer(request))
        storing = time.perf_counter_ns()
        flight.store(response)
        runner.stats.cache_miss_ns += flight.insert_ns  # Triton: a miss costs lookup + insert
        if self.tracing is not None:
            self.tracing.record("cache_insert", request, storing, storing + flight.insert_ns)
        return response

    async def stream_infer(self, request: InferRequest) -> AsyncGenerator[InferResponse, None]:
        """The responses of a decoupled model to ``request``, as they come (a model that is
        not decoupled gives its one response).

        Raises:
            the errors of `infer`, after the responses sent before the failure.
        """
        try:
            runner, request = await self._admitted(request)
        except InvalidRequestError as exc:
            self._rejected(request, exc)
            raise
        if not self.models.decoupled(runner.config.name):
            yield attrs.evolve(await self.infer(request), final=True)  # its one response
            return
        start, request, span = self._started(runner, request, False)
        error: BaseException | None = None
        hit: bool | None = None
        try:
            if self.cache is not None and caches(runner.config):
                flight = await self._looked_up(self.cache, runner, request)
                try:
                    hit = flight.entry is not None
                    if not hit:
                        # A stream runs at its reader's pace, which may be never: identical
                        # requests do not wait for it (each runs; the first to end stores).
                        flight.release()
                    async with contextlib.aclosing(
                        self._cached_stream(runner, request, flight)
                    ) as responses:
                        async for response in responses:
                            yield response
                finally:
                    flight.release()
            else:
                async with contextlib.aclosing(runner.responses(request)) as responses:
                    async for response in responses:
                        yield response
        except BaseException as exc:
            error = exc
            raise
        finally:
            self._finished(runner, request, start, error, span, hit)

    async def _cached_stream(
        self, runner: Runner, request: InferRequest, flight: Flight
    ) -> AsyncGenerator[InferResponse, None]:
        """A stream through the cache: a hit replays the stored responses in order with
        their final flags; a miss runs the model, passes each response on as it comes, and
        stores the whole stream once it has ended (a stream that fails, is left early or
        outgrows `STREAM_ENTRY_LIMIT` is not stored). Identical streams that start while one
        runs are not made to wait for it (it goes at its reader's pace): each runs."""
        if flight.entry is not None:
            replayed = stream_responses(flight.entry, request.requested_outputs) or []
            parameters = runner.response_parameters(request)
            for outputs, final in replayed:
                yield InferResponse(
                    model_name=runner.config.name,
                    model_version=runner.version,
                    request_id=request.options.request_id,
                    outputs=outputs,
                    parameters=parameters,
                    final=final,
                )
            return
        kept: list[tuple[dict[str, Any], bool]] | None = []
        wanted = request.requested_outputs
        size = 0
        async with contextlib.aclosing(runner.responses(request)) as responses:
            async for response in responses:
                response = response_on_host(response)
                if response.error is not None:
                    kept = None  # a stream with an error response is not stored
                if kept is not None:
                    outputs = frozen_outputs(
                        {n: a for n, a in response.outputs.items() if wanted is None or n in wanted}
                    )
                    size += CacheEntry(key=flight.key, outputs=outputs).nbytes  # BYTES too
                    kept = kept if size <= STREAM_ENTRY_LIMIT else None
                    if kept is not None:
                        kept.append((outputs, response.final))
                yield response
        if kept is not None:
            storing = time.perf_counter_ns()
            flight.store_entry(stream_entry(flight.key, kept))
            runner.stats.cache_miss_ns += flight.insert_ns
            if self.tracing is not None:
                self.tracing.record("cache_insert", request, storing, storing + flight.insert_ns)

    def ready_now(self, request: InferRequest) -> bool:
        """Whether `infer_now` would run ``request`` without waiting."""
        versions = self.models.runners.get(request.model_name)
        if not versions:
            return False
        version = request.model_version
        runner = versions.get(version) if version > 0 else versions[max(versions)]
        if runner is None or (self.cache is not None and caches(runner.config)):
            return False  # a cached model goes through the cache actor
        if runner.checker.costly(request.inputs):
            return False  # checked in a worker thread, by infer
        return runner.ready_now(request.inputs)

    def fusable(self, runner: object, max_batch_size: int) -> Executor | None:
        """The executor an ensemble's fused call runs ``runner``'s model by (see `Fusion`:
        a short model, stateless, not cached, not observed or traced); None: the
        scheduler runs it."""
        if self.tracing is not None or self.observer is not None:
            return None
        step = fusable(runner, max_batch_size)
        if step is None or (self.cache is not None and caches(step.config)):
            return None
        return step

    def infer_now(self, request: InferRequest) -> InferResponse:
        """`infer` of an ensemble step whose model `ready_now` said can run at once, in the
        caller's task.

        Raises:
            the errors of `infer`.
        """
        try:
            runner, request = self._admit(request, from_ensemble=True)
        except InvalidRequestError as exc:
            self._rejected(request, exc)
            raise
        return self._run_now(runner, request)

    def _run_now(self, runner: Runner, request: InferRequest) -> InferResponse:
        start, request, span = self._started(runner, request, True)
        try:
            response = runner.infer_now(request)
        except BaseException as exc:
            self._finished(runner, request, start, exc, span)
            raise
        self._finished(runner, request, start, None, span)
        return response
