"""The set of loaded models: loading, unloading and routing requests to them.

How this works: every loaded model version has a runner (`ModelRunner` for Python/JAX
models, `EnsembleRunner` for ensembles) whose actors live in the registry's nursery. Loading
validates the *whole* resulting set of models at once (so an ensemble can never point at a
model that is not there), prepares and compiles new runners concurrently, and only then makes
them visible; a failed load changes nothing. `infer` resolves the model and version, checks the
inputs against the config, and keeps Triton's per-model statistics; ensembles call back into
it for their steps, so composing models are counted exactly like direct requests.

A model (or ensemble) with ``response_cache`` enabled on a server with a cache goes through
the cache actor instead: a hit answers without running anything (for an ensemble, without
running any step); a miss runs exactly what an uncached request would, and stores the
response. A request for only some outputs has their names in its key: an ensemble prunes its
steps for them, so its response (even whether it fails) depends on them.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Protocol

import attrs
import trio
import xxhash
from opentelemetry.trace import Span

from ..caches import CacheActor, Flight
from ..protocols import (
    ConfigError,
    InferenceError,
    InferRequest,
    InferResponse,
    InvalidRequestError,
    ModelConfig,
    ModelLoadError,
    ModelNotFoundError,
    ModelStatistics,
    Observer,
    OrchestrionError,
    ParameterValue,
    ServerClosedError,
    StepStatistics,
    TensorChecker,
    Tensors,
    cache_key,
    is_decoupled,
    shared_outputs,
    stored_outputs_problem,
    validate_repository,
)
from ..telemetry import UNSAMPLED, RequestTracing
from ._definition import Model, check_model
from ._ensemble import EnsembleRunner
from ._fusion import fusable
from ._repository import RepositoryEntry, load_model_code, scan_model_folder, scan_repository
from ._runner import ModelRunner, batch_size
from ._stats import StatsRecorder


class Runner(Protocol):
    """What the registry needs of a loaded model version."""

    @property
    def config(self) -> ModelConfig: ...

    @property
    def version(self) -> int: ...

    stats: StatsRecorder
    checker: TensorChecker
    output_names: frozenset[str]

    async def infer(self, request: InferRequest) -> InferResponse: ...

    def ready_now(self, inputs: Tensors) -> bool: ...

    def infer_now(self, request: InferRequest) -> InferResponse: ...

    def may_run_alone(self, inputs: Tensors) -> bool: ...

    async def run_alone(self, request: InferRequest) -> InferResponse | None: ...

    def statistics(self) -> ModelStatistics: ...

    def response_parameters(self, request: InferRequest) -> Mapping[str, ParameterValue]: ...

    @property
    def revision(self) -> str: ...


def _check_requested(request: InferRequest, response: InferResponse) -> None:
    wanted = request.requested_outputs
    if wanted is not None and not wanted <= response.outputs.keys():
        lost = ", ".join(f"'{o}'" for o in sorted(wanted - response.outputs.keys()))
        raise InferenceError(
            f"model '{request.model_name}' did not produce the requested outputs {lost} (a "
            "model left them out of its result)",
            model_name=request.model_name,
        )


def _keep_counting(old: StatsRecorder, runner: Runner) -> None:
    """A reloaded version keeps counting where the old one is (Prometheus counters never go
    backwards); the old runner's last requests still count on the same recorder."""
    old.load_ns = runner.stats.load_ns
    old.cache_enabled = runner.stats.cache_enabled
    old.is_ensemble = runner.stats.is_ensemble
    runner.stats = old


def _caches(config: ModelConfig) -> bool:
    cache = config.response_cache
    return cache is not None and cache.enable


