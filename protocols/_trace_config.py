"""Tracing settings from Triton's ``--trace-config`` flags.

Global settings are ``<key>=<value>`` (``mode=opentelemetry``, ``rate=N``, ``level=...``);
settings of the OpenTelemetry mode are ``opentelemetry,<key>=<value>`` (``url``,
``resource`` (repeatable, ``name=value``), ``protocol``). As in Triton, ``rate=N`` samples
one request in N. Whatever is not given falls back to the standard ``OTEL_*`` variables.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

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
    settings = _Settings()
    errors: list[str] = []
    for flag in items:
        head, equals, value = flag.partition("=")
        scope, _, key = head.rpartition(",")
        scope, key = scope.strip(), key.strip()
        setter = _SETTERS.get((scope, key))
        if not equals or not key or scope not in ("", "opentelemetry"):
            errors.append(f"--trace-config {flag!r} is malformed; expected {TRACE_FORMAT}")
        elif setter is None:
            where = f"{scope}," if scope else ""
            errors.append(
                f"--trace-config {where}{key}: unknown key (global: mode, rate, level, count; "
                "opentelemetry: url, protocol, resource)"
            )
        else:
            problem = setter(settings, value)
            if problem is not None:
                errors.append(f"--trace-config {problem}")
    if settings.mode != "opentelemetry":
        errors.append(
            f"--trace-config mode={settings.mode}: orchestrion traces with opentelemetry only"
        )
    if errors:
        raise ConfigError(errors)
    if settings.level == "OFF":
        return None
    return TraceConfig(
        rate=settings.rate, url=settings.url, protocol=settings.protocol, resource=settings.resource
    )


@attrs.define
class _Settings:
    """The flags read so far."""

    mode: str = "opentelemetry"
    level: str = "TIMESTAMPS"
    rate: int = 1
    url: str | None = None
    protocol: str | None = None
    resource: dict[str, str] = attrs.field(factory=dict)


def _mode(settings: _Settings, value: str) -> str | None:
    settings.mode = value.strip()
    return None


def _level(settings: _Settings, value: str) -> str | None:
    settings.level = value.strip().upper()
    if settings.level not in ("TIMESTAMPS", "OFF"):
        return f"level={value}: orchestrion traces TIMESTAMPS or OFF"
    return None


def _rate(settings: _Settings, value: str) -> str | None:
    try:
        settings.rate = int(value)
    except ValueError:
        settings.rate = 0
    return None if settings.rate >= 1 else f"rate={value}: a positive integer (1 in N sampled)"


def _count(settings: _Settings, value: str) -> str | None:
    return None if value.strip() == "-1" else "count: only -1 (no limit) is supported"


def _url(settings: _Settings, value: str) -> str | None:
    settings.url = value.strip()
    return None


def _protocol(settings: _Settings, value: str) -> str | None:
    settings.protocol = value.strip()
    if settings.protocol not in ("http/protobuf", "grpc"):
        return f"opentelemetry,protocol={value}: http/protobuf or grpc"
    return None


def _resource(settings: _Settings, value: str) -> str | None:
    name, eq, attribute = value.partition("=")
    if not eq or not name.strip():
        return f"opentelemetry,resource={value}: expected <name>=<value>"
    settings.resource[name.strip()] = attribute
    return None


_SETTERS: dict[tuple[str, str], Callable[[_Settings, str], str | None]] = {
    ("", "mode"): _mode,
    ("", "level"): _level,
    ("", "rate"): _rate,
    ("", "count"): _count,
    ("opentelemetry", "url"): _url,
    ("opentelemetry", "protocol"): _protocol,
    ("opentelemetry", "resource"): _resource,
}
"""Each key's setter, by scope (empty: global): None, or what is wrong with the value."""
