"""``orchestrion serve``'s other ``tritonserver`` flags: a Triton launch line starts as it is.

How this works: `add_triton_flags` declares, in one argument group, the flags of Triton's
``tritonserver`` (its ``command_line_parser.cc``, 2.51) that ``serve`` does not declare with
its endpoints, limits and models. Those that apply are honoured: the log flags
(`LogSettings`), ``--id`` (the server's name in its metadata), ``--exit-on-error``,
``--disable-auto-complete-config`` and the deprecated ``--strict-model-config``,
``--model-config-name``, ``--backend-directory`` (where python-based backends are),
``--model-store`` (``--model-repository`` by another name), and the gRPC keepalive and
connection-age flags and ``--reuse-grpc-port`` (the grpcio server options Triton sets from them,
`GRPC_CHANNEL_ARGS`). Those that cannot apply here (compiled backends, GPUs, thread pools,
Triton's own trace files...) are accepted with Triton's value types and ignored;
`triton_settings` prints one warning naming those given. The few whose silent absence would
mislead (TLS, SageMaker and Vertex AI endpoints) are a start-up error when switched on.

Triton's boolean flags take ``true``/``false``/``on``/``off``/``1``/``0`` (``--flag=value``
or ``--flag value``); orchestrion also takes a bare ``--flag`` as true.
"""

from __future__ import annotations

import argparse
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
from rich.console import Console

from ..protocols import ConfigError
from ..repository import TRITON_BACKEND_DIRECTORY, ConfigReading
from ._logging import LogFormat, LogSettings
from ._serve import ServeOptions

_DEFAULTS = attrs.fields_dict(ServeOptions)


