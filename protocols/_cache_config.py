"""The server's cache settings, parsed from Triton's flags.

``--cache-config <name>,<key>=<value>`` is repeatable, one key per flag (everything after the
first ``=`` is the value, so a value may hold commas); all flags must name the same cache.
``--response-cache-byte-size N`` is Triton's deprecated spelling of ``local,size=N``. Which
keys a cache accepts is the cache's business; the helpers below give every cache the same
error messages.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping, Sequence

import attrs

from ._errors import ConfigError

FORMAT = "<name>,<key>=<value> (for example local,size=1048576 or redis,host=localhost)"
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*$")
_ANOTHER_KEY = re.compile(r",\s*[A-Za-z_][A-Za-z0-9_]*=")


@attrs.frozen(kw_only=True)
class CacheConfig:
    """Which cache the server uses and its settings (values as strings, as on the CLI)."""

    name: str
    options: Mapping[str, str] = attrs.field(factory=dict)


def parse_cache_config(
    cache_config: str | Sequence[str] | None,
    *,
    response_cache_byte_size: int | None = None,
) -> CacheConfig | None:
    """Turn ``--cache-config`` flags (and the deprecated byte-size flag) into settings.

    Args:
        cache_config: one flag's value or several (``"local,size=1048576"``); None or
            empty: no cache unless ``response_cache_byte_size`` is given.
        response_cache_byte_size: the deprecated ``--response-cache-byte-size``; warns.

    Returns:
        the settings, or None when no cache is configured.

    Raises:
        ConfigError: a malformed flag, two cache names, a key given twice, or both flags.
    """
    flags = [cache_config] if isinstance(cache_config, str) else list(cache_config or ())
    if response_cache_byte_size is not None:
        warnings.warn(
            "--response-cache-byte-size is deprecated (as in Triton); use "
            f"--cache-config local,size={response_cache_byte_size}",
            DeprecationWarning,
            stacklevel=2,
        )
        if flags:
            raise ConfigError(
                "--response-cache-byte-size and --cache-config cannot be used together; "
                f"use only --cache-config {FORMAT}"
            )
        flags = [f"local,size={response_cache_byte_size}"]
    if not flags:
        return None
    name: str | None = None
    options: dict[str, str] = {}
    errors: list[str] = []
    for flag in flags:
        if not isinstance(flag, str):
            errors.append(f"--cache-config takes strings, got {type(flag).__name__}")
            continue
        cache, comma, setting = flag.partition(",")
        key, equals, value = setting.partition("=")
        cache, key = cache.strip(), key.strip()
        if not comma or not equals or not key or not _NAME.match(cache):
            errors.append(f"--cache-config {flag!r} is malformed; expected {FORMAT}")
            continue
        if _ANOTHER_KEY.search(value):
            errors.append(
                f"--cache-config {flag!r}: one <key>=<value> per flag (Triton's format); "
                f"repeat the flag for each key, e.g. --cache-config {cache},{key}=... "
                f"--cache-config {cache},<other key>=..."
            )
            continue
        if name is not None and cache != name:
            errors.append(
                f"--cache-config names two caches, '{name}' and '{cache}'; a server has one"
            )
            continue
        name = cache
        if key in options:
            errors.append(f"--cache-config {cache}: '{key}' is given twice")
            continue
        options[key] = value
    if errors:
        raise ConfigError(errors)
    assert name is not None
    return CacheConfig(name=name, options=options)


def option_int(
    config: CacheConfig,
    key: str,
    default: int | None = None,
    *,
    minimum: int | None = None,
) -> int:
    """An integer option of ``config``.

    Raises:
        ConfigError: missing with no default, not an integer, or below ``minimum``.
    """
    raw = config.options.get(key)
    if raw is None:
        if default is None:
            raise ConfigError(
                f"--cache-config {config.name}: '{key}' is required "
                f"(--cache-config {config.name},{key}=<integer>)"
            )
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        raise ConfigError(
            f"--cache-config {config.name},{key}={raw}: '{key}' must be an integer"
        ) from None
    if minimum is not None and value < minimum:
        raise ConfigError(
            f"--cache-config {config.name},{key}={raw}: '{key}' must be at least {minimum}"
        )
    return value


def option_bool(config: CacheConfig, key: str, default: bool = False) -> bool:
    """A boolean option (true/false, 1/0, yes/no, on/off).

    Raises:
        ConfigError: not a boolean.
    """
    raw = config.options.get(key)
    if raw is None:
        return default
    word = raw.strip().lower()
    if word in ("1", "true", "yes", "on"):
        return True
    if word in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"--cache-config {config.name},{key}={raw}: '{key}' must be true or false")


def check_option_names(config: CacheConfig, known: Sequence[str]) -> None:
    """Refuse keys the cache does not know (a typo must not be ignored silently).

    Raises:
        ConfigError: naming the unknown keys and listing the known ones.
    """
    unknown = sorted(set(config.options) - set(known))
    if unknown:
        raise ConfigError(
            f"--cache-config {config.name}: unknown "
            + ("keys " if len(unknown) > 1 else "key ")
            + ", ".join(f"'{k}'" for k in unknown)
            + f" (known: {', '.join(known)})"
        )
