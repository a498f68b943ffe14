"""The loaded model versions, by name and version: lookup, statistics and revisions.

How this works. `LoadedModels` is the table the registry's parts share: the registry changes
it (a load, a reload or an unload replaces a name's versions and counts one more
`generation`), and the request router and the ensembles read it. What is worked out from the
table is kept until it changes: whether a model streams (`decoupled`; cleared by the registry
when it changes the set) and each runner's revision (valid for one generation).

A revision fingerprints everything that computes a runner's answers: its own code and config,
and for an ensemble each step's model as resolved now, recursively. Response caches key on
it, so a load, reload or unload never lets a cache answer with another revision's result.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from typing import ClassVar, Protocol

import attrs
import xxhash

from ..protocols import (
    CustomMetricFamily,
    InferRequest,
    InferResponse,
    InvalidRequestError,
    ModelConfig,
    ModelNotFoundError,
    ModelStatistics,
    OrchestrionError,
    ParameterValue,
    ServerClosedError,
    StepStatistics,
    TensorChecker,
    Tensors,
    is_decoupled,
)
from ._stats import StatsRecorder


class Runner(Protocol):
    """What the registry needs of a loaded model version."""

    @property
    def config(self) -> ModelConfig: ...

    @property
    def version(self) -> int: ...

    stats: StatsRecorder
    checker: TensorChecker

    @property
    def output_names(self) -> frozenset[str]: ...

    @property
    def labels(self) -> Mapping[str, Sequence[str]]: ...

    async def infer(self, request: InferRequest) -> InferResponse: ...

    def ready_now(self, inputs: Tensors) -> bool: ...

    def infer_now(self, request: InferRequest) -> InferResponse: ...

    def statistics(self) -> ModelStatistics: ...

    def keep_counting(self, recorder: StatsRecorder) -> None: ...

    def response_parameters(self, request: InferRequest) -> Mapping[str, ParameterValue]: ...

    @property
    def revision(self) -> str: ...

    # What differs between a model and an ensemble, asked instead of switched on.

    is_ensemble: ClassVar[bool]

    def responses(self, request: InferRequest) -> AsyncGenerator[InferResponse, None]: ...

    def step_statistics(self) -> tuple[StepStatistics, ...]: ...

    def custom_metrics(self) -> list[CustomMetricFamily]: ...

    @property
    def drained(self) -> bool: ...

    def begin_close(self) -> None: ...

    async def close(self) -> None: ...

    async def passes_own_check(self) -> bool: ...


@attrs.define(eq=False)
class LoadedModels:
    """The runners of the loaded models by name and version, and what follows from them."""

    runners: dict[str, dict[int, Runner]] = attrs.field(factory=dict)
    closing: bool = False
    """The server is shutting down: an unknown name is a `ServerClosedError`."""
    generation: int = 0
    """Counts the changes to the set of loaded runners (a load, a reload, an unload)."""
    listeners: list[Callable[[int], None]] = attrs.field(factory=list)
    """Called with the new generation after each change (`changed`)."""
    _streaming: dict[str, bool] = attrs.field(factory=dict)
    """`decoupled` answers, cleared (`forget_streaming`) whenever the set changes."""
    _revisions: dict[Runner, str] = attrs.field(factory=dict)
    """`revision` of each runner, valid while the generation is `_revisions_at`."""
    _revisions_at: int = -1

    def changed(self) -> None:
        """The set of loaded runners changed: a new generation, told to the listeners."""
        self.generation += 1
        for listener in list(self.listeners):
            listener(self.generation)

    # -- lookup ----------------------------------------------------------------------------

    def __contains__(self, name: object) -> bool:
        """Whether a model ``name`` is loaded."""
        return name in self.runners

    def resolve(self, name: str, version: int = -1) -> Runner:
        """The runner of ``name`` at ``version`` (-1 or 0: the latest loaded).

        Raises:
            ModelNotFoundError: no such model, or no such version loaded.
            ServerClosedError: the server is shutting down.
        """
        versions = self.runners.get(name)
        if not versions:
            if self.closing:
                raise ServerClosedError("the server is shutting down")
            # Triton's words (clients match them); which other models are loaded is not the
            # caller's business (a network client's).
            raise ModelNotFoundError(f"Request for unknown model: '{name}' is not found")
        if version <= 0:
            return versions[max(versions)]
        runner = versions.get(version)
        if runner is None:
            raise ModelNotFoundError(
                f"Request for unknown model: '{name}' version {version} is not found"
            )
        return runner

    def configs(self) -> dict[str, ModelConfig]:
        """The config of each loaded model (its latest version's)."""
        return {n: self.runners[n][max(v)].config for n, v in self.runners.items() if v}

    def decoupled(self, model_name: str) -> bool:
        """Whether ``model_name`` streams: a decoupled model, or an ensemble with one."""
        found = self._streaming.get(model_name)
        if found is None:
            found = self._streaming[model_name] = is_decoupled(model_name, self.configs())
        return found

    def forget_streaming(self) -> None:
        """Forget the `decoupled` answers: the set of loaded models is changing."""
        self._streaming.clear()

    def model_names(self) -> list[str]:
        """Names of the loaded models, sorted."""
        return sorted(self.runners)

    def versions(self, name: str) -> list[int]:
        """Loaded versions of ``name``, ascending (empty if not loaded)."""
        return sorted(self.runners.get(name, {}))

    def is_ensemble(self, name: str) -> bool:
        """Whether a loaded version of ``name`` is an ensemble."""
        versions = self.runners.get(name) or {}
        return any(r.is_ensemble for r in versions.values())

    # -- statistics ------------------------------------------------------------------------

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
        return [r for _, r in sorted(self.runners.get(name, {}).items())]

    def step_statistics(self, ensemble: str) -> tuple[StepStatistics, ...]:
        """Live per-step state of the latest version of an ensemble."""
        runner = self.resolve(ensemble)
        if not runner.is_ensemble:
            raise InvalidRequestError(f"model '{ensemble}' is not an ensemble")
        return runner.step_statistics()

    def custom_metrics(self) -> list[CustomMetricFamily]:
        """The metric families every loaded model version's code made."""
        return [
            family
            for name in self.model_names()
            for runner in self._sorted(name)
            for family in runner.custom_metrics()
        ]

    def all_step_statistics(self) -> list[StepStatistics]:
        """Live per-step state of the latest version of every loaded ensemble."""
        latest = [self._sorted(name)[-1] for name in self.model_names()]
        return [step for runner in latest for step in runner.step_statistics()]

    # -- revisions -------------------------------------------------------------------------

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