def flag_value(text: str) -> bool:
    """Triton's boolean flag values (``--allow-metrics=false``), case-insensitive."""
    value = text.strip().lower()
    if value in ("true", "1", "yes", "on"):
        return True
    if value in ("false", "0", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _verbosity(text: str) -> int:
    """``--log-verbose``: a level, or true (1) / false (0), as Triton takes it."""
    value = text.strip().lower()
    if value in ("true", "false"):
        return int(value == "true")
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a level (0, 1, ...), got {text!r}") from None


_TYPES: dict[str, Callable[[str], Any]] = {
    "bool": flag_value,
    "int": int,
    "float": float,
    "str": str,
}

IGNORED: dict[str, str] = {
    # Backends, repository agents and caches are Python here: no shared libraries to find
    # (--backend-directory is honoured: python-based backends are found there).
    "--backend-config": "str",
    "--repoagent-directory": "str",
    "--cache-directory": "str",
    # Loading, thread pools and memory pools of Triton's own.
    "--model-load-thread-count": "int",
    "--model-load-retry-count": "int",
    "--model-namespacing": "bool",
    "--buffer-manager-thread-count": "int",
    "--pinned-memory-pool-byte-size": "int",
    "--cuda-memory-pool-byte-size": "str",
    "--cuda-virtual-address-size": "str",
    "--min-supported-compute-capability": "float",
    "--enable-peer-access": "bool",
    "--host-policy": "str",
    "--model-load-gpu-limit": "str",
    "--rate-limit": "str",
    "--rate-limit-resource": "str",
    # Front-end tuning of Triton's HTTP and gRPC servers.
    "--reuse-http-port": "bool",
    "--http-thread-count": "int",
    "--http-header-forward-pattern": "str",
    "--grpc-header-forward-pattern": "str",
    "--grpc-infer-thread-count": "int",
    "--grpc-infer-allocation-pool-size": "int",
    "--grpc-max-response-pool-size": "int",
    "--grpc-infer-response-compression-level": "str",
    "--grpc-server-cert": "str",
    "--grpc-server-key": "str",
    "--grpc-root-cert": "str",
    # Endpoints of other platforms' builds, metrics orchestrion does not collect.
    "--sagemaker-port": "int",
    "--sagemaker-safe-port-range": "str",
    "--sagemaker-thread-count": "int",
    "--vertex-ai-port": "int",
    "--vertex-ai-thread-count": "int",
    "--vertex-ai-default-model": "str",
    "--allow-gpu-metrics": "bool",
    "--allow-cpu-metrics": "bool",
    "--metrics-interval-ms": "float",
    "--metrics-config": "str",
    # Triton's deprecated trace flags (its own trace files; see --trace-config).
    "--trace-file": "str",
    "--trace-level": "str",
    "--trace-rate": "int",
    "--trace-count": "int",
    "--trace-log-frequency": "int",
}
"""The ``tritonserver`` flags accepted and ignored, with the type of their value."""

GRPC_CHANNEL_ARGS: dict[str, str] = {
    "--grpc-keepalive-time": "grpc.keepalive_time_ms",
    "--grpc-keepalive-timeout": "grpc.keepalive_timeout_ms",
    "--grpc-keepalive-permit-without-calls": "grpc.keepalive_permit_without_calls",
    "--grpc-http2-max-pings-without-data": "grpc.http2.max_pings_without_data",
    "--grpc-http2-min-recv-ping-interval-without-data": (
        "grpc.http2.min_ping_interval_without_data_ms"
    ),
    "--grpc-http2-max-ping-strikes": "grpc.http2.max_ping_strikes",
    "--grpc-max-connection-age": "grpc.max_connection_age_ms",
    "--grpc-max-connection-age-grace": "grpc.max_connection_age_grace_ms",
    "--reuse-grpc-port": "grpc.so_reuseport",
}
"""Triton's gRPC flags that are grpcio server options (Triton sets the same ones)."""
_BOOLEAN_ARGS = ("--grpc-keepalive-permit-without-calls", "--reuse-grpc-port")

REFUSED_WHEN_TRUE: dict[str, str] = {
    "--grpc-use-ssl": "gRPC over TLS is not offered yet: put a TLS-terminating proxy in front",
    "--grpc-use-ssl-mutual": "gRPC over TLS is not offered yet: put a TLS-terminating proxy "
    "in front",
    "--allow-sagemaker": "there is no SageMaker endpoint",
    "--allow-vertex-ai": "there is no Vertex AI endpoint",
}
"""Boolean flags accepted as false (orchestrion's behaviour), refused as true."""


class HelpFormatter(argparse.HelpFormatter):
    """argparse's help layout, without breaking a flag's name at its hyphens (the
    compatibility group's description lists dozens)."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        text = self._whitespace_matcher.sub(" ", text).strip()
        return textwrap.fill(
            text,
            width,
            initial_indent=indent,
            subsequent_indent=indent,
            break_on_hyphens=False,
        )

    def _split_lines(self, text: str, width: int) -> list[str]:
        text = self._whitespace_matcher.sub(" ", text).strip()
        return textwrap.wrap(text, width, break_on_hyphens=False)


def _dest(flag: str) -> str:
    return "triton_" + flag.removeprefix("--").replace("-", "_")


def add_triton_flags(serve: argparse.ArgumentParser) -> None:
    """Declare the ``tritonserver`` flags of the module docstring, in their own group."""
    group = serve.add_argument_group(
        "tritonserver compatibility",
        "Triton's other flags, so that a tritonserver launch line starts as it is. Accepted "
        "and ignored, with one warning naming those given: "
        + ", ".join(IGNORED)
        + ". Refused when true: "
        + ", ".join(REFUSED_WHEN_TRUE)
        + ".",
    )
    group.add_argument(
        "--exit-on-error",
        type=flag_value,
        nargs="?",
        const=True,
        default=_DEFAULTS["exit_on_error"].default,
        metavar="BOOL",
        help="a model that fails to load at start stops the start (default: true); false: "
        "it is left out, listed UNAVAILABLE with the reason, and the others are served "
        "(readiness as --strict-readiness says)",
    )
    group.add_argument(
        "--id",
        dest="server_id",
        default=_DEFAULTS["server_id"].default,
        metavar="NAME",
        help="the server's name in its metadata (GET /v2, ServerMetadata; default: "
        "orchestrion): Triton's clients that check it for 'triton' need --id triton",
    )
    group.add_argument(
        "--disable-auto-complete-config",
        action="store_true",
        help="no config completion: every model folder needs a complete config.pbtxt, and "
        "a python model's auto_complete_config is not called",
    )
    group.add_argument(
        "--strict-model-config",
        type=flag_value,
        nargs="?",
        const=True,
        default=None,
        metavar="BOOL",
        help="deprecated (as in Triton): true is --disable-auto-complete-config (default: false)",
    )
    group.add_argument(
        "--model-config-name",
        default="",
        metavar="NAME",
        help="read <model>/configs/NAME.pbtxt instead of config.pbtxt where it exists "
        "(default: config.pbtxt)",
    )
    group.add_argument(
        "--backend-directory",
        default=TRITON_BACKEND_DIRECTORY,
        metavar="DIR",
        help="where python-based backends are: a config's backend NAME that is not "
        "python, jax or onnxruntime runs DIR/NAME/model.py (default: %(default)s)",
    )
    _add_log_flags(group)
    for flag in GRPC_CHANNEL_ARGS:
        kind = "bool" if flag in _BOOLEAN_ARGS else "int"
        group.add_argument(
            flag,
            dest=_dest(flag),
            type=_TYPES[kind],
            nargs="?" if kind == "bool" else None,
            const=True if kind == "bool" else None,
            metavar="BOOL" if kind == "bool" else "N",
            help=f"grpcio's {GRPC_CHANNEL_ARGS[flag]}, as Triton sets it (default: grpcio's)",
        )
    for flag, kind in IGNORED.items():
        _add_accepted(group, flag, kind)
    for flag in REFUSED_WHEN_TRUE:
        _add_accepted(group, flag, "bool")


def _add_accepted(group: argparse._ArgumentGroup, flag: str, kind: str) -> None:
    """A flag taken with Triton's value type (repeatable; a boolean also bare), not shown
    in ``--help`` one by one: the group's description lists them."""
    group.add_argument(
        flag,
        dest=_dest(flag),
        action="append",
        type=_TYPES[kind],
        nargs="?" if kind == "bool" else None,
        const=True if kind == "bool" else None,
        help=argparse.SUPPRESS,
    )


def _add_log_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--log-verbose",
        type=_verbosity,
        default=0,
        metavar="LEVEL",
        help="0: INFO logging (the default); above 0 (or true): DEBUG too",
    )
    for level in ("info", "warning", "error"):
        group.add_argument(
            f"--log-{level}",
            type=flag_value,
            nargs="?",
            const=True,
            default=True,
            metavar="BOOL",
            help=f"log {level.upper()} records (default: true)",
        )
    group.add_argument(
        "--log-format",
        choices=[f.value for f in LogFormat],
        default=None,
        help='Triton\'s line layouts: default (I1202 04:00:15.287454 PID FILE:LINE] "...") or '
        'ISO8601 (2025-12-02T04:00:15Z I PID FILE:LINE] "...") (default: orchestrion\'s '
        "layout, with the logger's name)",
    )
    group.add_argument(
        "--log-file",
        type=Path,
        metavar="PATH",
        help="append the log to PATH instead of writing it to standard error (start-up "
        "lines still go to standard output)",
    )


