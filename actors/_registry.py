"""The set of loaded models: loading, unloading and the ensembles that depend on a model.

How this works: every loaded model version has a runner (`ModelRunner` for Python/JAX
models, `EnsembleRunner` for ensembles) whose actors live in the registry's nursery. Loading
validates the *whole* resulting set of models at once (so an ensemble can never point at a
model that is not there), prepares and compiles new runners concurrently, and only then makes
them visible; a failed load changes nothing. Unloading stops the outermost ensembles first: an
ensemble refuses new requests and waits for its running ones, whose steps still need the
models it uses, and until then it counts as one of their dependents.

`ModelRegistry` is a composition: the table of loaded runners with their statistics and
revisions (`LoadedModels`), the routing of requests to them with the response cache
(`RequestRouter`, also the `Router` of every ensemble's steps) and the reading of a
repository folder (`read_repository`) live in modules of their own; the registry changes the
table and answers for all of them.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Callable, Iterable, Mapping, Sequence
from pathlib import Path

import attrs
import trio

from ..backends import check_model, forget_model
from ..caches import CacheActor
from ..protocols import (
    ConfigError,
    CustomMetricFamily,
    InferRequest,
    InferResponse,
    Model,
    ModelLoadError,
    ModelStatistics,
    Observer,
    OrchestrionError,
    ServerClosedError,
    StepStatistics,
    leaf_errors,
    validate_repository,
)
from ..repository import AUTO_COMPLETE, ConfigReading, read_repository
from ..telemetry import RequestTracing
from ._ensemble import EnsembleRunner
from ._executor import Executor
from ._load_lock import LoadLock
from ._loaded_models import LoadedModels, Runner
from ._request_router import ModelControlCalls, RequestRouter, caches
from ._runner import ModelRunner
from ._stats import StatsRecorder


def _keep_counting(old: StatsRecorder, runner: Runner) -> None:
    """A reloaded version keeps counting where the old one is (Prometheus counters never go
    backwards); the old runner's last requests still count on the same recorder."""
    old.load_ns = runner.stats.load_ns
    old.cache_enabled = runner.stats.cache_enabled
    old.is_ensemble = runner.stats.is_ensemble
    runner.keep_counting(old)


