"""The orchestrion command line: run an example pipeline, validate a model repository."""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import math
import signal
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import trio
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from .._server import AsyncServer, open_server
from ..actors import load_model_code, scan_repository
from ..actors._repository import CONFIG_FILE
from ..protocols import (
    CacheUnavailableError,
    ConfigError,
    ModelLoadError,
    OrchestrionError,
    parse_cache_config,
    validate_repository,
)
from ..protocols._errors import ungrouped
from ._control import ModelControlMode, Shutdown
from ._examples import Example, load_example
from ._http_server import MAX_DEFAULT_CONNECTIONS
from ._serve import LOOPBACK, Endpoints, ServeOptions, serve

DEFAULT_CACHE = ("local,size=268435456",)
"""The embedded default of `orchestrion run`: a 256 MiB local cache (`serve`'s is
`ServeOptions`': none, as Triton)."""


def _default(field: str) -> Any:
    """`ServeOptions`' default for ``field``: the ``orchestrion serve`` flags have none of
    their own."""
    return attrs.fields_dict(ServeOptions)[field].default


def _mib(size: int) -> str:
    return f"{size / 2**20:g} MiB"


def _server_options(
    command: argparse.ArgumentParser,
    *,
    default_cache: Sequence[str],
    default_metrics_port: int | None,
) -> None:
    """The cache and telemetry flags `run` and `serve` share, with the command's defaults."""
    cache = command.add_argument_group("response cache (models opt in with response_cache)")
    cache.add_argument(
        "--cache-config",
        action="append",
        metavar="NAME,KEY=VALUE",
        help=f"Triton's flag, repeatable: local,size=BYTES or redis,host=H ... "
        f"(default: {' '.join(default_cache) or 'no cache'})",
    )
    cache.add_argument(
        "--response-cache-byte-size",
        type=int,
        metavar="BYTES",
        help="deprecated (as in Triton): the same as --cache-config local,size=BYTES",
    )
    cache.add_argument("--no-cache", action="store_true", help="run without a response cache")
    telemetry = command.add_argument_group("telemetry")
    telemetry.add_argument(
        "--metrics-port",
        type=int,
        default=default_metrics_port,
        metavar="PORT",
        help="serve Prometheus metrics at http://<metrics-host>:PORT/metrics"
        + (f" (default: {default_metrics_port})" if default_metrics_port else ""),
    )
    telemetry.add_argument(
        "--metrics-host",
        "--metrics-address",
        dest="metrics_host",
        metavar="ADDRESS",
        help="the address the metrics endpoint binds (default: loopback only)",
    )
    telemetry.add_argument(
        "--trace-config",
        action="append",
        metavar="[opentelemetry,]KEY=VALUE",
        help="Triton's flag, repeatable: mode=opentelemetry, rate=N (1 in N traced), "
        "opentelemetry,url=http://localhost:4318/v1/traces (default: the OTEL_* variables)",
    )


