"""The ``orchestrion`` command's server flags: their declarations, and what they become.

How this works: `add_server_flags` declares the cache and telemetry flags ``run`` and
``serve`` share, `add_serve_flags` Triton's ``tritonserver`` flags of ``serve``, one function
per flag group (endpoints, limits, models; the rest of Triton's flags, and its log flags, in
`_cli_triton_flags`). ``serve``'s flags have no defaults of their own: each is
`ServeOptions`' (`_default`), so the command line and the embedding API cannot drift apart.
Once parsed, `cache_settings` checks the cache flags (errors come before anything loads) and
`serve_settings` turns ``serve``'s flags into `ServeOptions` and `LogSettings`.
"""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
from rich.console import Console

from ..protocols import ConfigError, parse_cache_config
from ._cli_triton_flags import add_triton_flags, flag_value, triton_settings
from ._control import ModelControlMode
from ._http_server import MAX_DEFAULT_CONNECTIONS
from ._logging import LogSettings
from ._restricted import CATEGORIES
from ._serve import LOOPBACK, ServeOptions


def _default(field: str) -> Any:
    """`ServeOptions`' default for ``field``: the ``orchestrion serve`` flags have none of
    their own."""
    return attrs.fields_dict(ServeOptions)[field].default


def _mib(size: int) -> str:
    return f"{size / 2**20:g} MiB"


_flag = flag_value
"""Triton's boolean flag values (``--allow-metrics=false``)."""


def add_server_flags(
    command: argparse.ArgumentParser,
    *,
    default_cache: Sequence[str],
    default_metrics_port: int | None,
) -> None:
    """The cache and telemetry flags `run` and `serve` share, with the command's defaults."""
    _add_cache_flags(command, default_cache)
    _add_telemetry_flags(command, default_metrics_port)


def _add_cache_flags(command: argparse.ArgumentParser, default_cache: Sequence[str]) -> None:
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


def _add_telemetry_flags(
    command: argparse.ArgumentParser, default_metrics_port: int | None
) -> None:
    telemetry = command.add_argument_group("telemetry")
    telemetry.add_argument(
        "--metrics-port",
        type=int,
        default=default_metrics_port,
        metavar="PORT",
        help="serve Prometheus metrics at http://<metrics-host>:PORT/metrics"
        + (
            f" (default: {default_metrics_port})"
            if default_metrics_port
            else " (default: no metrics endpoint)"
        ),
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


def add_serve_flags(serve: argparse.ArgumentParser) -> None:
    """Triton's ``tritonserver`` flags, with `ServeOptions`' defaults (Triton's, but
    loopback addresses)."""
    serve.add_argument(
        "--model-repository",
        "--model-store",
        required=True,
        action="append",
        type=Path,
        metavar="DIR",
        help="a Triton-layout model repository: DIR/<model>/config.pbtxt and version folders "
        "(one; --model-store is Triton's other name for it)",
    )
    network = serve.add_argument_group("network (binds loopback unless told otherwise)")
    _add_endpoint_flags(network)
    _add_limit_flags(network)
    _add_model_flags(serve.add_argument_group("models"))
    add_triton_flags(serve)
    add_server_flags(
        serve,
        default_cache=_default("cache_config"),
        default_metrics_port=_default("metrics_port"),
    )


def _add_endpoint_flags(network: argparse._ArgumentGroup) -> None:
    """Where the HTTP, gRPC and metrics endpoints listen, and whether they do."""
    network.add_argument(
        "--host",
        default=LOOPBACK,
        metavar="ADDRESS",
        help=f"the address every endpoint binds (default: {LOOPBACK}; 0.0.0.0: every interface)",
    )
    for name, label in (("http", "HTTP (KServe v2 REST)"), ("grpc", "gRPC")):
        port = _default(f"{name}_port")
        network.add_argument(
            f"--{name}-port",
            type=int,
            default=port,
            metavar="PORT",
            help=f"the {label} endpoint's port (default: {port}, as Triton; 0: any free port)",
        )
        network.add_argument(
            f"--{name}-address",
            metavar="ADDRESS",
            help=f"the {label} endpoint's address (overrides --host)",
        )
        network.add_argument(
            f"--allow-{name}",
            type=_flag,
            nargs="?",
            const=True,
            default=port is not None,
            metavar="BOOL",
            help=f"serve the {label} endpoint (default: true)",
        )
    network.add_argument(
        "--allow-metrics",
        type=_flag,
        nargs="?",
        const=True,
        default=_default("metrics_port") is not None,
        metavar="BOOL",
        help="serve Prometheus metrics (default: true)",
    )


def _add_limit_flags(network: argparse._ArgumentGroup) -> None:
    """What the HTTP and gRPC front ends accept: sizes, connections, timeouts."""
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
    _add_frontend_flags(network)
    _add_timeout_flags(network)
    max_message = _default("grpc_max_message_size")
    network.add_argument(
        "--grpc-max-message-size",
        type=int,
        default=max_message,
        metavar="BYTES",
        help=f"largest gRPC message accepted or sent (default: {_mib(max_message)}; Triton's "
        "is 2 GiB - 1: a request costs 6-7x its size in memory at its peak)",
    )
    network.add_argument(
        "--allow-client-shm",
        type=_flag,
        nargs="?",
        const=True,
        default=None,
        metavar="BOOL",
        help="let clients register system shared memory regions and send inputs and receive "
        "outputs through them (a client can then read and write any shared memory object "
        "this user can open; default: only when HTTP and gRPC listen on loopback addresses)",
    )
    network.add_argument(
        "--http-restricted-api",
        action="append",
        default=[],
        metavar="APIS:HEADER=VALUE",
        help="answer the HTTP endpoint groups APIS (comma-separated: "
        f"{', '.join(CATEGORIES)}) only to requests whose HEADER is VALUE; repeatable",
    )
    network.add_argument(
        "--grpc-restricted-protocol",
        action="append",
        default=[],
        metavar="PROTOCOLS:KEY=VALUE",
        help="answer the gRPC method groups PROTOCOLS only to calls whose metadata "
        "triton-grpc-protocol-KEY is VALUE; repeatable",
    )
    max_regions = _default("max_shm_regions")
    network.add_argument(
        "--max-shm-regions",
        type=int,
        default=max_regions,
        metavar="N",
        help=f"shared memory regions registered at once, at most (default: {max_regions})",
    )


def _add_timeout_flags(network: argparse._ArgumentGroup) -> None:
    """How long and how slowly an HTTP request may arrive."""
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
        help=f"time a request body may go without progress, and the start of its whole "
        f"deadline (408 beyond; default: {body_timeout:g})",
    )
    min_rate = _default("http_body_min_rate")
    network.add_argument(
        "--http-body-min-rate",
        type=float,
        default=min_rate,
        metavar="BYTES_PER_S",
        help="rate a request body must average: each byte received extends its deadline by "
        f"1/rate seconds past --http-body-timeout (408 beyond; 0: no deadline; default: "
        f"{min_rate:g}, Apache's MinRate)",
    )


