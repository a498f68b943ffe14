"""Reading models from a repository folder for the registry to load (nothing is loaded here).

How this works. `read_repository` scans the folder in a worker thread (the file system may
be slow): every model folder, or only the named ones plus, for each ensemble among them, the
composing models it needs that are not loaded yet (`scan_closure`, recursively through nested
ensembles). Every problem of the scan is reported together, files and fields named. Only then
is each selected version's ``model.py`` imported (`load_code`, also in a worker thread), again
reporting every failure together.
"""

from __future__ import annotations

import functools
from collections.abc import Container, Sequence
from pathlib import Path

import trio

from ..backends import forget_model
from ..protocols import ConfigError, Model, ModelLoadError
from ._entries import RepositoryEntry
from ._folders import (
    AUTO_COMPLETE,
    ConfigReading,
    load_model_code,
    scan_model_folder,
    scan_repository,
)


async def read_repository(
    root: Path,
    names: Sequence[str] | None,
    loaded: Container[str],
    *,
    reading: ConfigReading = AUTO_COMPLETE,
) -> list[Model]:
    """Read models from the repository folder ``root``: all of them, or ``names`` plus the
    composing models their ensembles need that are not in ``loaded`` (configs found and
    completed as ``reading`` says).

    Raises:
        ConfigError: the repository or a config is wrong (files and fields named).
        ModelLoadError: a ``model.py`` failed to import.
    """
    if names is None:
        entries, errors = await trio.to_thread.run_sync(
            functools.partial(scan_repository, root, reading=reading)
        )
    else:
        entries, errors = await trio.to_thread.run_sync(
            functools.partial(scan_closure, root, list(names), loaded, reading=reading)
        )
    if errors:
        raise ConfigError(errors)
    return await trio.to_thread.run_sync(load_code, entries)


def scan_closure(
    root: Path | None,
    names: list[str],
    loaded: Container[str],
    found: Sequence[RepositoryEntry] = (),
    *,
    reading: ConfigReading = AUTO_COMPLETE,
) -> tuple[list[RepositoryEntry], list[str]]:
    """The model folders ``names`` of ``root``, and those of the composing models their
    ensembles (and those of ``found``, folders read already) use that are not in
    ``loaded``; and every problem found."""
    entries: dict[str, RepositoryEntry] = {entry.name: entry for entry in found}
    errors: list[str] = []
    todo = list(names)
    for entry in found:
        if entry.config.ensemble_scheduling is not None:
            todo.extend(s.model_name for s in entry.config.ensemble_scheduling.step)
    todo = [name for name in todo if name not in loaded or name in names]
    while todo:
        name = todo.pop()
        if name in entries:
            continue
        folder = find_model_folder(root, name)
        if folder is None:
            errors.append(f"{root or 'the server'}: has no model folder {name!r:.80}")
            continue
        scanned, problems = scan_model_folder(folder, reading=reading)
        errors.extend(problems)
        if scanned is None:
            continue
        entries[name] = scanned
        sched = scanned.config.ensemble_scheduling
        if sched is not None:
            todo.extend(
                s.model_name
                for s in sched.step
                if s.model_name not in loaded and s.model_name not in entries
            )
    return list(entries.values()), errors


def find_model_folder(root: Path | None, name: str) -> Path | None:
    """The folder of model ``name`` in ``root``, if there is one (never one outside it)."""
    if root is None:
        return None
    try:
        folder = (root / name).resolve()
        return folder if folder.parent == root.resolve() and folder.is_dir() else None
    except OSError:  # a name the file system cannot hold (too long, say)
        return None


def load_code(entries: Sequence[RepositoryEntry]) -> list[Model]:
    """Import every selected version; report all failures together.

    Raises:
        ConfigError: only contract violations were found.
        ModelLoadError: some file failed to import (contract violations listed too).
    """
    models: list[Model] = []
    broken: list[str] = []
    failed_import = False
    for entry in entries:
        for version in entry.versions:
            try:
                models.append(load_model_code(entry, version))
            except ConfigError as exc:
                broken.extend(exc.errors)
            except ModelLoadError as exc:
                broken.append(str(exc))
                failed_import = True
    if broken:  # none of them loads: what was imported leaves sys.modules
        for model in models:
            forget_model(model)
    if failed_import:
        raise ModelLoadError("\n".join(broken))
    if broken:
        raise ConfigError(broken)
    return models
