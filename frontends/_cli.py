"""The ``orchestrion`` command: ``run`` an example pipeline, ``serve``, ``validate`` or
``tune`` a model repository.

How this works: `main` parses the command line (`_parser`: ``run``'s flags are declared in
`_cli_run`, ``serve``'s in `_cli_flags`) and hands each command its own: ``run`` to
`run_command`, ``serve`` to `_serve`, which runs `serve` under trio with Triton's start-up
lines and a graceful stop at the first SIGINT or SIGTERM, ``validate`` to `_validate`,
which reports every problem of a repository (configs, then each model's code) at once,
``tune`` to `tune_command`.
Start-up errors (a bad flag, config or model, an unreachable cache) are one ``error:``
line and exit status 2.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import trio
from rich.console import Console

from ..backends import forget_model
from ..protocols import (
    CacheUnavailableError,
    ConfigError,
    ModelLoadError,
    ungrouped,
    validate_repository,
)
from ..repository import CONFIG_FILE, load_model_code, scan_repository
from ._cli_flags import add_serve_flags, serve_settings
from ._cli_run import add_run_flags, run_command
from ._cli_triton_flags import HelpFormatter
from ._cli_tune import add_tune_flags, tune_command
from ._control import Shutdown
from ._logging import configure_logging, report_started
from ._serve import Endpoints, ServeOptions, check_workers, serve
from ._workers import serve_workers

_DESCRIPTION = (
    "The orchestrion command line: serve a Triton model repository over HTTP and gRPC "
    "(serve), run an example pipeline and summarise it (run), check a model repository "
    "(validate), find a pipeline's best configuration on this machine (tune). "
    "`orchestrion COMMAND --help` for each command's flags."
)
"""``orchestrion --help``'s description."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="orchestrion", description=_DESCRIPTION)
    commands = parser.add_subparsers(dest="command", required=True)
    add_run_flags(commands.add_parser("run", help="run an example pipeline and summarise it"))
    serve = commands.add_parser(
        "serve",
        help="serve a model repository over HTTP and gRPC (KServe v2, as Triton) until Ctrl-C",
        formatter_class=HelpFormatter,
    )
    add_serve_flags(serve)
    validate = commands.add_parser("validate", help="check a model repository, report every error")
    validate.add_argument(
        "--model-repository",
        required=True,
        type=Path,
        metavar="DIR",
        help="the model repository to check (every config, every ensemble, every model.py)",
    )
    add_tune_flags(
        commands.add_parser(
            "tune",
            help="find the best configuration of a pipeline on this machine, with a report",
        )
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``orchestrion`` command."""
    args = _parser().parse_args(argv)
    console = Console()
    try:
        if args.command == "validate":
            return _validate(args.model_repository, console)
        if args.command == "tune":
            return tune_command(args, console)
        if args.command == "serve":
            options, logs = serve_settings(args, console)
            configure_logging(logs)
            if options.workers != 1:
                check_workers(options)
                served = list(sys.argv[1:] if argv is None else argv)
                return trio.run(serve_workers, options, served, console)
            # The models' code sees the program's name alone, as in Triton's stub (its QA
            # models run unittest.main, which would read the server's flags as its own).
            sys.argv[1:] = []
            return trio.run(_serve, options, console)
        return run_command(args, console)
    except (ConfigError, ModelLoadError, CacheUnavailableError) as exc:
        # Start-up errors leave `run` and `serve` as themselves (their nurseries are
        # `ungrouped`): one clear line each.
        console.print(f"[red]error:[/red] {exc}", highlight=False, soft_wrap=True)
        return 2


async def _serve(options: ServeOptions, console: Console) -> int:
    started = time.perf_counter()
    shutdown = Shutdown()
    async with ungrouped(trio.open_nursery()) as nursery:
        # Listening from the start: a signal while the models load stops them gracefully
        # once loaded; a second exits at once. `serve` returning ends the listener.
        nursery.start_soon(_shut_down_on_signal, shutdown, options.exit_timeout, console)
        endpoints = await nursery.start(_serve_until_stopped, options, shutdown, nursery)
        seconds = time.perf_counter() - started
        report_started(console, endpoints.grpc, endpoints.http, endpoints.metrics, seconds)
    console.print("stopped")
    return 0


async def _serve_until_stopped(
    options: ServeOptions,
    shutdown: Shutdown,
    nursery: trio.Nursery,
    *,
    task_status: trio.TaskStatus[Endpoints] = trio.TASK_STATUS_IGNORED,
) -> None:
    """`serve`; once it has stopped (on a signal, or by itself: a worker whose supervisor
    is gone), the signal listener beside it ends too."""
    await serve(options, shutdown=shutdown, task_status=task_status)
    nursery.cancel_scope.cancel()


async def _shut_down_on_signal(shutdown: Shutdown, exit_timeout: float, console: Console) -> None:
    """Request ``shutdown`` at the first SIGINT or SIGTERM; at a second one, exit at once
    (status 128 + the signal's number): a stop held up by a model that does not end (a
    ``finalize`` that never returns, a thread it waits for) is never stuck."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        stopping = False
        async for number in signals:
            name = signal.Signals(number).name
            if stopping:
                console.print(f"{name} again: exiting now, without waiting", highlight=False)
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(128 + number)
            console.print(
                f"{name}: stopping (requests in flight get {exit_timeout:g} s; "
                "send it again to exit at once)",
                highlight=False,
            )
            shutdown.request()
            stopping = True


def _validate(root: Path, console: Console) -> int:
    entries, errors = scan_repository(root)
    # The configs as loading completes them (a python model's auto_complete_config, an ONNX
    # model's graph): an ensemble is checked against what its steps will be.
    configs = {e.name: e.config for e in entries}
    for entry in entries:
        for version in entry.versions:
            try:
                model = load_model_code(entry, version)
            except ConfigError as exc:
                errors.extend(exc.errors)
            except ModelLoadError as exc:
                errors.append(str(exc))
            else:
                configs[entry.name] = model.config
                forget_model(model)  # checked, not served: its code leaves sys.modules
    errors.extend(
        validate_repository(
            configs,
            {e.name: e.versions for e in entries},
            {e.name: str(e.path / CONFIG_FILE) for e in entries},
        )
    )
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


if __name__ == "__main__":
    sys.exit(main())