def _add_on_demand_flags(models: argparse._ArgumentGroup) -> None:
    """Models loaded on first use, and the limits under which they are unloaded."""
    models.add_argument(
        "--model-load-on-demand",
        type=_flag,
        nargs="?",
        const=True,
        default=False,
        metavar="BOOL",
        help="load a repository model on its first request (explicit model control; with "
        "--load-model, those load at start) and unload the least recently used one that has "
        "no request in flight when a limit below would be passed (default: false)",
    )
    models.add_argument(
        "--model-count-limit",
        type=int,
        default=None,
        metavar="N",
        help="with --model-load-on-demand: the most models loaded at once, composing models "
        "counted (default: no limit)",
    )
    models.add_argument(
        "--model-memory-limit",
        type=int,
        default=None,
        metavar="BYTES",
        help="with --model-load-on-demand: the most bytes of model files (weights) loaded at "
        "once (default: no limit)",
    )


def _add_model_flags(models: argparse._ArgumentGroup) -> None:
    """Model control (none, explicit, poll), readiness and the graceful stop."""
    mode = _default("model_control_mode")
    models.add_argument(
        "--model-control-mode",
        choices=[m.value for m in ModelControlMode],
        default=mode,
        help="none: load the whole repository at start; explicit: load and unload through the "
        "API (and --load-model); poll: follow the repository's changes "
        f"(default: {getattr(mode, 'value', mode)})",
    )
    models.add_argument(
        "--load-model",
        action="append",
        default=[],
        metavar="NAME",
        help="explicit mode: a model to load at start (repeatable; * for all)",
    )
    _add_on_demand_flags(models)
    poll = _default("poll_interval")
    models.add_argument(
        "--repository-poll-secs",
        type=float,
        default=poll,
        metavar="SECONDS",
        help=f"poll mode: how often the repository is checked for changes (default: {poll:g})",
    )
    models.add_argument(
        "--strict-readiness",
        type=_flag,
        nargs="?",
        const=True,
        default=_default("strict_readiness"),
        metavar="BOOL",
        help="/v2/health/ready is true only while every model is ready (default: "
        f"{str(_default('strict_readiness')).lower()})",
    )
    upload = _default("model_upload_max_size")
    models.add_argument(
        "--model-upload-max-size",
        type=int,
        default=upload,
        metavar="BYTES",
        help="explicit mode: the most bytes the files of one load request (Triton's file: "
        f"parameters) may hold, each file and all together (default: {_mib(upload)}; 0: "
        "refuse files). Whoever reaches the port can then run code on this server",
    )
    exit_timeout = _default("exit_timeout")
    models.add_argument(
        "--exit-timeout-secs",
        type=float,
        default=exit_timeout,
        metavar="SECONDS",
        help="on SIGINT/SIGTERM, how long requests in flight may take to finish "
        f"(default: {exit_timeout:g})",
    )


