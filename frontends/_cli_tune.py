"""``orchestrion tune``: find the best configuration of a pipeline (see ``orchestrion.tuning``).

How this works: `add_tune_flags` declares the command's flags (perf_analyzer's names where
it has one: ``--measurement-interval``, ``--stability-percentage``, ``--max-trials``);
`tune_command` turns them into `TuneSettings`, runs `tune` under a progress bar (a line per
candidate as it ends) and prints the table of candidates and where the report is. Exit
status: 0, 1 when the configuration as it is could not be measured, 2 for bad flags, 130
when Ctrl-C stopped it (the report of what ran is written).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ..protocols import ConfigError
from ..tuning import (
    CandidateResult,
    Constraints,
    LoadSettings,
    Objective,
    Point,
    Status,
    TuneResult,
    TuneSettings,
    tune,
)

_SIZE = re.compile(r"^(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?$", re.IGNORECASE)


def add_tune_flags(command: argparse.ArgumentParser) -> None:
    """``orchestrion tune``'s flags."""
    add = command.add_argument
    add("--model-repository", required=True, type=Path, metavar="DIR", help="the repository")
    add("--model", required=True, help="the model or ensemble to tune")
    add("--output", required=True, type=Path, metavar="DIR", help="a new folder for the report")
    add(
        "--budget",
        type=float,
        default=120.0,
        metavar="SECONDS",
        help="seconds for it all (default: 120)",
    )
    add(
        "--search",
        choices=("quick", "brute"),
        default="quick",
        help="quick (coordinate descent) or brute (every combination) (default: quick)",
    )
    add(
        "--concurrency",
        default="1,4,16",
        help="concurrencies to measure: a list, or START:END doubling from START (1:16 is "
        "1,2,4,8,16) (default: 1,4,16)",
    )
    add(
        "--objective",
        choices=("throughput", "latency"),
        default="throughput",
        help="maximise throughput, or minimise p99 latency (default: throughput)",
    )
    add("--max-p99-ms", type=float, default=None, metavar="MS", help="p99 latency limit")
    add(
        "--max-memory",
        default=None,
        metavar="SIZE",
        help="resident memory a candidate may add, in process (bytes, or 512MiB, 2GB)",
    )
    add(
        "--knob",
        action="append",
        default=[],
        metavar="MODEL.NAME=V1,V2",
        help="sweep this knob (repeatable) instead of the ones tune finds: instance_count, "
        "execution, max_queue_delay_us, max_inflight_requests, fusion",
    )
    add(
        "--samples",
        type=Path,
        default=None,
        metavar="PATH",
        help="sample requests: an .npz of one request's inputs, or a Python file (or an "
        "example's folder) defining make_inputs(index, rng); default: the example's own, or "
        "random inputs from the config",
    )
    _add_load_flags(command)


def _add_load_flags(command: argparse.ArgumentParser) -> None:
    """The flags of the load: the requests, the windows, where it runs."""
    add = command.add_argument
    add("--batch-size", type=int, default=1, help="rows per generated request (default: 1)")
    add(
        "--shape",
        action="append",
        default=[],
        metavar="NAME:D1,D2",
        help="the shape of an input whose dims are -1, without the batch dimension",
    )
    add(
        "--measurement-interval",
        type=int,
        default=500,
        metavar="MS",
        help="measurement window (default: 500)",
    )
    add(
        "--stability-percentage",
        type=float,
        default=10.0,
        help="a point is stable within this spread (default: 10)",
    )
    add("--max-trials", type=int, default=10, help="windows per concurrency at most (default: 10)")
    add("--seed", type=int, default=0, help="seed of the generated requests (default: 0)")
    add(
        "--url",
        default=None,
        help="measure on a running server instead (grpc://HOST:PORT or http://HOST:PORT; it "
        "must run with --model-control-mode explicit: candidates are loaded through its load "
        "API)",
    )


def tune_settings(args: argparse.Namespace) -> TuneSettings:
    """The `TuneSettings` of ``args``.

    Raises:
        ConfigError: a flag's value is invalid (the flag is named).
    """
    if args.measurement_interval < 10 or args.max_trials < 3:
        raise ConfigError("--measurement-interval must be at least 10 ms, --max-trials at least 3")
    if args.stability_percentage <= 0:
        raise ConfigError("--stability-percentage must be more than 0")
    if args.batch_size < 1:
        raise ConfigError("--batch-size must be at least 1")
    load = LoadSettings(
        concurrency=parse_concurrency(args.concurrency),
        window_s=args.measurement_interval / 1000.0,
        stability=args.stability_percentage / 100.0,
        max_windows=args.max_trials,
    )
    constraints = Constraints(
        objective=Objective(args.objective),
        max_p99_ms=args.max_p99_ms,
        max_memory=None if args.max_memory is None else parse_size(args.max_memory),
    )
    return TuneSettings(
        budget_s=args.budget,
        brute=args.search == "brute",
        load=load,
        constraints=constraints,
        knobs=tuple(args.knob),
        samples=args.samples,
        batch_size=args.batch_size,
        shapes=dict(_shape(text) for text in args.shape),
        seed=args.seed,
        url=args.url,
    )


