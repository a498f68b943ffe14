"""What `tune` writes: ``results.json`` (after every candidate), and at the end
``report.md``, two plots and ``repository/`` (the best configuration, ready to serve).

How this works. `write_results` dumps every measurement as it stands. `write_report` adds the
report: the finalists side by side (each final round, and their means), every candidate's
best point under the constraints, and the plots, drawn with matplotlib when it is installed
(``pip install 'orchestrion[tune]'``; without it the report says so and has its tables):
``throughput_vs_p99.png`` (every point the search measured, the Pareto front marked: the
points no other point beats on both throughput and p99) and
``throughput_vs_concurrency.png`` (the finalists' means over the final rounds; without final
rounds, the search's three best and the configuration as it is). ``repository/`` is a copy
of the pipeline's model folders in which only the configs the winner changes are rewritten,
each with comment lines saying what tune measured.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from ._knobs import Candidate, Pipeline, config_texts, label, show, write_repository
from ._measure import Point
from ._search import CandidateResult, Constraints, SearchOutcome, Status

RESULTS = "results.json"
REPORT = "report.md"
REPOSITORY = "repository"
SCATTER = "throughput_vs_p99.png"
LINES = "throughput_vs_concurrency.png"


def write_results(
    output: Path,
    pipeline: Pipeline,
    summary: Mapping[str, Any],
    constraints: Constraints,
    outcome: SearchOutcome,
    started: float,
) -> None:
    """Write ``results.json``: the settings (``summary``) and every candidate measured so
    far, judged by ``constraints``."""
    document = {
        "model": pipeline.model,
        "model_repository": str(pipeline.root),
        "started": _when(started),
        "machine": _machine(),
        "settings": dict(summary),
        "candidates": [_result(r, constraints) for r in outcome.results],
        "winner": {k: v for k, v in outcome.winner.items()},
        "reason": outcome.reason,
        "final_rounds": outcome.final_rounds,
        "budget_ran_out": outcome.budget_ran_out,
        "interrupted": outcome.interrupted,
    }
    temporary = output / f".{RESULTS}.partial"
    temporary.write_text(json.dumps(document, indent=2) + "\n")
    temporary.replace(output / RESULTS)


def _result(result: CandidateResult, constraints: Constraints) -> dict[str, Any]:
    best = result.best(constraints)
    return {
        "index": result.index,
        "label": result.label,
        "changes": dict(result.candidate),
        "role": result.role,
        "final_round": result.final_round,
        "status": result.status.value,
        "error": result.error,
        "load_s": round(result.load_s, 3),
        "seconds": round(result.seconds, 3),
        "memory_bytes": result.memory,
        "device_memory_bytes": result.device_memory,
        "best_concurrency": None if best is None else best.concurrency,
        "points": [_finite(attrs.asdict(p)) for p in result.points],
    }


def _finite(values: dict[str, Any]) -> dict[str, Any]:
    """JSON has no infinity: a point with no answered request has no latency (null)."""
    return {
        k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in values.items()
    }


def _when(timestamp: float) -> str:
    return datetime.datetime.fromtimestamp(timestamp, datetime.UTC).isoformat(timespec="seconds")


def _machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()}"


def write_report(
    output: Path,
    pipeline: Pipeline,
    summary: Mapping[str, Any],
    constraints: Constraints,
    outcome: SearchOutcome,
    started: float,
) -> Path:
    """Write everything (see the module's docstring); the best repository's folder."""
    write_results(output, pipeline, summary, constraints, outcome, started)
    plotted = _plots(output, outcome, constraints)
    repository = output / REPOSITORY
    texts = config_texts(pipeline, outcome.winner)
    notes = _notes(pipeline, outcome, constraints, output)
    write_repository(pipeline, texts, repository, notes)
    lines = _report_lines(pipeline, summary, outcome, constraints, started, plotted)
    (output / REPORT).write_text("\n".join(lines) + "\n")
    return repository


@attrs.frozen
class Finalist:
    """A finalist's measurements in the final rounds, side by side with the others'."""

    candidate: Candidate
    rounds: tuple[CandidateResult, ...]

    def points(self, constraints: Constraints) -> list[Point | None]:
        """Its best point in each round."""
        return [r.best(constraints) for r in self.rounds]

    def mean(self, constraints: Constraints, field: str) -> float | None:
        """The mean of ``field`` over its rounds' best points (None: a round met nothing)."""
        points = self.points(constraints)
        if not points or any(p is None for p in points):
            return None
        return sum(float(getattr(p, field)) for p in points) / len(points)


def finalists(outcome: SearchOutcome) -> list[Finalist]:
    """The final rounds by finalist (the configuration as it is first); none: there were
    no complete rounds."""
    by_candidate: dict[str, list[CandidateResult]] = {}
    for result in outcome.results:
        if result.role == "final" and result.final_round <= outcome.final_rounds:
            by_candidate.setdefault(result.label, []).append(result)
    rounds = outcome.final_rounds
    if not rounds:
        return []
    found = [Finalist(v[0].candidate, tuple(v)) for v in by_candidate.values()]
    return sorted(found, key=lambda f: bool(f.candidate))


def _notes(
    pipeline: Pipeline, outcome: SearchOutcome, constraints: Constraints, output: Path
) -> dict[str, list[str]]:
    day = datetime.date.today().isoformat()
    measured = []
    for finalist in finalists(outcome):
        if dict(finalist.candidate) in ({}, dict(outcome.winner)):
            name = "this configuration" if finalist.candidate else "as configured"
            measured.append(f"{name}: {_mean_words(finalist, constraints)}")
    notes: dict[str, list[str]] = {}
    for key, value in outcome.winner.items():
        model, _, knob = key.rpartition(".")
        lines = notes.setdefault(model, [f"orchestrion tune, {day}: {pipeline.model}"])
        lines.append(f"changed: {knob} = {show(value)}")
    for lines in notes.values():
        lines.extend(f"measured, {words}" for words in sorted(measured, reverse=True))
        lines.append(f"report: {output / REPORT}")
    return notes


def _mean_words(finalist: Finalist, constraints: Constraints) -> str:
    rate = finalist.mean(constraints, "throughput")
    p99 = finalist.mean(constraints, "p99_ms")
    rounds = len(finalist.rounds)
    if rate is None or p99 is None:
        return "no point met the constraints in every final round"
    over = "one final round" if rounds == 1 else f"the mean of {rounds} final rounds"
    return f"{rate:.1f} infer/s, p99 {p99:.2f} ms ({over})"


def _point_words(point: Point) -> str:
    return (
        f"{point.throughput:.1f} infer/s, p99 {point.p99_ms:.2f} ms at concurrency "
        f"{point.concurrency}"
    )


def _report_lines(
    pipeline: Pipeline,
    summary: Mapping[str, Any],
    outcome: SearchOutcome,
    constraints: Constraints,
    started: float,
    plotted: str,
) -> list[str]:
    lines = [
        f"# orchestrion tune: {pipeline.model}",
        "",
        f"- repository: `{pipeline.root}`; started {_when(started)}; machine: {_machine()}",
        "- " + "; ".join(f"{k}: {_plain(v)}" for k, v in summary.items()),
        f"- candidates the search measured: "
        f"{sum(r.role == 'search' for r in outcome.results)} (it planned "
        f"{outcome.planned}{_again(summary)})",
    ]
    if outcome.budget_ran_out:
        lines.append("- **the budget ran out**: the search stopped early (see the candidates)")
    if outcome.interrupted:
        lines.append("- **interrupted** (Ctrl-C): this report shows what ran")
    lines += ["", "## Result", "", f"**{label(outcome.winner)}**: {outcome.reason}.", ""]
    lines += _side_by_side_table(outcome, constraints)
    lines += ["", "## Every candidate", ""]
    lines += _candidates_table(outcome.results, constraints)
    lines += ["", "## Plots", "", plotted, "", *how_to_read(constraints.improvement)]
    return lines


def _again(summary: Mapping[str, Any]) -> str:
    return ", and passes again while one improves" if summary["search"] == "quick" else ""


def _plain(value: Any) -> str:
    if isinstance(value, list):
        return ", ".join(str(v) for v in value)
    return "none" if value is None else str(value)


def _side_by_side_table(outcome: SearchOutcome, constraints: Constraints) -> list[str]:
    shown = finalists(outcome)
    if not shown:
        return ["(no complete final round: the search's measurements are below)"]
    rounds = len(shown[0].rounds)
    lines = [
        "The finalists, measured again in turn in each final round, under the same load "
        "(each round's throughput at its best point):",
        "",
        "| finalist | mean throughput (infer/s) | mean p99 (ms) | "
        + " | ".join(f"round {n}" for n in range(1, rounds + 1))
        + " | memory (MiB) |",
        "|---|---:|---:|" + "---:|" * rounds + "---:|",
    ]
    for finalist in shown:
        rate = finalist.mean(constraints, "throughput")
        p99 = finalist.mean(constraints, "p99_ms")
        cells = [
            "-" if p is None else f"{p.throughput:.1f} (c={p.concurrency})"
            for p in finalist.points(constraints)
        ]
        name = label(finalist.candidate)
        if finalist.candidate and dict(finalist.candidate) == dict(outcome.winner):
            name = f"**{name}** (winner)"
        lines.append(
            f"| {name} | {'-' if rate is None else f'{rate:.1f}'} | "
            f"{'-' if p99 is None else f'{p99:.2f}'} | {' | '.join(cells)} | "
            f"{_mib(finalist.rounds[-1].memory)} |"
        )
    return lines


def _candidates_table(results: Sequence[CandidateResult], constraints: Constraints) -> list[str]:
    lines = [
        "| # | configuration | role | status | best concurrency | throughput (infer/s) | "
        "p99 (ms) | memory (MiB) | load (s) |",
        "|---:|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for result in results:
        point = result.best(constraints)
        status = result.status.value
        if result.error:
            status += f": {result.error}".replace("|", "\\|").replace("\n", " ")
        elif result.status is Status.MEASURED and point is None:
            status += " (no point meets the constraints)"
        cells = (
            ("-", "-", "-")
            if point is None
            else (str(point.concurrency), f"{point.throughput:.1f}", f"{point.p99_ms:.2f}")
        )
        role = f"final round {result.final_round}" if result.role == "final" else "search"
        lines.append(
            f"| {result.index} | {result.label} | {role} | {status} | "
            f"{' | '.join(cells)} | {_mib(result.memory)} | {result.load_s:.1f} |"
        )
    return lines


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:.0f}"


def how_to_read(improvement: float) -> list[str]:
    """The report's last section, for a search that keeps changes ``improvement`` better."""
    better = f"more than {improvement:.0%} better"
    return [
        "## How to read this",
        "",
        "- Each candidate was loaded in a server of its own and driven at each concurrency by "
        "that many clients, each sending its next request when the last was answered. The "
        "first window of each concurrency is warm-up; a point is stable when the last three "
        "windows' throughput and mean latency are within the stability bound of their mean.",
        "- A candidate's *best point* is its highest throughput (objective throughput) or "
        "lowest p99 (objective latency) among its points with no failed request and within "
        "the p99 limit; a candidate over the memory limit has none.",
        f"- The search keeps a change only when it measures {better} than the best so far. "
        "Its best two candidates and the configuration as it is are then measured again in "
        "turn, in up to three final rounds; a finalist wins only if its mean over those rounds "
        f"is {better} than the configuration as it is. Compare candidates by the final "
        "rounds: two measurements of one configuration on a shared machine often differ by "
        "10% or more.",
        "- `repository/` holds the pipeline's model folders with the winner's configs; each "
        "changed `config.pbtxt` says in its first comment lines what was changed and measured.",
    ]


def _plots(output: Path, outcome: SearchOutcome, constraints: Constraints) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "(no plots: matplotlib is not installed; `pip install 'orchestrion[tune]'`)"
    measured = [r for r in outcome.results if r.points and r.role == "search"]
    if not measured:
        return "(no plots: no candidate was measured)"
    _scatter(plt, output / SCATTER, measured, outcome.winner)
    _lines(plt, output / LINES, outcome, constraints)
    return f"![throughput against p99]({SCATTER})\n\n![throughput against concurrency]({LINES})"


def pareto(points: Sequence[Point]) -> list[Point]:
    """The points no other point beats on both throughput and p99, by p99."""
    front: list[Point] = []
    for point in sorted(points, key=lambda p: (p.p99_ms, -p.throughput)):
        if not front or point.throughput > front[-1].throughput:
            front.append(point)
    return front


def _scatter(plt: Any, path: Path, results: Sequence[CandidateResult], winner: Candidate) -> None:
    figure, axes = plt.subplots(figsize=(8, 5.5))
    every = [p for r in results for p in r.points if p.requests]
    for result in results:
        points = [p for p in result.points if p.requests]
        style = {"color": "0.7", "s": 18, "zorder": 1}
        name = None
        if not result.candidate:
            style, name = {"color": "tab:blue", "s": 40, "zorder": 3}, "as configured"
        elif dict(result.candidate) == dict(winner):
            style, name = {"color": "tab:green", "s": 50, "zorder": 4}, "winner"
        axes.scatter(
            [p.p99_ms for p in points], [p.throughput for p in points], label=name, **style
        )
    front = pareto(every)
    axes.plot(
        [p.p99_ms for p in front],
        [p.throughput for p in front],
        color="tab:red",
        marker="o",
        fillstyle="none",
        label="Pareto front",
        zorder=2,
    )
    axes.set_xlabel("p99 latency (ms)")
    axes.set_ylabel("throughput (infer/s)")
    axes.set_title("every candidate at every concurrency, as the search measured it")
    axes.grid(True, alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _lines(plt: Any, path: Path, outcome: SearchOutcome, constraints: Constraints) -> None:
    """Throughput against concurrency: the finalists' means over the final rounds (measured
    side by side); without final rounds, the search's three best and the configuration."""
    shown = finalists(outcome)
    if shown:
        series = [(f.candidate, _mean_points(f.rounds)) for f in shown]
        title = f"the finalists, mean of {len(shown[0].rounds)} final round(s)"
    else:
        measured = [r for r in outcome.results if r.points and r.role == "search"]
        ranked = sorted(measured, key=lambda r: r.value(constraints), reverse=True)
        picked = ranked[:3] + [r for r in ranked[3:] if not r.candidate]
        series = [(r.candidate, {p.concurrency: p.throughput for p in r.points}) for r in picked]
        title = "the search's three best and the configuration as it is"
    figure, axes = plt.subplots(figsize=(8, 6.5))
    for candidate, rates in series:
        concurrencies = sorted(rates)
        axes.plot(
            concurrencies,
            [rates[c] for c in concurrencies],
            marker="o",
            label=textwrap.fill(label(candidate), 70),
        )
    axes.set_xscale("log", base=2)
    axes.set_xlabel("concurrency (requests in flight)")
    axes.set_ylabel("throughput (infer/s)")
    axes.set_title(title)
    axes.grid(True, alpha=0.3)
    axes.legend(fontsize="x-small", loc="upper center", bbox_to_anchor=(0.5, -0.12))
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _mean_points(results: Sequence[CandidateResult]) -> dict[int, float]:
    """The mean throughput at each concurrency every one of ``results`` measured."""
    rates: dict[int, list[float]] = {}
    for result in results:
        for point in result.points:
            rates.setdefault(point.concurrency, []).append(point.throughput)
    return {c: sum(v) / len(v) for c, v in rates.items() if len(v) == len(results)}
