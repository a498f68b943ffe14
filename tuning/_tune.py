"""`tune`: read the pipeline, make its load, search its knobs, write the report and the best
repository.

How this works. `tune_async` reads the model's configs (`read_pipeline`), the knobs
(`discover_knobs`, or the user's ``--knob`` list) and the requests (`request_pool`; an
example's own ``make_inputs`` when the repository is an example's ``models/`` folder). Each
candidate is laid out as a repository of links in a temporary folder the run owns
(`candidate_repository`), opened in this process with only the model and the models it uses
(`open_server` with ``load_models``), measured (`measure`, memory sampled meanwhile), and
closed before the next one loads, so candidates never share a process's models. With
``url`` the candidates are measured on a running server instead (`_remote`). After each
candidate the report folder's ``results.json`` is rewritten, so a run stopped by anything
leaves what it measured. Ctrl-C (SIGINT) stops the search: the report is written from what
ran, and the run ends as interrupted.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import attrs
import trio

from .._server import open_server
from ..protocols import ConfigError, OrchestrionError
from ._knobs import (
    Candidate,
    Knob,
    Pipeline,
    candidate_repository,
    config_texts,
    discover_knobs,
    parse_knob,
    read_pipeline,
)
from ._measure import LoadSettings, Point, measure, request_pool, samples_beside, sampling_memory
from ._remote import RemoteTarget, check_url, measure_remote, open_remote
from ._report import write_report, write_results
from ._search import CandidateResult, Constraints, Hook, SearchOutcome, Status, search

_log = logging.getLogger("orchestrion")


@attrs.frozen(kw_only=True)
class TuneSettings:
    """How `tune` searches, loads and judges (the defaults are ``orchestrion tune``'s)."""

    budget_s: float = 120.0
    """Seconds for the whole search, the final check included."""
    brute: bool = False
    """Measure every combination of the knobs' values, not a quick search."""
    load: LoadSettings = attrs.field(factory=LoadSettings)
    constraints: Constraints = attrs.field(factory=Constraints)
    knobs: tuple[str, ...] = ()
    """``MODEL.NAME=V1,V2`` knobs to sweep instead of the ones `tune` finds."""
    samples: Path | None = None
    """Sample requests: an ``.npz`` of one request's inputs, or a Python file (or an
    example's folder) defining ``make_inputs(index, rng)``. None: an example's own, or
    requests made from the config."""
    batch_size: int = 1
    shapes: Mapping[str, tuple[int, ...]] = attrs.field(factory=dict)
    """Input shapes (without the batch dimension) for dims the config leaves at -1."""
    seed: int = 0
    url: str | None = None
    """Measure on a running server (``grpc://host:port`` or ``http://host:port``) instead
    of in this process; it must run with explicit model control (candidates are loads)."""


class Progress(Protocol):
    """What `tune` reports while it works (the command line draws it)."""

    def started(self, index: int, label: str, planned: int) -> None:
        """Candidate ``index`` (``label``) starts; ``planned``: the search's plan."""

    def point(self, point: Point) -> None:
        """One concurrency of the current candidate was measured."""

    def finished(self, result: CandidateResult) -> None:
        """A candidate ended (measured, failed, cut or cancelled)."""


class _Quiet:
    def started(self, index: int, label: str, planned: int) -> None:
        pass

    def point(self, point: Point) -> None:
        pass

    def finished(self, result: CandidateResult) -> None:
        pass


@attrs.frozen(kw_only=True)
class TuneResult:
    """What a `tune` run measured and wrote."""

    output: Path
    """The report folder: ``report.md``, ``results.json``, the plots, ``repository/``."""
    repository: Path
    """The best configuration, as a ready model repository."""
    winner: Candidate
    """The winning changes (empty: the configuration as it is stays)."""
    reason: str
    results: tuple[CandidateResult, ...]
    budget_ran_out: bool
    interrupted: bool


def tune(
    model_repository: str | Path,
    model: str,
    *,
    output: str | Path,
    settings: TuneSettings | None = None,
    progress: Progress | None = None,
) -> TuneResult:
    """Find the best configuration of ``model`` (and of the models its ensembles use) on
    this machine, and write it to ``output`` with a report (blocking; see `tune_async`).

    Raises:
        ConfigError: the repository, the model, a setting or the output folder is invalid.
    """
    return trio.run(tune_async, Path(model_repository), model, Path(output), settings, progress)


async def tune_async(
    model_repository: Path,
    model: str,
    output: Path,
    settings: TuneSettings | None = None,
    progress: Progress | None = None,
) -> TuneResult:
    """`tune` on the caller's trio loop. The user's repository is only read; ``output``
    must be a new (or empty) folder outside it. Ctrl-C, when this runs in the main
    thread, stops the search and writes the report of what ran.

    Raises:
        ConfigError: the repository, the model, a setting or the output folder is invalid.
    """
    settings = settings or TuneSettings()
    progress = progress or _Quiet()
    _check_numbers(settings)
    pipeline = read_pipeline(model_repository, model)
    _check_output(output, model_repository)
    knobs = _knobs(pipeline, settings.knobs)
    if settings.url:
        check_url(settings.url)  # a wrong URL before anything is written
        if settings.constraints.max_memory is not None:
            raise ConfigError("--max-memory: memory is measured in process only (not with --url)")
    samples = settings.samples or samples_beside(model_repository)
    pool = request_pool(
        pipeline.config,
        samples=samples,
        batch_size=settings.batch_size,
        shapes=settings.shapes,
        seed=settings.seed,
    )
    _make_output(output)
    outcome = SearchOutcome()
    started = time.time()
    summary = settings_summary(settings, samples)

    def begun(result: CandidateResult) -> None:
        progress.started(result.index, result.label, outcome.planned)

    def finished(result: CandidateResult) -> None:
        progress.finished(result)
        write_results(output, pipeline, summary, settings.constraints, outcome, started)

    async with trio.open_nursery() as guard:
        stopped = trio.CancelScope()
        if threading.current_thread() is threading.main_thread():
            await guard.start(_watch_sigint, stopped, outcome)
        with tempfile.TemporaryDirectory(prefix="orchestrion-tune-") as scratch:
            async with contextlib.AsyncExitStack() as stack:
                candidates = _Candidates(pipeline, pool, settings, Path(scratch), progress)
                if settings.url:
                    candidates.target = await stack.enter_async_context(
                        open_remote(settings.url, pipeline)
                    )
                with stopped:
                    await _search_all(candidates, knobs, outcome, begun, finished)
        # A Ctrl-C that came after the search had ended stopped nothing.
        outcome.interrupted = stopped.cancelled_caught
        _after_interrupt(outcome)
        repository = write_report(output, pipeline, summary, settings.constraints, outcome, started)
        guard.cancel_scope.cancel()
    return TuneResult(
        output=output,
        repository=repository,
        winner=outcome.winner,
        reason=outcome.reason,
        results=tuple(outcome.results),
        budget_ran_out=outcome.budget_ran_out,
        interrupted=outcome.interrupted,
    )


async def _search_all(
    candidates: _Candidates,
    knobs: Sequence[Knob],
    outcome: SearchOutcome,
    begun: Hook,
    finished: Hook,
) -> None:
    """The warm-up and the search, within the budget."""
    settings = candidates.settings
    measure_one = candidates.remote if candidates.target is not None else candidates.in_process
    began = trio.current_time()
    if candidates.target is None:
        with trio.move_on_after(settings.budget_s):
            await candidates.warm_up()
    await search(
        knobs,
        measure_one,
        settings.constraints,
        budget_s=settings.budget_s - (trio.current_time() - began),
        brute=settings.brute,
        outcome=outcome,
        started=begun,
        finished=finished,
    )


def _after_interrupt(outcome: SearchOutcome) -> None:
    """What an interrupted run keeps: the choice of the final rounds that completed, or else
    the search's leader (a change that measured more than ``improvement`` better)."""
    if not outcome.interrupted:
        return
    if outcome.final_rounds:
        outcome.reason = f"interrupted (Ctrl-C) in the final rounds; {outcome.reason}"
        return
    outcome.winner = dict(outcome.leader)
    outcome.reason = (
        "interrupted (Ctrl-C) before the final rounds: the search's best so far, unchecked"
        if outcome.winner
        else "interrupted (Ctrl-C): no change had measured better, the configuration stays as it is"
    )


def _check_output(output: Path, root: Path) -> None:
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise ConfigError(f"--output {output}: exists and is not an empty folder")
    resolved, repository = output.resolve(), root.resolve()
    if resolved == repository or repository in resolved.parents:
        raise ConfigError(
            f"--output {output}: inside the model repository {root} (tune never writes there)"
        )


def _check_numbers(settings: TuneSettings) -> None:
    limits = settings.constraints
    if not (math.isfinite(settings.budget_s) and settings.budget_s > 0):
        raise ConfigError(f"--budget {settings.budget_s}: must be a number of seconds over 0")
    if limits.max_p99_ms is not None and not (
        math.isfinite(limits.max_p99_ms) and limits.max_p99_ms > 0
    ):
        raise ConfigError(f"--max-p99-ms {limits.max_p99_ms}: must be a number over 0")
    if limits.max_memory is not None and limits.max_memory <= 0:
        raise ConfigError(f"--max-memory {limits.max_memory}: must be over 0 bytes")


def _make_output(output: Path) -> None:
    output.mkdir(parents=True, exist_ok=True)


def _knobs(pipeline: Pipeline, texts: Sequence[str]) -> list[Knob]:
    if not texts:
        return discover_knobs(pipeline)
    knobs = [parse_knob(text, pipeline) for text in texts]
    keys = [knob.key for knob in knobs]
    twice = sorted({key for key in keys if keys.count(key) > 1})
    if twice:
        raise ConfigError(f"--knob: {', '.join(twice)} given more than once")
    return knobs


async def _watch_sigint(
    stopped: trio.CancelScope,
    outcome: SearchOutcome,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """The first Ctrl-C (SIGINT) stops the search (``stopped``); the report of what ran is
    then written. A second one while that happens interrupts it (KeyboardInterrupt):
    ``results.json`` already holds every candidate that ran."""
    with trio.open_signal_receiver(signal.SIGINT) as signals:
        task_status.started()
        async for _ in signals:
            if outcome.interrupted:
                raise KeyboardInterrupt
            outcome.interrupted = True
            stopped.cancel()


def settings_summary(settings: TuneSettings, samples: Path | None) -> dict[str, Any]:
    """The settings as the report writes them."""
    constraints = settings.constraints
    return {
        "budget_s": settings.budget_s,
        "search": "brute force" if settings.brute else "quick",
        "concurrency": list(settings.load.concurrency),
        "window_s": settings.load.window_s,
        "stability": settings.load.stability,
        "max_windows": settings.load.max_windows,
        "objective": constraints.objective.value,
        "max_p99_ms": constraints.max_p99_ms,
        "max_memory": constraints.max_memory,
        "improvement": constraints.improvement,
        "requests": str(samples) if samples else "generated from the config",
        "batch_size": settings.batch_size,
        "url": settings.url,
    }


@attrs.define
class _Candidates:
    """Loads and measures candidates: in this process, or on a running server."""

    pipeline: Pipeline
    pool: list[dict[str, Any]]
    settings: TuneSettings
    scratch: Path
    progress: Progress
    target: RemoteTarget | None = None
    """The server measured with ``url`` (None: candidates run in this process)."""

    async def warm_up(self) -> None:
        """Open the configuration as it is once, unmeasured, and send each request once: the
        process's one-time costs (JAX's runtime, imports, caches) then count against no
        candidate's memory or load time. The model's own errors are logged and left for the
        measurement to report; any other error is raised."""
        folder = candidate_repository(self.pipeline, {}, self.scratch / "warm-up")
        try:
            async with open_server(folder, load_models=[self.pipeline.model]) as server:
                for inputs in self.pool:
                    await server.infer(self.pipeline.model, inputs)
        except (OrchestrionError, ExceptionGroup) as exc:
            # Not fatal: the measurement of the configuration as it is reports it.
            _log.warning("tune: warming up failed: %s", failure(exc))

    async def in_process(self, result: CandidateResult) -> None:
        """Open ``result``'s candidate in a server of its own, measure it, close it."""
        pipeline = self.pipeline
        texts = config_texts(pipeline, result.candidate)
        folder = candidate_repository(pipeline, texts, self.scratch / f"candidate-{result.index}")
        gc.collect()  # the previous candidate's arrays, before the baseline is read
        async with sampling_memory() as memory:
            started = time.perf_counter()
            try:
                async with open_server(folder, load_models=[pipeline.model]) as server:
                    result.load_s = time.perf_counter() - started

                    async def call(inputs: Mapping[str, Any]) -> object:
                        return await server.infer(pipeline.model, inputs)

                    await measure(call, self.pool, self.settings.load, self._point(result))
            except (OrchestrionError, ExceptionGroup) as exc:
                result.status, result.error = Status.FAILED, failure(exc)
            finally:
                result.memory, result.device_memory = memory.memory, memory.device_memory

    def _point(self, result: CandidateResult) -> Callable[[Point], None]:
        def measured(point: Point) -> None:
            result.points.append(point)
            self.progress.point(point)

        return measured

    async def remote(self, result: CandidateResult) -> None:
        """Load ``result``'s candidate on the server at ``url`` and measure it there."""
        assert self.target is not None
        texts = config_texts(self.pipeline, result.candidate)
        await measure_remote(
            self.target, texts, self.pool, self.settings.load, result, self._point(result)
        )


def failure(exc: BaseException) -> str:
    """The words of a candidate's failure: the first `OrchestrionError` in ``exc`` (any
    other error is raised again: it is not the candidate's)."""
    if isinstance(exc, BaseExceptionGroup):
        matched, rest = exc.split(OrchestrionError)
        if rest is not None:
            raise rest
        assert matched is not None
        leaf: BaseException = matched
        while isinstance(leaf, BaseExceptionGroup):
            leaf = leaf.exceptions[0]
        return str(leaf)
    return str(exc)