def _add_frontend_flags(network: argparse._ArgumentGroup) -> None:
    """The choice of front end and the native front end's settings."""
    network.add_argument(
        "--frontend",
        choices=("auto", "native", "python"),
        default=_default("frontend"),
        help="what serves HTTP and gRPC: native (compiled, outside the interpreter: the "
        "orchestrion-native package), python (h11 and grpcio), or auto: native when "
        f"installed (default: {_default('frontend')})",
    )
    network.add_argument(
        "--frontend-threads",
        type=int,
        default=_default("frontend_threads"),
        metavar="N",
        help="threads of the native front end's sockets, besides the interpreter's "
        f"(default: {_default('frontend_threads')})",
    )
    network.add_argument(
        "--workers",
        type=int,
        default=_default("workers"),
        metavar="N",
        help="server processes, each with its own interpreter and models, sharing the ports "
        "(the kernel spreads connections across them; metrics add up on the metrics port); "
        "needs the native front end; model control through the API and client shared "
        f"memory are refused with more than one (default: {_default('workers')})",
    )
    network.add_argument("--worker-of", type=int, default=0, help=argparse.SUPPRESS)
    network.add_argument(
        "--frontend-cache-size",
        type=int,
        default=_default("frontend_cache_size"),
        metavar="BYTES",
        help="with a response cache: bytes of answers the native front end keeps and "
        "answers itself, without Python, for repeated requests to models that cache "
        f"(default: {_mib(_default('frontend_cache_size'))}; 0: none)",
    )


def serve_settings(args: argparse.Namespace, console: Console) -> tuple[ServeOptions, LogSettings]:
    """``serve``'s parsed flags as `ServeOptions` and `LogSettings` (warnings go to
    ``console``: the cache's, and the ``tritonserver`` flags ignored).

    Raises:
        ConfigError: malformed cache flags, flags that contradict each other, or a refused
            ``tritonserver`` flag.
    """
    host = args.host
    if len(args.model_repository) > 1:
        raise ConfigError(
            "--model-repository (or --model-store) given more than once: orchestrion serves "
            "one model repository (Triton merges several)"
        )
    triton = triton_settings(args, console)
    options = ServeOptions(
        model_repository=args.model_repository[0],
        http_address=args.http_address or host,
        http_port=args.http_port if args.allow_http else None,
        grpc_address=args.grpc_address or host,
        grpc_port=args.grpc_port if args.allow_grpc else None,
        metrics_address=args.metrics_host or host,
        metrics_port=args.metrics_port if args.allow_metrics else None,
        cache_config=cache_settings(args, console, default=_default("cache_config")),
        tracing=args.trace_config,
        model_control_mode=ModelControlMode(args.model_control_mode),
        load_models=tuple(args.load_model),
        model_load_on_demand=args.model_load_on_demand,
        model_count_limit=args.model_count_limit,
        model_memory_limit=args.model_memory_limit,
        exit_on_error=triton.exit_on_error,
        server_id=triton.server_id,
        reading=triton.reading,
        grpc_channel_args=triton.grpc_channel_args,
        strict_readiness=args.strict_readiness,
        exit_timeout=args.exit_timeout_secs,
        poll_interval=args.repository_poll_secs,
        http_max_input_size=args.http_max_input_size,
        http_max_connections=args.http_max_connections,
        http_header_timeout=args.http_header_timeout,
        http_body_timeout=args.http_body_timeout,
        http_body_min_rate=args.http_body_min_rate,
        grpc_max_message_size=args.grpc_max_message_size,
        allow_client_shm=args.allow_client_shm,
        max_shm_regions=args.max_shm_regions,
        http_restricted_apis=tuple(args.http_restricted_api),
        grpc_restricted_protocols=tuple(args.grpc_restricted_protocol),
        model_upload_max_size=args.model_upload_max_size,
        frontend=args.frontend,
        frontend_threads=args.frontend_threads,
        frontend_cache_size=args.frontend_cache_size,
        workers=args.workers,
        worker_of=args.worker_of,
    )
    return options, triton.logs


def cache_settings(
    args: argparse.Namespace, console: Console, *, default: Sequence[str]
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
