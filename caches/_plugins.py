"""Finding a cache by name: the ``orchestrion.caches`` entry-point group.

``local`` and ``redis`` are registered there by orchestrion's own packaging, exactly like a
third-party cache, so all three are found (and tested) the same way.
"""

from __future__ import annotations

import inspect
from importlib.metadata import EntryPoint, entry_points

from ..protocols import CacheConfig, ConfigError
from ._protocol import CacheFactory, ResponseCache

GROUP = "orchestrion.caches"


def available_caches() -> list[str]:
    """Names of the installed caches, sorted."""
    return sorted({ep.name for ep in entry_points(group=GROUP)})


def find_cache_factory(name: str) -> CacheFactory:
    """The factory registered under ``name``.

    Raises:
        ConfigError: no cache of that name is installed, or its entry point fails to import.
    """
    found: list[EntryPoint] = [ep for ep in entry_points(group=GROUP) if ep.name == name]
    if not found:
        raise ConfigError(
            f"--cache-config {name}: no cache named '{name}' is installed (installed: "
            f"{', '.join(available_caches()) or 'none'}; a plugin registers its factory in "
            f"the entry-point group '{GROUP}')"
        )
    entry = found[0]
    try:
        factory = entry.load()
    except Exception as exc:
        raise ConfigError(
            f"--cache-config {name}: the cache's entry point {entry.value!r} failed to "
            f"import: {type(exc).__name__}: {exc}"
        ) from exc
    if not callable(factory):
        raise ConfigError(f"--cache-config {name}: entry point {entry.value!r} is not callable")
    return factory  # type: ignore[no-any-return]


async def open_cache(config: CacheConfig) -> ResponseCache:
    """Create the cache ``config`` names, through its entry point.

    Raises:
        ConfigError: unknown cache, bad options, or a factory that returned no cache.
        CacheUnavailableError: the backend cannot be reached.
    """
    made = find_cache_factory(config.name)(config)
    cache = await made if inspect.isawaitable(made) else made
    if not isinstance(cache, ResponseCache):
        raise ConfigError(
            f"--cache-config {config.name}: the factory returned {type(cache).__name__}, "
            "not an orchestrion.caches.ResponseCache"
        )
    return cache