def _single_error(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """Turn a loader nursery's exception group into the one error a user should see."""
    leaves = leaf_errors(group)
    if not all(isinstance(e, OrchestrionError) for e in leaves):
        return group
    if len(leaves) == 1:
        return leaves[0]
    if all(isinstance(e, ConfigError) for e in leaves):
        return ConfigError([line for e in leaves for line in e.errors])  # type: ignore[attr-defined]
    return ModelLoadError("\n".join(str(e) for e in leaves))


@attrs.define(eq=False)
@attrs.define(eq=False)
class ModelRegistry:
    """Loaded models by name and version, with the nursery their actors live in."""

    nursery: trio.Nursery
    observer: Observer | None
    """Receives runtime events; None when nobody listens (the hot path skips the calls)."""
    repository: Path | None = None
    config_reading: ConfigReading = AUTO_COMPLETE
    """How the repository's configs are found and completed."""
    cache: CacheActor | None = None
    """The server's response cache; None when the server has none."""
    tracing: RequestTracing | None = None
    """Spans of every request; None when the server does not trace."""
    _models: LoadedModels = attrs.field(init=False, factory=LoadedModels)
    _router: RequestRouter = attrs.field(init=False)
    _lock: LoadLock = attrs.field(factory=LoadLock)
    statistics_sources: list[Callable[[], None]] = attrs.field(factory=list, init=False)
    """Called before statistics are read, to bring in counts kept elsewhere (the hits of
    the native front end's cache tier)."""
    _draining: list[Runner] = attrs.field(factory=list)
    """Unloaded (or replaced) ensembles whose running requests have not all finished."""

    def __attrs_post_init__(self) -> None:
        self._router = RequestRouter(self._models, self.observer, self.cache, self.tracing)

    @property
    def generation(self) -> int:
        """Counts the changes to the set of loaded runners (a load, a reload, an unload)."""
        return self._models.generation

    @property
    def models_listeners(self) -> list[Callable[[int], None]]:
        """Called with the new `generation` after each change."""
        return self._models.listeners

    # -- lookup (`LoadedModels`) -----------------------------------------------------------

    def use_model_control(self, control: ModelControlCalls | None) -> None:
        """Where the models' own ``pb_utils.load_model`` / ``unload_model`` go (the
        served repository's model control; None: refused)."""
        self._router.control = control

    def resolve(self, name: str, version: int = -1) -> Runner:
        """The runner of ``name`` at ``version`` (-1 or 0: the latest loaded).

        Raises:
            ModelNotFoundError: no such model, or no such version loaded.
            ServerClosedError: the server is shutting down.
        """
        return self._models.resolve(name, version)

    def is_ready(self, name: str, version: int = -1) -> bool:
        """Whether ``name`` (at ``version``) is loaded and serving."""
        return self._router.is_ready(name, version)

    async def passes_readiness(self, name: str, version: int = -1) -> bool:
        """`is_ready`, and the model's code's own check passes (`Backend.ready`: a
        python-backend model's ``is_ready()``); an ensemble is ready when loaded."""
        if not self._router.is_ready(name, version):
            return False
        return await self._models.resolve(name, version).passes_own_check()

    def revision(self, runner: Runner) -> str:
        """The fingerprint of everything that computes ``runner``'s answers (see
        `LoadedModels.revision`)."""
        return self._models.revision(runner)

    def model_names(self) -> list[str]:
        """Names of the loaded models, sorted."""
        return self._models.model_names()

    def versions(self, name: str) -> list[int]:
        """Loaded versions of ``name``, ascending (empty if not loaded)."""
        return self._models.versions(name)

    def statistics(
        self, name: str | None = None, version: int | None = None
    ) -> list[ModelStatistics]:
        """Statistics of every loaded version of every model, of ``name``, or of one version.

        Raises:
            ModelNotFoundError: ``name`` (or that version of it) is not loaded.
        """
        self.gather_statistics()
        return self._models.statistics(name, version)

    def gather_statistics(self) -> None:
        """Run the `statistics_sources`: counts kept elsewhere join the models' own."""
        for source in list(self.statistics_sources):
            source()

    def count_cache_hits(
        self, name: str, version: int, count: int, duration_ns: int, lookup_ns: int
    ) -> None:
        """Count ``count`` requests answered from a cache tier outside the server (the
        native front end's) as cache hits of ``name`` at ``version``: successes, not
        inferences, as Triton counts its cache hits. A model since unloaded is skipped."""
        runner = self._models.runners.get(name, {}).get(version)
        if runner is None:
            return
        runner.stats.cached_answers(count, duration_ns, lookup_ns)
        if self.cache is not None:
            self.cache.count_hits(count)

    def step_statistics(self, ensemble: str) -> tuple[StepStatistics, ...]:
        """Live per-step state of the latest version of an ensemble."""
        return self._models.step_statistics(ensemble)

    def all_step_statistics(self) -> list[StepStatistics]:
        """Live per-step state of the latest version of every loaded ensemble."""
        return self._models.all_step_statistics()

    def custom_metrics(self) -> list[CustomMetricFamily]:
        """The metric families the loaded models' code made (python-backend models)."""
        return self._models.custom_metrics()

    def decoupled(self, model_name: str) -> bool:
        """Whether ``model_name`` streams: a decoupled model, or an ensemble with one."""
        return self._models.decoupled(model_name)

    # -- requests (`RequestRouter`) --------------------------------------------------------

    async def infer(self, request: InferRequest, *, from_ensemble: bool = False) -> InferResponse:
        """Check ``request`` against its model's config and run it (`RequestRouter.infer`).

        Raises:
            ModelNotFoundError: unknown model or version.
            InvalidRequestError: bad inputs or requested outputs (nothing ran).
            InferenceError: the model or a step of the ensemble failed.
        """
        return await self._router.infer(request, from_ensemble=from_ensemble)

    def stream_infer(self, request: InferRequest) -> AsyncGenerator[InferResponse, None]:
        """The responses of a decoupled model to ``request``, as they come (a model that is
        not decoupled gives its one response; `RequestRouter.stream_infer`).

        Raises:
            the errors of `infer`, after the responses sent before the failure.
        """
        return self._router.stream_infer(request)

    def ready_now(self, request: InferRequest) -> bool:
        """Whether `infer_now` would run ``request`` without waiting."""
        return self._router.ready_now(request)

    def infer_now(self, request: InferRequest) -> InferResponse:
        """`infer` of an ensemble step whose model `ready_now` said can run at once, in the
        caller's task.

        Raises:
            the errors of `infer`.
        """
        return self._router.infer_now(request)

    def fusable(self, runner: object, max_batch_size: int) -> Executor | None:
        """The executor an ensemble's fused call runs ``runner``'s model by (see `Fusion`);
        None: the scheduler runs it."""
        return self._router.fusable(runner, max_batch_size)

    # -- loading ---------------------------------------------------------------------------

    async def load(self, models: Sequence[Model], *, replace: bool = True) -> None:
        """Load ``models`` (several versions of one name allowed) next to what is loaded.

        The resulting set is validated as a whole; new runners are compiled concurrently
        and become visible together. A name already loaded is replaced (its old versions
        are unloaded once the new ones are ready).

        Raises:
            ConfigError: the set would be invalid (every problem listed).
            ModelLoadError: a model's code failed to load or compile.
        """
        try:
            async with self._lock.hold():
                if self._models.closing:
                    raise ServerClosedError("the server is shutting down")
                await self._load_locked(models, replace=replace)
        except BaseException:
            for model in models:  # none of them serves: code files leave sys.modules
                forget_model(model)
            raise

    async def _load_locked(self, models: Sequence[Model], *, replace: bool) -> None:
        new = self._checked(models, replace=replace)
        started = await self._start(new)
        old = {name: self._models.runners.get(name, {}) for name in started}
        for name, runners in started.items():
            for version, fresh in runners.items():
                replaced = old[name].get(version)
                if replaced is not None:
                    _keep_counting(replaced.stats, fresh)
            self._models.runners[name] = runners
        self._models.changed()
        self._models.forget_streaming()
        await self._close_runners(old)

    def _checked(self, models: Sequence[Model], *, replace: bool) -> dict[str, dict[int, Model]]:
        """``models`` by name and version, once the set they would make is validated.

        Raises:
            ConfigError: the set would be invalid (every problem listed).
        """
        new: dict[str, dict[int, Model]] = {}
        errors: list[str] = []
        for model in models:
            errors.extend(check_model(model))
            if model.version in new.setdefault(model.name, {}):
                errors.append(f"model '{model.name}' version {model.version} is defined twice")
            new[model.name][model.version] = model
            if not replace and model.name in self._models.runners:
                errors.append(f"model '{model.name}' is already loaded")
        configs = self._models.configs()
        versions: dict[str, Iterable[int]] = {n: list(v) for n, v in self._models.runners.items()}
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
        return new

    async def _start(self, new: dict[str, dict[int, Model]]) -> dict[str, dict[int, Runner]]:
        """Start a runner for each of ``new`` (the models concurrently, then the ensembles
        that use them); on failure, stop the ones started.

        Raises:
            ModelLoadError: a model's code failed to load or compile.
        """
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
                    runner = ModelRunner(model, self.observer, self.tracing, self._router)
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
                    model.config,
                    model.version,
                    self._router,
                    self.observer,
                    revision=model.revision,
                    labels=model.labels,
                    files=model.constants,
                )
                await start(ensemble, ensemble.serve)
        except BaseException:  # cancelled while starting: stop what was started
            await self._close_runners(started)
            raise
        return started

    def _loaded(self, runner: Runner, load_ns: int) -> None:
        stats = runner.stats
        stats.load_ns = load_ns
        stats.is_ensemble = runner.is_ensemble
        stats.cache_enabled = self.cache is not None and caches(runner.config)

    async def _close_runners(self, runners: Mapping[str, Mapping[int, Runner]]) -> None:
        """Stop ``runners``: all refuse new work at once, then wait for running requests.

        Stopping happens even if the wait is cancelled: the last request out closes the door.
        """
        every = [r for versions in runners.values() for r in versions.values()]
        for runner in every:
            runner.begin_close()
            if not runner.drained:  # an ensemble's runs still use its models (`_uses`)
                self._draining.append(runner)
        for runner in every:
            await runner.close()

    def _uses(self) -> dict[str, set[str]]:
        """For each loaded or still draining ensemble, the models its steps use."""
        self._draining = [r for r in self._draining if not r.drained]
        configs = [*self._models.configs().values(), *(r.config for r in self._draining)]
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
        async with self._lock.hold():
            self._models.resolve(name)
            users = self.dependents(name)
            if users and not unload_dependents:
                raise ConfigError(
                    f"model '{name}' is used by ensembles {', '.join(sorted(users))}; unload "
                    "them first or pass unload_dependents=True"
                )
            self._models.forget_streaming()
            for victim in [*users, name]:  # outermost first: inner ones still serve them
                runners = self._models.runners.pop(victim, {})
                self._models.changed()
                await self._close_runners({victim: runners})
                for draining in [r for r in self._draining if r.config.name == victim]:
                    await draining.close()  # left draining by an earlier, cancelled unload

    async def close(self) -> None:
        """Unload everything: ensembles first, outermost first, then the models they use."""
        async with self._lock.hold():
            self._models.closing = True
            for draining in list(self._draining):  # unloaded earlier, still finishing runs
                await draining.close()
            ensembles = {n for n in self._models.runners if self._models.is_ensemble(n)}
            # Each ensemble refuses new requests and waits for its runs, whose steps still
            # need what it uses: inner ensembles and models go only afterwards.
            for name in self._outermost_first(ensembles, self._uses()):
                await self._close_runners({name: self._models.runners[name]})
            models, self._models.runners = self._models.runners, {}
            self._models.changed()
            await self._close_runners({n: r for n, r in models.items() if n not in ensembles})

    def abort(self) -> None:
        """The server is stopping by an error: answer nothing more (the actors are being
        cancelled by their nursery; open streams fail at their next step)."""
        self._models.closing = True
        for versions in self._models.runners.values():
            for runner in versions.values():
                if not runner.is_ensemble:  # an ensemble's actors end with their nursery
                    runner.begin_close()
        self._models.runners = {}
        self._models.changed()

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
        return await read_repository(
            self.repository, names, self._models, reading=self.config_reading
        )
