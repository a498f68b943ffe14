"""What a load request will load, read and checked before any model code runs.

How this works: Triton takes a load in two stages, and so does orchestrion. First it polls the
repository: finds the model's folder, reads its config (or the request's ``config`` in its
place), and, when the request sends ``file:`` parameters, writes them into a folder of the
server's own (`UploadFolders`) and reads that instead. A failure here is Triton's "failed to
load '<m>', failed to poll from model repository" (`LoadRequestError`) and changes nothing.
`plan_load` is this stage; it returns a `LoadPlan`. Then model control imports the code and
loads it (Triton's "load failed for model '<m>'"). Composing models an ensemble needs that
are not loaded yet come from the repository, whichever way the ensemble came.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Sequence
from pathlib import Path

import attrs
import trio

from ..protocols import (
    CONFIG_SOURCE,
    ConfigError,
    LoadOverride,
    LoadRequestError,
    ModelConfig,
    format_model_config,
    parse_config_override,
    upload_problems,
)
from ._entries import RepositoryEntry
from ._folders import AUTO_COMPLETE, ConfigReading, scan_model_folder
from ._reader import find_model_folder, scan_closure
from ._uploads import UploadFolders

_log = logging.getLogger("orchestrion")


@attrs.frozen(kw_only=True)
class LoadPlan:
    """What a load request will load: the model folders read (its own and those of the
    composing models it needs), and how the model differs from its repository folder."""

    entries: list[RepositoryEntry]
    upload: Path | None = None
    """The server's folder holding the request's files (to remove if the load fails)."""
    fingerprint: object = None
    """With a config override alone: the repository folder's `folder_fingerprint` as it
    was read (a plain load later keeps the override while the folder is unchanged)."""


async def plan_load(
    name: str,
    request: LoadOverride,
    *,
    root: Path | None,
    loaded: set[str],
    uploads: UploadFolders,
    reading: ConfigReading = AUTO_COMPLETE,
) -> LoadPlan:
    """Read and check what loading ``name`` with ``request`` loads (Triton's poll).

    Args:
        root: the model repository.
        loaded: the models loaded now (composing models among them are not read again).
        uploads: where the request's files are written.
        reading: how configs are found and completed (the server's auto-complete and
            ``--model-config-name``).

    Raises:
        LoadRequestError: no such model folder, a config or override that is wrong, files
            that are refused; nothing is left on disk.
    """
    if request.empty:
        entries, errors = await trio.to_thread.run_sync(
            functools.partial(scan_closure, root, [name], loaded, reading=reading)
        )
        return _checked(name, LoadPlan(entries=entries), errors, root, uploads)
    if request.config is None:
        raise LoadRequestError(
            name,
            "load parameter 'config' must come with 'file:' parameters (the files make a new "
            "model folder, and the config says what it holds)",
        )
    config = override_config(name, request.config)
    if not request.files:
        return await trio.to_thread.run_sync(
            _plan_config_override, name, config, root, loaded, reading
        )
    problems = upload_problems(request.files, uploads.limits)
    if problems:
        raise LoadRequestError(name, "; ".join(problems))
    upload = await trio.to_thread.run_sync(
        uploads.write, name, format_model_config(config), request.files
    )
    try:
        entries, errors = await trio.to_thread.run_sync(
            _scan_with, upload, config, root, loaded, reading
        )
        return _checked(name, LoadPlan(entries=entries, upload=upload), errors, root, uploads)
    except BaseException:
        uploads.remove(upload)  # small, and it must happen even if cancelled
        raise


def _plan_config_override(
    name: str, config: ModelConfig, root: Path | None, loaded: set[str], reading: ConfigReading
) -> LoadPlan:
    """`plan_load` with a config override alone: the repository folder, read with it."""
    folder = find_model_folder(root, name)
    if folder is None:
        raise LoadRequestError(name, f"the model repository has no model folder '{name}'")
    fingerprint = folder_fingerprint(folder)
    entries, errors = _scan_with(folder, config, root, loaded, reading)
    return _checked(name, LoadPlan(entries=entries, fingerprint=fingerprint), errors, root, None)


def override_config(name: str, text: str) -> ModelConfig:
    """The config a load request sends, named after the model when it names none (as
    Triton fills it in).

    Raises:
        LoadRequestError: malformed (the field named), or it names another model.
    """
    try:
        config = parse_config_override(text)
    except ConfigError as exc:
        raise LoadRequestError(name, "; ".join(exc.errors)) from None
    if not config.name:
        return attrs.evolve(config, name=name)
    if config.name != name:
        raise LoadRequestError(
            name,
            f"{CONFIG_SOURCE}: field name: '{config.name:.100}' does not match the model name "
            f"'{name}' being loaded",
        )
    return config


def _scan_with(
    folder: Path, config: ModelConfig, root: Path | None, loaded: set[str], reading: ConfigReading
) -> tuple[list[RepositoryEntry], list[str]]:
    """``folder`` read with ``config`` (a load request's), then the repository folders of
    the composing models it needs that are not ``loaded``; and every problem found."""
    entry, errors = scan_model_folder(
        folder, config, override_source=CONFIG_SOURCE, reading=reading
    )
    if entry is None:
        return [], errors
    entries, more = scan_closure(root, [], loaded, [entry], reading=reading)
    return entries, [*errors, *more]


def _checked(
    name: str,
    plan: LoadPlan,
    errors: Sequence[str],
    root: Path | None,
    uploads: UploadFolders | None,
) -> LoadPlan:
    """``plan``, unless the scan found ``errors``.

    Raises:
        LoadRequestError: the errors, with the server's own paths taken out.
    """
    if not errors:
        return plan
    # The operator gets the whole story in the log; the client, paths relative to the
    # repository (where the server's files live is none of its business).
    _log.warning("loading model '%s' failed: %s", name, "\n".join(errors))
    shown = [relative_paths(line, root, uploads.root if uploads else None) for line in errors]
    raise LoadRequestError(name, "; ".join(shown))


def relative_paths(text: str, repository: Path | None, uploads: Path | None) -> str:
    """``text`` with paths in ``repository`` relative to it, paths in ``uploads`` relative
    to their request's folder (``<uploads>/<random>/<model>/...`` as ``<model>/...``), and
    the repository itself named so."""
    for root in (repository, uploads):
        if root is None:
            continue
        for shown in sorted({str(root), str(root.resolve())}, key=len, reverse=True):
            if root is uploads:
                text = re.sub(re.escape(shown) + r"/[^/\s]+/", "", text)
            text = text.replace(f"{shown}/", "").replace(f"{shown}: ", f"{shown} ")
            text = text.replace(shown, "the model repository")
    return text


def folder_fingerprint(folder: Path) -> object:
    """Every file's path, size and modification time in ``folder`` (byte caches left out)."""
    return tuple(
        sorted(
            (str(p.relative_to(folder)), p.stat().st_size, p.stat().st_mtime_ns)
            for p in folder.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts
        )
    )