@attrs.frozen(kw_only=True)
class TritonSettings:
    """What the ``tritonserver`` flags of `add_triton_flags` ask for."""

    exit_on_error: bool
    server_id: str
    reading: ConfigReading
    grpc_channel_args: tuple[tuple[str, int], ...]
    logs: LogSettings


def triton_settings(args: argparse.Namespace, console: Console) -> TritonSettings:
    """The honoured flags' settings; warnings (the flags ignored, the deprecated one) go
    to ``console``.

    Raises:
        ConfigError: a refused flag was given (switched on).
    """
    given = {flag: getattr(args, _dest(flag)) for flag in (*IGNORED, *REFUSED_WHEN_TRUE)}
    for flag, reason in REFUSED_WHEN_TRUE.items():
        if any(given[flag] or ()):
            raise ConfigError(f"{flag}=true is not supported: {reason}")
    ignored = [flag for flag in IGNORED if given[flag] is not None]
    if ignored:
        _warn(
            console,
            "ignoring tritonserver flags that do not apply to orchestrion: " + ", ".join(ignored),
        )
    auto_complete = True
    if args.strict_model_config is not None:
        _warn(
            console,
            "--strict-model-config is deprecated (as in Triton): use "
            "--disable-auto-complete-config",
        )
        auto_complete = not args.strict_model_config
    if args.disable_auto_complete_config:
        if args.strict_model_config is False:
            _warn(
                console,
                "--disable-auto-complete-config overrides --strict-model-config=false "
                "(as in Triton)",
            )
        auto_complete = False
    return TritonSettings(
        exit_on_error=args.exit_on_error,
        server_id=args.server_id,
        reading=ConfigReading(
            auto_complete=auto_complete,
            config_name=args.model_config_name,
            backend_directory=args.backend_directory,
        ),
        grpc_channel_args=tuple(
            (option, int(value))
            for flag, option in GRPC_CHANNEL_ARGS.items()
            if (value := getattr(args, _dest(flag))) is not None
        ),
        logs=LogSettings(
            verbose=args.log_verbose,
            info=args.log_info,
            warning=args.log_warning,
            error=args.log_error,
            format=LogFormat(args.log_format) if args.log_format else None,
            file=args.log_file,
        ),
    )


def _warn(console: Console, text: str) -> None:
    console.print(f"[yellow]warning:[/yellow] {text}", highlight=False, soft_wrap=True)