def _single_error(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """Turn a loader nursery's exception group into the one error a user should see."""
    leaves: list[BaseException] = []

    def walk(exc: BaseException) -> None:
        if isinstance(exc, BaseExceptionGroup):
            for inner in exc.exceptions:
                walk(inner)
        else:
            leaves.append(exc)

    walk(group)
    if not all(isinstance(e, OrchestrionError) for e in leaves):
        return group
    if len(leaves) == 1:
        return leaves[0]
    if all(isinstance(e, ConfigError) for e in leaves):
        return ConfigError([line for e in leaves for line in e.errors])  # type: ignore[attr-defined]
    return ModelLoadError("\n".join(str(e) for e in leaves))


@attrs.define(eq=False)
class ModelRegistry:
    """Loaded models by name and version, with the nursery their actors live in."""

    nursery: trio.Nursery
    observer: Observer | None
    """Receives runtime events; None when nobody listens (the hot path skips the calls)."""
    repository: Path | None = None
    cache: CacheActor | None = None
    """The server's response cache; None when the server has none."""
    tracing: RequestTracing | None = None
    """Spans of every request; None when the server does not trace."""
    _runners: dict[str, dict[int, Runner]] = attrs.field(factory=dict)
    _lock: trio.Lock = attrs.field(factory=trio.Lock)
    _closing: bool = False
    _draining: list[EnsembleRunner] = attrs.field(factory=list)
    """Unloaded (or replaced) ensembles whose running requests have not all finished."""
    _streaming: dict[str, bool] = attrs.field(factory=dict)
    """`decoupled` answers, cleared whenever the set of loaded models changes."""
    generation: int = 0
    """Counts the changes to the set of loaded runners (a load, a reload, an unload)."""
    _revisions: dict[Runner, str] = attrs.field(factory=dict)
    """`revision` of each runner, valid while the generation is `_revisions_at`."""
    _revisions_at: int = -1

    # -- lookup ----------------------------------------------------------------------------

    def resolve(self, name: str, version: int = -1) -> Runner:
        """The runner of ``name`` at ``version`` (-1 or 0: the latest loaded).

        Raises:
            ModelNotFoundError: no such model, or no such version loaded.
            ServerClosedError: the server is shutting down.
        """
        versions = self._runners.get(name)
        if not versions:
            if self._closing:
                raise ServerClosedError("the server is shutting down")
            # Which other models are loaded is not the caller's business (a network client's).
            raise ModelNotFoundError(f"unknown model '{name}': no model of that name is loaded")
        if version <= 0:
            return versions[max(versions)]
        runner = versions.get(version)
        if runner is None:
            raise ModelNotFoundError(
                f"model '{name}' has no version {version} loaded "
                f"(loaded versions: {', '.join(map(str, sorted(versions)))})"
            )
        return runner

    def revision(self, runner: Runner) -> str:
        """The fingerprint of everything that computes ``runner``'s answers: its own code and
        config, and for an ensemble each step's model as resolved now (recursively). A load,
        reload or unload changes it, so the cache never answers with another revision's
        result."""
        if self._revisions_at != self.generation:
            self._revisions.clear()
            self._revisions_at = self.generation
        # By runner, not by name: a request admitted before a reload still holds the old one.
        found = self._revisions.get(runner)
        if found is None:
            found = self._revisions[runner] = self._compute_revision(runner, ())
        return found

    def _compute_revision(self, runner: Runner, path: tuple[str, ...]) -> str:
        scheduling = runner.config.ensemble_scheduling
        if scheduling is None or runner.config.name in path:  # a cycle is refused at load
            return runner.revision
        hasher = xxhash.xxh3_128(runner.revision.encode())
        for step in scheduling.step:
            try:
                used = self.resolve(step.model_name, step.model_version)
            except OrchestrionError:  # being unloaded: the request will fail anyway
                hasher.update(b"\0missing")
                continue
            inner = self._compute_revision(used, (*path, runner.config.name))
            for part in (used.config.name, str(used.version), inner):
                hasher.update(len(part).to_bytes(8, "little") + part.encode())
        return hasher.hexdigest()

    def model_names(self) -> list[str]:
        """Names of the loaded models, sorted."""
        return sorted(self._runners)

    def versions(self, name: str) -> list[int]:
        """Loaded versions of ``name``, ascending (empty if not loaded)."""
        return sorted(self._runners.get(name, {}))

    def statistics(
        self, name: str | None = None, version: int | None = None
    ) -> list[ModelStatistics]:
        """Statistics of every loaded version of every model, of ``name``, or of one version.

        Raises:
            ModelNotFoundError: ``name`` (or that version of it) is not loaded.
        """
        if name is None:
            return [r.statistics() for n in self.model_names() for r in self._sorted(n)]
        if version is None:
            self.resolve(name)
            return [r.statistics() for r in self._sorted(name)]
        return [self.resolve(name, version).statistics()]

    def _sorted(self, name: str) -> list[Runner]:
        return [r for _, r in sorted(self._runners.get(name, {}).items())]

    def step_statistics(self, ensemble: str) -> tuple[StepStatistics, ...]:
        """Live per-step state of the latest version of an ensemble."""
        runner = self.resolve(ensemble)
        if not isinstance(runner, EnsembleRunner):
            raise InvalidRequestError(f"model '{ensemble}' is not an ensemble")
        return runner.step_statistics()

    def all_step_statistics(self) -> list[StepStatistics]:
        """Live per-step state of the latest version of every loaded ensemble."""
        latest = [self._sorted(name)[-1] for name in self.model_names()]
        return [
            step
            for runner in latest
            if isinstance(runner, EnsembleRunner)
            for step in runner.step_statistics()
        ]

    # -- requests --------------------------------------------------------------------------

    def _admit(
        self, request: InferRequest, from_ensemble: bool = False
    ) -> tuple[Runner, InferRequest]:
        """Resolve the model and check the request against its config."""
        runner = self.resolve(request.model_name, request.model_version)
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
        versions = self._runners.get(request.model_name)
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

    async def infer(
        self, request: InferRequest, *, strict_outputs: bool = False, from_ensemble: bool = False
    ) -> InferResponse:
        """Check ``request`` against its model's config and run it.

        Args:
            request: the request.
            strict_outputs: a requested output the model leaves out is an error (for a
                client that named it; an ensemble step just leaves it out).
            from_ensemble: the request is an ensemble step's: a leading batch of 1 is added
                or removed where only one side batches (Triton's rule inside ensembles).

        Raises:
            ModelNotFoundError: unknown model or version.
            InvalidRequestError: bad inputs or requested outputs (nothing ran).
            InferenceError: the model or a step of the ensemble failed, or (strict) a
                requested output was left out.
        """
        try:
            runner, request = self._admit(request, from_ensemble)
            if self.decoupled(runner.config.name):
                raise InvalidRequestError(
                    f"model '{runner.config.name}' is decoupled (it sends zero or many "
                    "responses per request): call stream_infer"
                )
        except InvalidRequestError as exc:
            self._rejected(request, exc)
            raise
        if self.cache is not None and _caches(runner.config):
            return await self._infer_cached(
                self.cache, runner, request, strict_outputs, from_ensemble
            )
        # Short synchronous work on an idle instance runs here, between a cancellation check
        # and a checkpoint, instead of making a trip through the model's queue.
        now = runner.ready_now(request.inputs)
        start, request, span = self._started(runner, request, from_ensemble)
        try:
            if now:
                await trio.lowlevel.checkpoint_if_cancelled()
                response = runner.infer_now(request)
                await trio.lowlevel.checkpoint()  # a result past a deadline is cancelled
            else:
                alone = None
                if runner.may_run_alone(request.inputs):
                    alone = await runner.run_alone(request)
                if alone is not None:
                    response = alone
                    await trio.lowlevel.checkpoint()  # a result past a deadline is cancelled
                else:
                    response = await runner.infer(request)
                    # The answer came from another task; a deadline that passed meanwhile
                    # has been seen by now: a late result is cancelled, not returned.
                    await trio.lowlevel.checkpoint_if_cancelled()
            if strict_outputs:
                _check_requested(request, response)
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
        strict_outputs: bool,
        from_ensemble: bool,
    ) -> InferResponse:
        start, request, span = self._started(runner, request, from_ensemble)
        hit: bool | None = None
        try:
            wanted = request.requested_outputs
            if wanted is not None and wanted >= runner.output_names:
                wanted = None  # everything: the same response as asking for nothing
            key = cache_key(
                runner.config.name,
                runner.version,
                request.inputs,
                wanted,
                revision=self.revision(runner),
            )
            looking = time.perf_counter_ns()
            flight = await cache.begin(key)
            try:
                if flight.entry is not None and not flight.shared:
                    problem = stored_outputs_problem(
                        runner.config,
                        flight.entry.outputs,
                        batch_size(runner.config.max_batch_size, request.inputs),
                        wanted,
                    )
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
                if flight.entry is not None:
                    response = InferResponse(
                        model_name=runner.config.name,
                        model_version=runner.version,
                        request_id=request.request_id,
                        outputs=shared_outputs(flight.entry, request.requested_outputs),
                        parameters=runner.response_parameters(request),
                    )
                else:
                    response = await self._run_for_cache(runner, request, flight)
            finally:
                flight.release()
            if strict_outputs:
                _check_requested(request, response)
        except BaseException as exc:
            self._finished(runner, request, start, exc, span, hit)
            raise
        self._finished(runner, request, start, None, span, hit)
        return response

    async def _run_for_cache(
        self, runner: Runner, request: InferRequest, flight: Flight
    ) -> InferResponse:
        """Run a miss exactly as asked (pruned like an uncached request) and store it."""
        response = await runner.infer(request)
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
            runner, request = self._admit(request)
        except InvalidRequestError as exc:
            self._rejected(request, exc)
            raise
        if not self.decoupled(runner.config.name):
            yield await self.infer(request, strict_outputs=True)
            return
        start, request, span = self._started(runner, request, False)
        error: BaseException | None = None
        try:
            if isinstance(runner, EnsembleRunner):
                async with contextlib.aclosing(runner.stream(request)) as responses:
                    async for response in responses:
                        yield response
            else:
                assert isinstance(runner, ModelRunner)
                async with contextlib.aclosing(runner.stream(request)) as outputs:
                    async for produced in outputs:
                        yield runner._response(request, produced)
        except BaseException as exc:
            error = exc
            raise
        finally:
            self._finished(runner, request, start, error, span)

    def decoupled(self, model_name: str) -> bool:
        """Whether ``model_name`` streams: a decoupled model, or an ensemble with one."""
        found = self._streaming.get(model_name)
        if found is None:
            found = self._streaming[model_name] = is_decoupled(model_name, self._loaded_configs())
        return found

    def ready_now(self, request: InferRequest) -> bool:
        """Whether `infer_now` would run ``request`` without waiting."""
        versions = self._runners.get(request.model_name)
        if not versions:
            return False
        version = request.model_version
        runner = versions.get(version) if version > 0 else versions[max(versions)]
        if runner is None or (self.cache is not None and _caches(runner.config)):
            return False  # a cached model goes through the cache actor
        return runner.ready_now(request.inputs)

    def fusable(self, runner: object, max_batch_size: int) -> bool:
        """Whether an ensemble may trace ``runner`` into its fused call (see `Fusion`): a
        short jitted model, stateless and unbatched, not cached, not observed or traced."""
        if self.tracing is not None or self.observer is not None:
            return False
        if not fusable(runner, max_batch_size):
            return False
        return self.cache is None or not _caches(runner.config)  # type: ignore[attr-defined]

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

    # -- loading ---------------------------------------------------------------------------

    def _loaded_configs(self) -> dict[str, ModelConfig]:
        return {n: self._runners[n][max(v)].config for n, v in self._runners.items() if v}

    async def load(self, models: Sequence[Model], *, replace: bool = True) -> None:
        """Load ``models`` (several versions of one name allowed) next to what is loaded.

        The resulting set is validated as a whole; new runners are compiled concurrently
        and become visible together. A name already loaded is replaced (its old versions
        are unloaded once the new ones are ready).

        Raises:
            ConfigError: the set would be invalid (every problem listed).
            ModelLoadError: a model's code failed to load or compile.
        """
        async with self._lock:
            if self._closing:
                raise ServerClosedError("the server is shutting down")
            await self._load_locked(models, replace=replace)

    async def _load_locked(self, models: Sequence[Model], *, replace: bool) -> None:
        new: dict[str, dict[int, Model]] = {}
        errors: list[str] = []
        for model in models:
            errors.extend(check_model(model))
            if model.version in new.setdefault(model.name, {}):
                errors.append(f"model '{model.name}' version {model.version} is defined twice")
            new[model.name][model.version] = model
            if not replace and model.name in self._runners:
                errors.append(f"model '{model.name}' is already loaded")
        configs = self._loaded_configs()
        versions: dict[str, Iterable[int]] = {n: list(v) for n, v in self._runners.items()}
        for name, defs in new.items():
            latest = defs[max(defs)]
            if any(d.config != latest.config for d in defs.values()):
                errors.append(f"model '{name}': all versions must share one config")
            configs[name] = latest.config
            versions[name] = list(defs)
        sources = {
            name: model.config_source
            for name, defs in new.items()
            for model in defs.values()
            if model.config_source != "<python>"
        }
        errors.extend(validate_repository(configs, versions, sources))
        if errors:
            raise ConfigError(list(dict.fromkeys(errors)))

        started: dict[str, dict[int, Runner]] = {}

        async def start(runner: Runner, serve: object) -> None:
            began = time.perf_counter_ns()
            await self.nursery.start(serve)  # type: ignore[arg-type]
            self._loaded(runner, time.perf_counter_ns() - began)
            started.setdefault(runner.config.name, {})[runner.version] = runner

        plain = [m for defs in new.values() for m in defs.values() if not m.config.is_ensemble]
        ensembles = [m for defs in new.values() for m in defs.values() if m.config.is_ensemble]
        try:
            async with trio.open_nursery() as loader:
                for model in plain:
                    runner = ModelRunner(model, self.observer)
                    runner.tracing = self.tracing
                    loader.start_soon(start, runner, runner.serve)
        except BaseExceptionGroup as group:
            await self._close_runners(started)
            raise _single_error(group) from None
        except BaseException:
            await self._close_runners(started)
            raise
        try:
            for model in ensembles:
                ensemble = EnsembleRunner(
                    model.config, model.version, self, self.observer, revision=model.revision
                )
                await start(ensemble, ensemble.serve)
        except BaseException:  # cancelled while starting: stop what was started
            await self._close_runners(started)
            raise
        old = {name: self._runners.get(name, {}) for name in started}
        for name, runners in started.items():
            for version, fresh in runners.items():
                replaced = old[name].get(version)
                if replaced is not None:
                    _keep_counting(replaced.stats, fresh)
            self._runners[name] = runners
        self.generation += 1
        self._streaming.clear()
        await self._close_runners(old)

    def _loaded(self, runner: Runner, load_ns: int) -> None:
        stats = runner.stats
        stats.load_ns = load_ns
        stats.is_ensemble = isinstance(runner, EnsembleRunner)
        stats.cache_enabled = self.cache is not None and _caches(runner.config)

    async def _close_runners(self, runners: Mapping[str, Mapping[int, Runner]]) -> None:
        """Stop ``runners``: all refuse new work at once, then wait for running requests.

        Stopping happens even if the wait is cancelled: the last request out closes the door.
        """
        every = [r for versions in runners.values() for r in versions.values()]
        for runner in every:
            if isinstance(runner, EnsembleRunner):
                runner.begin_close()
                # Until its runs are done, it still uses its models (see `_uses`).
                self._draining.append(runner)
            elif isinstance(runner, ModelRunner):
                runner.close()
        for runner in every:
            if isinstance(runner, EnsembleRunner):
                await runner.close()

    def _uses(self) -> dict[str, set[str]]:
        """For each loaded or still draining ensemble, the models its steps use."""
        self._draining = [r for r in self._draining if not r.drained]
        configs = [*self._loaded_configs().values(), *(r.config for r in self._draining)]
        uses: dict[str, set[str]] = {}
        for config in configs:
            if config.ensemble_scheduling is not None:
                used = uses.setdefault(config.name, set())
                used.update(s.model_name for s in config.ensemble_scheduling.step)
        return uses

    def dependents(self, name: str) -> list[str]:
        """Loaded ensembles that use ``name``, directly or through other ensembles,
        outermost first (the order in which to stop them)."""
        uses = self._uses()
        found: set[str] = set()
        todo = [name]
        while todo:
            target = todo.pop()
            for ensemble, used in uses.items():
                if target in used and ensemble not in found:
                    found.add(ensemble)
                    todo.append(ensemble)
        return self._outermost_first(found, uses)

    @staticmethod
    def _outermost_first(names: set[str], uses: Mapping[str, set[str]]) -> list[str]:
        """``names`` ordered so that an ensemble comes before every ensemble it uses."""
        order: list[str] = []
        left = set(names)
        while left:
            # Not used by any ensemble still left: nothing outside it is waiting on it.
            free = sorted(n for n in left if not any(n in uses.get(o, ()) for o in left))
            if not free:  # a cycle (refused at load); stop in name order
                free = sorted(left)
            order.extend(free)
            left.difference_update(free)
        return order

    async def unload(self, name: str, *, unload_dependents: bool = False) -> None:
        """Unload every version of ``name``; running requests finish first.

        Raises:
            ModelNotFoundError: ``name`` is not loaded.
            ConfigError: loaded ensembles use ``name`` and ``unload_dependents`` is False.
        """
        async with self._lock:
            self.resolve(name)
            users = self.dependents(name)
            if users and not unload_dependents:
                raise ConfigError(
                    f"model '{name}' is used by ensembles {', '.join(sorted(users))}; unload "
                    "them first or pass unload_dependents=True"
                )
            self._streaming.clear()
            for victim in [*users, name]:  # outermost first: inner ones still serve them
                runners = self._runners.pop(victim, {})
                self.generation += 1
                await self._close_runners({victim: runners})
                for draining in [r for r in self._draining if r.config.name == victim]:
                    await draining.close()  # left draining by an earlier, cancelled unload

    async def close(self) -> None:
        """Unload everything: ensembles first, outermost first, then the models they use."""
        async with self._lock:
            self._closing = True
            for draining in list(self._draining):  # unloaded earlier, still finishing runs
                await draining.close()
            ensembles = {n for n in self._runners if self._is_ensemble(n)}
            # Each ensemble refuses new requests and waits for its runs, whose steps still
            # need what it uses: inner ensembles and models go only afterwards.
            for name in self._outermost_first(ensembles, self._uses()):
                await self._close_runners({name: self._runners[name]})
            models, self._runners = self._runners, {}
            self.generation += 1
            await self._close_runners({n: r for n, r in models.items() if n not in ensembles})

    def abort(self) -> None:
        """The server is stopping by an error: answer nothing more (the actors are being
        cancelled by their nursery; open streams fail at their next step)."""
        self._closing = True
        for versions in self._runners.values():
            for runner in versions.values():
                if isinstance(runner, ModelRunner):
                    runner.close()
        self._runners = {}
        self.generation += 1

    def _is_ensemble(self, name: str) -> bool:
        versions = self._runners.get(name) or {}
        return any(isinstance(r, EnsembleRunner) for r in versions.values())

    # -- repository ------------------------------------------------------------------------

    async def read_repository(self, names: Sequence[str] | None = None) -> list[Model]:
        """Read models from the repository folder: all of them, or ``names`` plus the
        composing models their ensembles need that are not loaded yet. Nothing is loaded.

        Raises:
            ConfigError: the repository or a config is wrong (files and fields named).
            ModelLoadError: a ``model.py`` failed to import.
        """
        if self.repository is None:
            raise ConfigError("no model repository was configured")
        root = self.repository
        if names is None:
            entries, errors = await trio.to_thread.run_sync(scan_repository, root)
        else:
            entries, errors = await trio.to_thread.run_sync(self._scan_closure, root, list(names))
        if errors:
            raise ConfigError(errors)
        return await trio.to_thread.run_sync(_load_code, entries)

    def _scan_closure(
        self, root: Path, names: list[str]
    ) -> tuple[list[RepositoryEntry], list[str]]:
        entries: dict[str, RepositoryEntry] = {}
        errors: list[str] = []
        todo = list(names)
        while todo:
            name = todo.pop()
            if name in entries:
                continue
            try:
                folder = (root / name).resolve()
                found = folder.parent == root.resolve() and folder.is_dir()
            except OSError:  # a name the file system cannot hold (too long, say)
                found = False
            if not found:
                errors.append(f"{root}: has no model folder {name!r:.80}")
                continue
            entry, problems = scan_model_folder(folder)
            errors.extend(problems)
            if entry is None:
                continue
            entries[name] = entry
            sched = entry.config.ensemble_scheduling
            if sched is not None:
                todo.extend(
                    s.model_name
                    for s in sched.step
                    if s.model_name not in self._runners and s.model_name not in entries
                )
        return list(entries.values()), errors


def _load_code(entries: Sequence[RepositoryEntry]) -> list[Model]:
    """Import every selected version; report all failures together.

    Raises:
        ConfigError: only contract violations were found.
        ModelLoadError: some file failed to import (contract violations listed too).
    """
    models: list[Model] = []
    broken: list[str] = []
    failed_import = False
    for entry in entries:
        for version in entry.versions:
            try:
                models.append(load_model_code(entry, version))
            except ConfigError as exc:
                broken.extend(exc.errors)
            except ModelLoadError as exc:
                broken.append(str(exc))
                failed_import = True
    if failed_import:
        raise ModelLoadError("\n".join(broken))
    if broken:
        raise ConfigError(broken)
    return models