def parse_concurrency(text: str) -> tuple[int, ...]:
    """``1,4,16`` or ``1:16`` (powers of two from 1 to 16).

    Raises:
        ConfigError: not a list of whole numbers of at least 1.
    """
    try:
        if ":" in text:
            start, _, end = text.partition(":")
            low, high = int(start), int(end)
            values = []
            while 1 <= low <= high:  # doubling from START: bounded once START is 1 or more
                values.append(low)
                low *= 2
        else:
            values = [int(item) for item in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise ConfigError(f"--concurrency {text!r}: expected 1,4,16 or 1:16 (at least 1)")
    return tuple(sorted(set(values)))


def parse_size(text: str) -> int:
    """Bytes from ``1073741824``, ``512MiB``, ``2GB``, ``300M`` (K, M, G, T and KiB, MiB...
    are powers of 1024; KB, MB, GB, TB powers of 1000).

    Raises:
        ConfigError: not a size.
    """
    match = _SIZE.match(text.strip())
    if match is None or float(match.group(1)) <= 0:
        raise ConfigError(
            f"--max-memory {text!r}: expected bytes, or a size such as 512MiB (more than 0)"
        )
    number, unit = float(match.group(1)), (match.group(2) or "B").upper()
    power = "BKMGT".index(unit[0])
    base = 1000 if unit.endswith("B") and "I" not in unit and power else 1024
    return int(number * base**power)


def _shape(text: str) -> tuple[str, tuple[int, ...]]:
    name, colon, dims = text.rpartition(":")
    try:
        shape = tuple(int(d) for d in dims.split(",")) if colon and name else ()
    except ValueError:
        shape = ()
    if not shape or min(shape) < 0:
        raise ConfigError(f"--shape {text!r}: expected NAME:D1,D2 (e.g. INPUT0:3,224,224)")
    return name, shape


def tune_command(args: argparse.Namespace, console: Console) -> int:
    """Run ``orchestrion tune``; its exit status.

    Raises:
        ConfigError: a flag, the repository or the output folder is invalid.
    """
    settings = tune_settings(args)
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    ) as bar:
        shown = _Shown(console, bar, bar.add_task("tuning", total=None))
        result = tune(
            args.model_repository, args.model, output=args.output, settings=settings, progress=shown
        )
    console.print(_table(result, settings.constraints))
    console.print(f"{_outcome_words(result)}", highlight=False, soft_wrap=True)
    console.print(f"report: {result.output / 'report.md'}", highlight=False)
    console.print(f"best configuration: {result.repository}", highlight=False)
    if result.interrupted:
        return 130
    configured = next((r for r in result.results if not r.candidate), None)
    return 0 if configured is not None and configured.status is Status.MEASURED else 1


def _outcome_words(result: TuneResult) -> str:
    winner = ", ".join(f"{k}={v}" for k, v in sorted(result.winner.items())) or "as configured"
    extra = " (the budget ran out)" if result.budget_ran_out else ""
    return f"winner: {winner}: {result.reason}{extra}"


class _Shown:
    """`Progress` on the terminal: the bar, and a line per candidate as it ends."""

    def __init__(self, console: Console, bar: Progress, task: object) -> None:
        self.console, self.bar, self.task = console, bar, task

    def started(self, index: int, label: str, planned: int) -> None:
        total = max(planned, index + 1)
        self.bar.update(self.task, total=total, completed=index, description=f"#{index} {label}")  # type: ignore[arg-type]

    def point(self, point: Point) -> None:
        pass

    def finished(self, result: CandidateResult) -> None:
        best = max(result.points, key=lambda p: p.throughput, default=None)
        words = result.status.value
        if result.error:
            words += f": {result.error}"
        elif best is not None:
            words = (
                f"{best.throughput:.1f} infer/s, p99 {best.p99_ms:.2f} ms at concurrency "
                f"{best.concurrency}"
            )
        role = f" (final round {result.final_round})" if result.role == "final" else ""
        self.console.print(f"#{result.index} {result.label}{role}: {words}", highlight=False)


def _table(result: TuneResult, constraints: Constraints) -> Table:
    table = Table(title=f"orchestrion tune: {len(result.results)} candidates")
    for column in ("#", "configuration", "status", "conc.", "infer/s", "p99 ms", "MiB"):
        table.add_column(
            column, justify="left" if column in ("configuration", "status") else "right"
        )
    for item in result.results:
        point = item.best(constraints)
        status = item.status.value
        if item.role == "final":
            status += f" (final round {item.final_round})"
        memory = "-" if item.memory is None else f"{item.memory / 2**20:.0f}"
        if point is None:
            table.add_row(str(item.index), item.label, status, "-", "-", "-", memory)
        else:
            table.add_row(
                str(item.index),
                item.label,
                status,
                str(point.concurrency),
                f"{point.throughput:.1f}",
                f"{point.p99_ms:.2f}",
                memory,
            )
    return table
