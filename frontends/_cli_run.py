"""``orchestrion run``: load an example pipeline, drive it with requests, summarise the run.

How this works: `add_run_flags` declares the command's flags; `run_command` checks them,
opens the example's repository in process (`open_server`, with `DEFAULT_CACHE` unless told
otherwise) and drives it: ``--concurrency`` client tasks share one iterator of request
indices (`_drive`), each timing its requests (a decoupled model's responses are streamed
and counted, with the peak of intermediates in flight per step), under a progress bar.
`_summary` then prints the latency and throughput table, the executions per model and the
cache's statistics. Failed requests (an `OrchestrionError`, or the example's check
failing) are counted and listed, not raised: the command exits 1 if any did.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import time
from collections.abc import Mapping
from typing import Any

import attrs
import numpy as np
import trio
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from .._server import AsyncServer, open_server
from ..protocols import OrchestrionError, read_control
from ._cli_flags import add_server_flags, cache_settings
from ._examples import Example, load_example
from ._serve import LOOPBACK

DEFAULT_CACHE = ("local,size=268435456",)
"""The embedded default of `orchestrion run`: a 256 MiB local cache (`serve`'s is
`ServeOptions`': none, as Triton)."""


def add_run_flags(command: argparse.ArgumentParser) -> None:
    """``orchestrion run``'s flags: the example, the load, and the shared server flags."""
    command.add_argument("example", help="a folder under examples/ (image_pipeline) or a path")
    command.add_argument(
        "-n", "--requests", type=int, help="number of requests (default: the example's)"
    )
    command.add_argument(
        "-c", "--concurrency", type=int, help="requests in flight at once (default: the example's)"
    )
    command.add_argument(
        "--seed", type=int, default=0, help="seed of the input generator (default: 0)"
    )
    add_server_flags(command, default_cache=DEFAULT_CACHE, default_metrics_port=None)
    command.add_argument(
        "--linger",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="keep the server (and its metrics endpoint) up this long after the run (default: 0)",
    )


def run_command(args: argparse.Namespace, console: Console) -> int:
    """Run ``args``' example and print its summary; the command's exit status (2: bad
    flags, 1: some requests failed).

    Raises:
        ConfigError: the example, its repository or a flag is invalid.
        ModelLoadError: a model's code failed to load.
        CacheUnavailableError: the cache's backend cannot be reached.
    """
    example = load_example(args.example)
    requests = args.requests if args.requests is not None else example.requests
    concurrency = args.concurrency if args.concurrency is not None else example.concurrency
    if requests < 1 or concurrency < 1:
        console.print("[red]error:[/red] --requests and --concurrency must be >= 1")
        return 2
    if args.linger < 0:
        console.print("[red]error:[/red] --linger must be >= 0")
        return 2
    options = _RunOptions(
        cache=cache_settings(args, console, default=DEFAULT_CACHE),
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host or LOOPBACK,
        tracing=args.trace_config,
        linger=args.linger,
    )
    return trio.run(_run, example, requests, concurrency, args.seed, options, console)


@attrs.frozen
class _RunOptions:
    cache: list[str]
    metrics_port: int | None
    metrics_host: str
    tracing: list[str] | None
    linger: float


async def _run(
    example: Example,
    requests: int,
    concurrency: int,
    seed: int,
    options: _RunOptions,
    console: Console,
) -> int:
    console.print(f"[bold]{example.name}[/bold]: {example.description}", highlight=False)
    started = time.perf_counter()
    async with open_server(
        example.model_repository,
        cache_config=options.cache,
        metrics_port=options.metrics_port,
        metrics_host=options.metrics_host,
        tracing=options.tracing,
    ) as server:
        console.print(
            f"loaded {len(server.model_names())} models in {time.perf_counter() - started:.1f} s"
        )
        if server.metrics_url is not None:
            console.print(f"metrics at {server.metrics_url}", highlight=False)
        counts: dict[str, int] = {}
        peaks: dict[int, int] = {}
        cached = bool(options.cache) and server.model_config(example.model).response_cache
        latencies, errors, wall = await _drive(
            server, example, requests, concurrency, seed, console, counts, peaks
        )
        _summary(server, example, latencies, errors, wall, concurrency, console)
        _control_summary(server, example.model, len(latencies) + len(errors), console)
        if cached and counts.get("distinct", 0) < len(latencies) + len(errors):
            console.print(
                f"[dim]The example sends {counts['distinct']} distinct inputs, so most "
                "requests are answered from the response cache: the figures above mix cache "
                "hits with computed requests. `--no-cache` times the pipeline itself.[/dim]"
            )
        if server.is_decoupled(example.model):
            steps = ", ".join(
                f"step[{s.step}] {s.model_name}: {peaks.get(s.step, 0)} "
                f"(limit {s.max_inflight_requests or 'none'})"
                for s in server.step_statistics(example.model)
            )
            console.print(
                f"streamed {counts['responses']} responses ({counts['responses'] / wall:,.1f}"
                f"/s); peak intermediates in flight per step: {steps}",
                highlight=False,
            )
        if options.linger:
            console.print(f"serving for {options.linger:g} s more (Ctrl-C to stop)")
            await trio.sleep(options.linger)
    return 1 if errors else 0


async def _drive(
    server: AsyncServer,
    example: Example,
    requests: int,
    concurrency: int,
    seed: int,
    console: Console,
    counts: dict[str, int],
    peaks: dict[int, int],
) -> tuple[list[float], list[str], float]:
    """Send the requests; return latencies (s), error lines and the wall time (s)."""
    counts["responses"] = 0
    rng = np.random.default_rng(seed)
    inputs = [example.make_inputs(i, rng) for i in range(requests)]
    counts["distinct"] = len({_fingerprint(i) for i in inputs})
    latencies: list[float] = []
    errors: list[str] = []
    next_index = iter(range(requests))
    progress = _progress(console)
    task = progress.add_task("infer", total=requests)

    streaming = server.is_decoupled(example.model)

    async def client() -> None:
        for index in next_index:
            start = time.perf_counter()
            try:
                if streaming:
                    await _stream_one(server, example, inputs[index], str(index), counts, peaks)
                else:
                    response = await server.infer(
                        example.model, inputs[index], request_id=str(index)
                    )
                    if example.check is not None:
                        example.check(inputs[index], response.outputs)
            except (OrchestrionError, AssertionError) as exc:
                errors.append(f"request {index}: {type(exc).__name__}: {exc}")
            else:
                latencies.append(time.perf_counter() - start)
            progress.advance(task)

    async def refresher() -> None:
        while True:
            progress.refresh()
            await trio.sleep(0.1)

    started = time.perf_counter()
    with progress:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(refresher)
            async with trio.open_nursery() as clients:
                for _ in range(min(concurrency, requests)):
                    clients.start_soon(client)
            nursery.cancel_scope.cancel()
        progress.refresh()
    return latencies, errors, time.perf_counter() - started


async def _stream_one(
    server: AsyncServer,
    example: Example,
    inputs: Mapping[str, Any],
    request_id: str,
    counts: dict[str, int],
    peaks: dict[int, int],
) -> None:
    """One request of a decoupled example: its responses counted and checked, the peak of
    each step's intermediates in flight noted."""
    stream = server.stream_infer(example.model, inputs, request_id=request_id)
    async with contextlib.aclosing(stream) as responses:
        async for response in responses:
            counts["responses"] += 1
            for s in server.step_statistics(example.model):
                peaks[s.step] = max(peaks.get(s.step, 0), s.in_flight + s.queued)
            if example.check is not None:
                example.check(inputs, response.outputs)


def _fingerprint(inputs: Mapping[str, Any]) -> tuple[Any, ...]:
    """What tells two requests' inputs apart (as the cache key does: names, types, shapes,
    bytes)."""
    return tuple(
        (
            name,
            str(array.dtype),
            array.shape,
            array.tobytes() if array.dtype != object else tuple(array.ravel().tolist()),
        )
        for name, array in sorted((n, np.asarray(a)) for n, a in inputs.items())
    )


def _progress(console: Console) -> Progress:
    """The requests' progress bar, refreshed by `_drive` (every 0.1 s, and at the end)."""
    return Progress(
        TextColumn("requests"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        auto_refresh=False,
        transient=False,
    )


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    return float(np.percentile(np.asarray(values), q))


def _summary(
    server: AsyncServer,
    example: Example,
    latencies: list[float],
    errors: list[str],
    wall: float,
    concurrency: int,
    console: Console,
) -> None:
    requests = len(latencies) + len(errors)
    top = server.model_statistics(example.model)[-1].inference_stats
    hits = top.cache_hit.count
    cache = server.cache_statistics()
    joined = cache.coalesced if cache is not None else 0
    computed = requests - len(errors) - hits
    console.print(
        f"[bold]{example.name}[/bold]: {requests} requests at concurrency {concurrency}: "
        f"[bold]{computed} computed[/bold] by the pipeline"
        + (
            f", [bold]{hits} answered from the response cache[/bold] ({joined} of them by "
            "waiting for an identical request already running)"
            if hits
            else ""
        )
        + (f", [red]{len(errors)} failed[/red]" if errors else ""),
        highlight=False,
    )
    table = Table()
    table.add_column("all requests")
    table.add_column("value", justify="right")
    table.add_row("requests", str(requests))
    table.add_row("errors", str(len(errors)))
    table.add_row("throughput", f"{requests / wall:,.1f} req/s")
    table.add_row("p50 latency", f"{_percentile(latencies, 50) * 1e3:.2f} ms")
    table.add_row("p99 latency", f"{_percentile(latencies, 99) * 1e3:.2f} ms")
    console.print(table)
    models = Table(
        title="executions per model",
        caption="ok / failed: requests the model answered or failed; cache hits: hits of the "
        "lookups; execs: executions (a batch is one execution of several requests); compute: "
        "mean time of one execution",
    )
    every = server.model_statistics()
    longest = max((len(s.name) for s in every), default=5)
    models.add_column("model", no_wrap=True, min_width=longest)
    for column in ("version", "ok", "failed", "cache hits", "execs", "compute"):
        models.add_column(column, justify="right")
    for s in every:
        n = s.execution_count
        compute = s.inference_stats.compute_infer.ns / n / 1e6 if n else 0.0
        hits, misses = s.inference_stats.cache_hit.count, s.inference_stats.cache_miss.count
        models.add_row(
            s.name,
            str(s.version),
            str(s.inference_stats.success.count),
            str(s.inference_stats.fail.count),
            f"{hits}/{hits + misses}" if hits + misses else "-",
            str(n) if s.name != example.model else "-",
            f"{compute:.2f} ms" if n else "-",
        )
    console.print(models)
    if cache is not None:
        utilization = cache.utilization
        console.print(
            f"cache [bold]{cache.name}[/bold]: {cache.hits} hits, {cache.misses} misses, "
            f"{cache.coalesced} joined an identical running request, "
            f"{cache.entries if cache.entries is not None else '?'} entries"
            + (f", {utilization:.1%} full" if utilization is not None else "")
            + (f", {cache.evictions} evictions" if cache.evictions else ""),
            highlight=False,
        )
    for line in errors[:5]:
        console.print(f"[red]{line}[/red]", highlight=False)
    if len(errors) > 5:
        console.print(f"[red]... and {len(errors) - 5} more errors[/red]")


def _control_summary(server: AsyncServer, model: str, requests: int, console: Console) -> None:
    """What an ensemble's control flow did: a mapped step's items, a conditional step's runs
    and skips, a loop's iterations (nothing for an ensemble that declares none)."""
    config = server.model_config(model)
    control, _ = read_control(config)
    if not config.is_ensemble or control.empty or not requests:
        return
    table = Table(
        title="control flow (declared in the ensemble's parameters)",
        caption="ran: requests sent to the step's model (a loop's step: one per iteration); "
        "per request: over the requests above",
    )
    for column in ("step", "model", "declared", "ran", "skipped", "items", "per request"):
        table.add_column(column, justify="left" if column in ("model", "declared") else "right")
    for s in server.step_statistics(model):
        own = control.step(s.step)
        loop = control.loop_of(s.step)
        declared = []
        if own is not None and own.mapped:
            declared.append(f"map over {', '.join(sorted(own.mapped))}")
        if own is not None and own.when is not None:
            declared.append(f"when {'not ' if own.negate else ''}{own.when}")
        if loop is not None:
            declared.append(f"loop '{loop.name}' (at most {loop.max_iterations})")
        if not declared:
            continue
        if own is not None and own.mapped:
            per = f"{s.items / requests:.2f} items"
        elif loop is not None:
            per = f"{s.runs / requests:.2f} iterations"
        else:
            per = f"ran {s.runs / requests:.0%}"
        table.add_row(
            f"step[{s.step}]",
            s.model_name,
            "; ".join(declared),
            str(s.runs),
            str(s.skipped),
            str(s.items) if own is not None and own.mapped else "-",
            per,
        )
    console.print(table)