def _flag(text: str) -> bool:
    """Triton's boolean flag values (``--allow-metrics=false``)."""
    value = text.strip().lower()
    if value in ("true", "1", "yes", "on"):
        return True
    if value in ("false", "0", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _serve_options(serve: argparse.ArgumentParser) -> None:
    """Triton's ``tritonserver`` flags, with `ServeOptions`' defaults (Triton's, but
    loopback addresses)."""
    serve.add_argument("--model-repository", required=True, type=Path)
    network = serve.add_argument_group("network (binds loopback unless told otherwise)")
    network.add_argument(
        "--host", default=LOOPBACK, metavar="ADDRESS", help="address of every endpoint"
    )
    for name in ("http", "grpc"):
        port = _default(f"{name}_port")
        network.add_argument(f"--{name}-port", type=int, default=port, metavar="PORT")
        network.add_argument(f"--{name}-address", metavar="ADDRESS", help="overrides --host")
        network.add_argument(
            f"--allow-{name}",
            type=_flag,
            nargs="?",
            const=True,
            default=port is not None,
            metavar="BOOL",
        )
    network.add_argument(
        "--allow-metrics",
        type=_flag,
        nargs="?",
        const=True,
        default=_default("metrics_port") is not None,
        metavar="BOOL",
    )
    max_input = _default("http_max_input_size")
    network.add_argument(
        "--http-max-input-size",
        type=int,
        default=max_input,
        metavar="BYTES",
        help=f"largest HTTP request body accepted (default: {_mib(max_input)}, as Triton)",
    )
    network.add_argument(
        "--http-max-connections",
        type=int,
        default=_default("http_max_connections"),
        metavar="N",
        help="HTTP connections served at once; more get 503 (default: half the open-file "
        f"limit, at most {MAX_DEFAULT_CONNECTIONS})",
    )
    header_timeout = _default("http_header_timeout")
    network.add_argument(
        "--http-header-timeout",
        type=float,
        default=header_timeout,
        metavar="SECONDS",
        help=f"time a request head may take to arrive (408 beyond; default: {header_timeout:g})",
    )
    body_timeout = _default("http_body_timeout")
    network.add_argument(
        "--http-body-timeout",
        type=float,
        default=body_timeout,
        metavar="SECONDS",
        help=f"time a request body may go without progress (408 beyond; default: {body_timeout:g})",
    )
    max_message = _default("grpc_max_message_size")
    network.add_argument(
        "--grpc-max-message-size",
        type=int,
        default=max_message,
        metavar="BYTES",
        help=f"largest gRPC message accepted or sent (default: {_mib(max_message)}; Triton's "
        "is 2 GiB - 1: a request costs 6-7x its size in memory at its peak)",
    )
    models = serve.add_argument_group("models")
    models.add_argument(
        "--model-control-mode",
        choices=[mode.value for mode in ModelControlMode],
        default=_default("model_control_mode"),
    )
    models.add_argument(
        "--load-model",
        action="append",
        default=[],
        metavar="NAME",
        help="explicit mode: a model to load at start (repeatable; * for all)",
    )
    models.add_argument(
        "--repository-poll-secs",
        type=float,
        default=_default("poll_interval"),
        metavar="SECONDS",
    )
    models.add_argument(
        "--strict-readiness",
        type=_flag,
        nargs="?",
        const=True,
        default=_default("strict_readiness"),
        metavar="BOOL",
    )
    models.add_argument(
        "--exit-timeout-secs",
        type=float,
        default=_default("exit_timeout"),
        metavar="SECONDS",
        help="on SIGINT/SIGTERM, how long requests in flight may take to finish",
    )
    serve.add_argument(
        "--log-verbose", type=int, default=0, metavar="LEVEL", help="> 0: debug logging"
    )
    _server_options(
        serve,
        default_cache=_default("cache_config"),
        default_metrics_port=_default("metrics_port"),
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="orchestrion", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run an example pipeline and summarise it")
    run.add_argument("example", help="a folder under examples/ (image_pipeline) or a path")
    run.add_argument(
        "-n", "--requests", type=int, help="number of requests (default: the example's)"
    )
    run.add_argument("-c", "--concurrency", type=int, help="requests in flight at once")
    run.add_argument("--seed", type=int, default=0, help="seed of the input generator")
    _server_options(run, default_cache=DEFAULT_CACHE, default_metrics_port=None)
    run.add_argument(
        "--linger",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="keep the server (and its metrics endpoint) up this long after the run",
    )
    serve = commands.add_parser(
        "serve",
        help="serve a model repository over HTTP and gRPC (KServe v2, as Triton) until Ctrl-C",
    )
    _serve_options(serve)
    validate = commands.add_parser("validate", help="check a model repository, report every error")
    validate.add_argument("--model-repository", required=True, type=Path)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``orchestrion`` command."""
    args = _parser().parse_args(argv)
    console = Console()
    try:
        if args.command == "validate":
            return _validate(args.model_repository, console)
        if args.command == "serve":
            return trio.run(_serve, _serve_settings(args, console), args.log_verbose, console)
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
            cache=_cache_flags(args, console),
            metrics_port=args.metrics_port,
            metrics_host=args.metrics_host or LOOPBACK,
            tracing=args.trace_config,
            linger=args.linger,
        )
        return trio.run(_run, example, requests, concurrency, args.seed, options, console)
    except (ConfigError, ModelLoadError, CacheUnavailableError) as exc:
        # Start-up errors leave `run` and `serve` as themselves (their nurseries are
        # `ungrouped`): one clear line each.
        console.print(f"[red]error:[/red] {exc}", highlight=False, soft_wrap=True)
        return 2


def _serve_settings(args: argparse.Namespace, console: Console) -> ServeOptions:
    host = args.host
    return ServeOptions(
        model_repository=args.model_repository,
        http_address=args.http_address or host,
        http_port=args.http_port if args.allow_http else None,
        grpc_address=args.grpc_address or host,
        grpc_port=args.grpc_port if args.allow_grpc else None,
        metrics_address=args.metrics_host or host,
        metrics_port=args.metrics_port if args.allow_metrics else None,
        cache_config=_cache_flags(args, console, default=_default("cache_config")),
        tracing=args.trace_config,
        model_control_mode=ModelControlMode(args.model_control_mode),
        load_models=tuple(args.load_model),
        strict_readiness=args.strict_readiness,
        exit_timeout=args.exit_timeout_secs,
        poll_interval=args.repository_poll_secs,
        http_max_input_size=args.http_max_input_size,
        http_max_connections=args.http_max_connections,
        http_header_timeout=args.http_header_timeout,
        http_body_timeout=args.http_body_timeout,
        grpc_max_message_size=args.grpc_max_message_size,
    )


def _cache_flags(
    args: argparse.Namespace, console: Console, default: Sequence[str] = DEFAULT_CACHE
) -> list[str]:
    """The ``--cache-config`` values to run with (checked here, so errors come first);
    ``default`` without cache flags (empty: no cache).

    Raises:
        ConfigError: malformed flags, or flags that contradict each other.
    """
    flags: list[str] = list(args.cache_config or [])
    if args.no_cache:
        if flags or args.response_cache_byte_size is not None:
            raise ConfigError("--no-cache cannot be combined with a cache flag")
        return []
    if not flags and args.response_cache_byte_size is None:
        if not default:
            return []  # serve, as Triton: no cache unless asked for
        flags = list(default)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", DeprecationWarning)
        settings = parse_cache_config(flags, response_cache_byte_size=args.response_cache_byte_size)
    for warning in caught:
        console.print(f"[yellow]warning:[/yellow] {warning.message}", highlight=False)
    assert settings is not None
    return [f"{settings.name},{k}={v}" for k, v in settings.options.items()]


def _validate(root: Path, console: Console) -> int:
    entries, errors = scan_repository(root)
    configs = {e.name: e.config for e in entries}
    errors.extend(
        validate_repository(
            configs,
            {e.name: e.versions for e in entries},
            {e.name: str(e.path / CONFIG_FILE) for e in entries},
        )
    )
    for entry in entries:
        for version in entry.versions:
            try:
                load_model_code(entry, version)
            except ConfigError as exc:
                errors.extend(exc.errors)
            except ModelLoadError as exc:
                errors.append(str(exc))
    errors = list(dict.fromkeys(errors))
    if errors:
        console.print(f"[red]{len(errors)} problem(s)[/red] in {root}:", highlight=False)
        for line in errors:
            console.print(f"  - {line}", highlight=False, soft_wrap=True)
        return 1
    if not entries:
        console.print(f"[yellow]warning[/yellow]: no model folders in {root}", highlight=False)
    console.print(f"[green]OK[/green]: {len(entries)} models in {root}", highlight=False)
    return 0


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
        latencies, errors, wall = await _drive(
            server, example, requests, concurrency, seed, console, counts, peaks
        )
        _summary(server, example, latencies, errors, wall, concurrency, console)
        if server._registry.decoupled(example.model):
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


async def _serve(options: ServeOptions, log_verbose: int, console: Console) -> int:
    logging.basicConfig(
        level=logging.DEBUG if log_verbose > 0 else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    started = time.perf_counter()
    shutdown = Shutdown()
    async with ungrouped(trio.open_nursery()) as nursery:
        # Listening from the start: a signal while the models load stops them gracefully
        # once loaded. The first signal ends this task; `serve` returns only after it.
        nursery.start_soon(_shut_down_on_signal, shutdown, options.exit_timeout, console)
        endpoints = await nursery.start(functools.partial(serve, options, shutdown=shutdown))
        _report_started(endpoints, time.perf_counter() - started, console)
    console.print("stopped")
    return 0


async def _shut_down_on_signal(shutdown: Shutdown, exit_timeout: float, console: Console) -> None:
    """Request ``shutdown`` at the first SIGINT or SIGTERM. A second one then has its usual
    effect (a KeyboardInterrupt, or the end of the process)."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for number in signals:
            console.print(
                f"{signal.Signals(number).name}: stopping (requests in flight get "
                f"{exit_timeout:g} s)",
                highlight=False,
            )
            shutdown.request()
            break


def _report_started(endpoints: Endpoints, seconds: float, console: Console) -> None:
    """Triton's start-up lines, which scripts wait for."""
    if endpoints.grpc:
        console.print(f"Started GRPCInferenceService at {endpoints.grpc}", highlight=False)
    if endpoints.http:
        console.print(f"Started HTTPService at {endpoints.http}", highlight=False)
    if endpoints.metrics:
        console.print(f"Started Metrics Service at {endpoints.metrics}", highlight=False)
    console.print(f"ready in {seconds:.1f} s; Ctrl-C (SIGINT) or SIGTERM to stop", highlight=False)
    console.file.flush()  # scripts wait for these lines, also through a pipe


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
    latencies: list[float] = []
    errors: list[str] = []
    next_index = iter(range(requests))
    progress = Progress(
        TextColumn("requests"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        auto_refresh=False,
        transient=False,
    )
    task = progress.add_task("infer", total=requests)

    streaming = server._registry.decoupled(example.model)

    async def one(index: int) -> None:
        if not streaming:
            response = await server.infer(example.model, inputs[index], request_id=str(index))
            if example.check is not None:
                example.check(inputs[index], response.outputs)
            return
        stream = server.stream_infer(example.model, inputs[index], request_id=str(index))
        async with contextlib.aclosing(stream) as responses:
            async for response in responses:
                counts["responses"] += 1
                for s in server.step_statistics(example.model):
                    peaks[s.step] = max(peaks.get(s.step, 0), s.in_flight + s.queued)
                if example.check is not None:
                    example.check(inputs[index], response.outputs)

    async def client() -> None:
        for index in next_index:
            start = time.perf_counter()
            try:
                await one(index)
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
    table = Table(title=f"{example.name}: {requests} requests at concurrency {concurrency}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("requests", str(requests))
    table.add_row("errors", str(len(errors)))
    table.add_row("throughput", f"{requests / wall:,.1f} req/s")
    table.add_row("p50 latency", f"{_percentile(latencies, 50) * 1e3:.2f} ms")
    table.add_row("p99 latency", f"{_percentile(latencies, 99) * 1e3:.2f} ms")
    console.print(table)
    models = Table(title="executions per model")
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
    cache = server.cache_statistics()
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


if __name__ == "__main__":
    sys.exit(main())
