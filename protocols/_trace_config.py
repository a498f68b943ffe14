"""Tracing settings from Triton's ``--trace-config`` flags.

Global settings are ``<key>=<value>`` (``mode=opentelemetry``, ``rate=N``, ``level=...``);
settings of the OpenTelemetry mode are ``opentelemetry,<key>=<value>`` (``url``,
``resource`` (repeatable, ``name=value``), ``protocol``). As in Triton, ``rate=N`` samples
one request in N. Whatever is not given falls back to the standard ``OTEL_*`` variables.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs

from ._errors import ConfigError

TRACE_FORMAT = (
    "<key>=<value> or opentelemetry,<key>=<value> (for example mode=opentelemetry, rate=100, "
    "opentelemetry,url=http://localhost:4318/v1/traces)"
)


@attrs.frozen(kw_only=True)
class TraceConfig:
    """How the server traces requests."""

    rate: int = 1
    """Sample one request in ``rate`` (1: every request)."""
    url: str | None = None
    """The OTLP endpoint; None: ``OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT`` or the default."""
    protocol: str | None = None
    """``http/protobuf`` or ``grpc``; None: ``OTEL_EXPORTER_OTLP_(TRACES_)PROTOCOL``."""
    resource: Mapping[str, str] = attrs.field(factory=dict)
    """Resource attributes (``service.name`` and the like)."""


def parse_trace_config(flags: str | Sequence[str] | None) -> TraceConfig | None:
    """Turn ``--trace-config`` flags into settings.

    Returns:
        the settings, or None when tracing is off (no flags, ``mode`` not opentelemetry,
        or ``level=OFF``).

    Raises:
        ConfigError: a malformed flag, an unknown key, or a value of the wrong kind.
    """
    items = [flags] if isinstance(flags, str) else list(flags or ())
    if not items:
        return None
    mode, level = "opentelemetry", "TIMESTAMPS"
    rate, url, protocol = 1, None, None
    resource: dict[str, str] = {}
    errors: list[str] = []
    for flag in items:
        head, equals, value = flag.partition("=")
        scope, _, key = head.rpartition(",")
        scope, key = scope.strip(), key.strip()
        if not equals or not key or scope not in ("", "opentelemetry"):
            errors.append(f"--trace-config {flag!r} is malformed; expected {TRACE_FORMAT}")
        elif scope == "" and key == "mode":
            mode = value.strip()
        elif scope == "" and key == "level":
            level = value.strip().upper()
            if level not in ("TIMESTAMPS", "OFF"):
                errors.append(f"--trace-config level={value}: orchestrion traces TIMESTAMPS or OFF")
        elif scope == "" and key == "rate":
            try:
                rate = int(value)
            except ValueError:
                rate = 0
            if rate < 1:
                errors.append(f"--trace-config rate={value}: a positive integer (1 in N sampled)")
        elif scope == "" and key == "count":
            if value.strip() != "-1":
                errors.append("--trace-config count: only -1 (no limit) is supported")
        elif scope == "opentelemetry" and key == "url":
            url = value.strip()
        elif scope == "opentelemetry" and key == "protocol":
            protocol = value.strip()
            if protocol not in ("http/protobuf", "grpc"):
                errors.append(
                    f"--trace-config opentelemetry,protocol={value}: http/protobuf or grpc"
                )
        elif scope == "opentelemetry" and key == "resource":
            name, eq, attribute = value.partition("=")
            if not eq or not name.strip():
                errors.append(
                    f"--trace-config opentelemetry,resource={value}: expected <name>=<value>"
                )
            else:
                resource[name.strip()] = attribute
        else:
            where = f"{scope}," if scope else ""
            errors.append(
                f"--trace-config {where}{key}: unknown key (global: mode, rate, level, count; "
                "opentelemetry: url, protocol, resource)"
            )
    if mode != "opentelemetry":
        errors.append(f"--trace-config mode={mode}: orchestrion traces with opentelemetry only")
    if errors:
        raise ConfigError(errors)
    if level == "OFF":
        return None
    return TraceConfig(rate=rate, url=url, protocol=protocol, resource=resource)
