"""Model control for the network front ends (Triton's ``--model-control-mode``), and their
graceful stop (`Shutdown`).

``none``: the whole repository is loaded at start and the load/unload API is refused.
``explicit``: only ``--load-model`` names (``*`` for all) are loaded at start; the API loads and
unloads, a load possibly with Triton's ``config`` override and ``file:`` parameters (read by
`orchestrion.repository.plan_load`; the files go into folders of the server's own,
`orchestrion.repository.UploadFolders`, removed with their model). ``poll``: the whole repository
at start, then every ``poll_interval`` seconds a changed model folder is reloaded, a new one
loaded and a removed one unloaded; the API is refused. Readiness (``/v2/health/ready``) is
false while the server stops, and, with strict readiness, while a model that should be loaded
is not.

Triton's ``--exit-on-error=false``: the models are loaded one by one at start
(`load_at_start` with ``exit_on_error=False``); those that fail are left out, logged, and
listed ``UNAVAILABLE`` in the repository index with the reason (`failures`), and the server
serves the others. Later failed loads (the API, poll mode) are listed the same way until the
model loads.

A `Shutdown` passed to `serve` and to the front ends stops them gracefully when requested: each
stops taking new work at once, gives the work in flight its exit timeout, and returns.
Cancelling them instead stops them at once, as trio's ``serve_listeners``.
"""

from __future__ import annotations

import contextlib
import enum
import logging
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from pathlib import Path

import attrs
import trio

from .._server import AsyncServer
from ..actors import LoadLock
from ..protocols import (
    ConfigError,
    InvalidRequestError,
    LoadOverride,
    LoadRequestError,
    ModelControlError,
    ModelLoadError,
    OrchestrionError,
)
from ..repository import (
    AUTO_COMPLETE,
    ConfigReading,
    LoadPlan,
    UploadFolders,
    find_model_folder,
    folder_fingerprint,
    is_model_folder,
    load_code,
    plan_load,
    relative_paths,
)

_log = logging.getLogger("orchestrion")

DEFAULT_EXIT_TIMEOUT = 30.0
"""Triton's ``--exit-timeout-secs`` default: how long a graceful stop lets work in flight
finish (seconds)."""


class ModelControlMode(enum.StrEnum):
    """Triton's ``--model-control-mode`` (see the module docstring); a `str`, so
    ``mode == "poll"`` holds for `POLL`."""

    NONE = "none"
    EXPLICIT = "explicit"
    POLL = "poll"


def _control_mode(value: str) -> ModelControlMode:
    try:
        return ModelControlMode(value)
    except ValueError:
        raise ValueError(
            f"model control mode must be one of {', '.join(ModelControlMode)}"
        ) from None


@attrs.define(eq=False)
class Shutdown:
    """A graceful stop, asked for from outside the servers it is passed to (`serve`,
    `serve_http_api`, `serve_grpc_api`): `request` (a signal handler calls it) begins it.

    Use it on the trio thread. Without one, or until it is requested, those servers run
    until cancelled, and cancelling them stops them at once.
    """

    _requested: bool = attrs.field(default=False, init=False)
    _actions: list[Callable[[], None]] = attrs.field(factory=list, init=False)

    @property
    def requested(self) -> bool:
        """Whether `request` has been called."""
        return self._requested

    def request(self) -> None:
        """Begin the graceful stop of every server this was passed to (later calls do
        nothing): the actions of the open `on_request` blocks run now, in order."""
        if self._requested:
            return
        self._requested = True
        for action in list(self._actions):
            action()

    @contextlib.contextmanager
    def on_request(self, action: Callable[[], None]) -> Iterator[None]:
        """Within the block, ``action`` (which begins a server's graceful stop, without
        waiting) runs when the stop is requested, or on entry if it has been already."""
        if self._requested:
            action()
            yield
            return
        self._actions.append(action)
        try:
            yield
        finally:
            self._actions.remove(action)


@attrs.frozen(kw_only=True)
class _Override:
    """How a loaded model differs from its repository folder: its folder of uploaded files,
    or (a config override alone) the fingerprint its repository folder had then."""

    upload: Path | None
    folder: object


@attrs.define(eq=False)
class ModelControl:
    """Loads, unloads and reports the models of a served repository."""

    server: AsyncServer
    mode: ModelControlMode = attrs.field(default=ModelControlMode.NONE, converter=_control_mode)
    strict_readiness: bool = True
    uploads: UploadFolders = attrs.field(factory=UploadFolders)
    """Where the files of load requests are written (and their limits)."""
    config_reading: ConfigReading = AUTO_COMPLETE
    """How load requests find and complete configs (the server's own reading)."""
    api_refusal: str | None = None
    """Why load and unload requests are refused whatever the mode (None: they are not)."""
    _expected: set[str] = attrs.field(factory=set, init=False)
    """Models that should be serving (for strict readiness)."""
    _failed: dict[str, str] = attrs.field(factory=dict, init=False)
    """Models whose last load failed, and why (paths relative to the repository)."""
    _accepting: bool = attrs.field(default=True, init=False)
    _overrides: dict[str, _Override] = attrs.field(factory=dict, init=False)
    """Loaded models that differ from their repository folder, by name."""
    _lock: LoadLock = attrs.field(factory=LoadLock, init=False)
    """One load or unload at a time, so that the folders held always match what is loaded."""

    def __attrs_post_init__(self) -> None:
        self._expected = set(self.server.model_names())

    def ready(self) -> bool:
        """Whether the server is ready for requests (``/v2/health/ready``)."""
        if not self._accepting:
            return False
        if not self.strict_readiness:
            return True
        return all(self.server.is_model_ready(name) for name in self._expected)

    def stop_accepting(self) -> None:
        """Report not-ready from now on (the server is stopping)."""
        self._accepting = False

    def available(self) -> list[str]:
        """Names of the repository's model folders (loaded or not)."""
        root = self.server.model_repository
        return [folder.name for folder in model_folders(root)] if root is not None else []

    def failures(self) -> dict[str, str]:
        """The models whose last load failed and are not loaded, with the reason (for the
        repository index)."""
        return dict(self._failed)

    def _failed_to_load(self, name: str, error: Exception) -> None:
        """Record that ``name`` failed to load, unless a version of it serves on (paths
        relative to the repository, as a client sees them)."""
        if name not in self.server.model_names():
            root = self.server.model_repository
            self._failed[name] = relative_paths(str(error), root, self.uploads.root)

    def _check_allowed(self, what: str) -> None:
        if self.mode is not ModelControlMode.EXPLICIT:
            raise ModelControlError(
                f"explicit model load / unload is not allowed in model control mode "
                f"'{self.mode}' (start the server with --model-control-mode=explicit)"
            )
        if self.api_refusal is not None:
            raise ModelControlError(self.api_refusal)

    async def load(
        self,
        name: str,
        override: LoadOverride | None = None,
        *,
        room: Callable[[LoadPlan], Awaitable[None]] | None = None,
        if_absent: bool = False,
    ) -> None:
        """Load (or reload) ``name``, with the composing models its ensembles need, as
        Triton does: from the repository; with ``override.config`` in place of its
        ``config.pbtxt``; or, with ``override.files`` too, from a folder of the server's
        own holding those files (see the module docstring of ``_uploads``).

        A plain load of a model loaded with a config override keeps that override while
        the model's folder is unchanged (Triton's answer: nothing to reload); once the folder
        changed, or after files, it reloads from the repository.

        Raises:
            ModelControlError: the mode is not ``explicit``.
            InvalidRequestError: the name is not a folder name.
            LoadRequestError: no such model folder, or its config, the override or the files
                are wrong or refused (Triton's "failed to load '<m>', failed to poll from
                model repository"); nothing changes.
            ModelLoadError: the model's code failed, or the set of models would be invalid
                (Triton's "load failed for model '<m>'"); what was serving serves on.

        ``room``: called with the plan, under the lock, before anything loads (it may
        unload models through `unload_held`: models loaded on demand make room so).
        ``if_absent``: nothing happens when ``name`` is loaded by the time the lock is held
        (another load brought it in: an ensemble's step, say).
        """
        self._check_allowed("load")
        _check_name(name)
        request = override or LoadOverride()
        async with self._lock.hold():
            if if_absent and name in self.server.model_names():
                return
            if request.empty and await self._override_kept(name):
                _log.info("model '%s' unchanged since its config override: kept", name)
                return
            try:
                plan = await plan_load(
                    name,
                    request,
                    root=self.server.model_repository,
                    loaded=set(self.server.model_names()),
                    uploads=self.uploads,
                    reading=self.config_reading,
                )
            except LoadRequestError as exc:
                if request.files or name in self.available():  # not a name of nothing
                    self._failed_to_load(name, exc)
                raise
            try:
                if room is not None:
                    await room(plan)
                await self._load_planned(name, plan)
            except BaseException as exc:
                if plan.upload is not None:
                    self.uploads.remove(plan.upload)  # small, and it must run if cancelled
                if isinstance(exc, ModelLoadError):
                    self._failed_to_load(name, exc)
                raise
            self._expected.add(name)
            self._failed.pop(name, None)
            previous = self._overrides.pop(name, None)
            if not request.empty:
                self._overrides[name] = _Override(upload=plan.upload, folder=plan.fingerprint)
            if previous is not None and previous.upload is not None:
                await trio.to_thread.run_sync(self.uploads.remove, previous.upload)
        _log.info("loaded model '%s'%s", name, "" if request.empty else " (load request override)")

    async def _override_kept(self, name: str) -> bool:
        """Whether ``name`` runs with a config override whose repository folder has not
        changed since it was loaded (a plain load then changes nothing, as in Triton)."""
        kept = self._overrides.get(name)
        if kept is None or kept.upload is not None:
            return False
        root = self.server.model_repository

        def fingerprint() -> object:
            folder = find_model_folder(root, name)
            return folder_fingerprint(folder) if folder is not None else None

        return await trio.to_thread.run_sync(fingerprint) == kept.folder

    async def _load_planned(self, name: str, plan: LoadPlan) -> None:
        """Import the code `plan_load` found and load it (Triton's model load).

        Raises:
            ModelLoadError: "load failed for model '<name>'" and why.
        """
        try:
            models = await trio.to_thread.run_sync(load_code, plan.entries)
            await self.server.load_model(models)
        except (ConfigError, ModelLoadError) as exc:
            # The operator gets the whole story in the log; the client, paths relative to
            # the repository (where the server's files live is none of its business).
            _log.warning("loading model '%s' failed: %s", name, exc)
            shown = relative_paths(str(exc), self.server.model_repository, self.uploads.root)
            raise ModelLoadError(f"load failed for model '{name}': {shown}") from None

    async def unload(self, name: str, parameters: Mapping[str, object] | None = None) -> None:
        """Unload ``name`` (``unload_dependents``: and the ensembles that use it); the
        folders the server holds for their uploaded files are removed. A model that is not
        loaded is left as it is, and that is a success, as Triton's API defines it.

        Raises:
            ModelControlError: the mode is not ``explicit``.
            ConfigError: ensembles use it and ``unload_dependents`` is not set.
        """
        self._check_allowed("unload")
        dependents = (parameters or {}).get("unload_dependents", False)
        if not isinstance(dependents, bool):
            raise InvalidRequestError("unload parameter 'unload_dependents' must be a boolean")
        async with self._lock.hold():
            if name not in self.server.model_names():
                self._failed.pop(name, None)  # a model that failed to load: no longer wanted
                self._expected.discard(name)
                _log.info("model '%s' is not loaded: nothing to unload", name)
                return
            await self.unload_held(name, dependents=dependents)
        _log.info("unloaded model '%s'", name)

    async def unload_held(self, name: str, *, dependents: bool = False) -> None:
        """Unload ``name`` while the caller holds the load lock (a ``room`` callback of
        `load`); requests in flight finish first.

        Raises:
            ConfigError: ensembles use it and ``dependents`` is not set.
        """
        before = set(self.server.model_names())
        await self.server.unload_model(name, unload_dependents=dependents)
        gone = before - set(self.server.model_names())
        self._expected -= gone
        for model in sorted(gone):
            held = self._overrides.pop(model, None)
            if held is not None and held.upload is not None:
                await trio.to_thread.run_sync(self.uploads.remove, held.upload)

    async def load_at_start(self, names: Sequence[str], *, exit_on_error: bool = True) -> None:
        """Load ``names`` (``*``: the whole repository) at start: explicit mode's
        ``--load-model`` names, or, with ``exit_on_error=False``, what the server would load.

        ``exit_on_error=False`` (Triton's ``--exit-on-error=false``): each folder is loaded on
        its own (an ensemble with the composing models it needs), and one that fails is
        logged and listed in `failures`; it still counts for strict readiness.

        Raises:
            ConfigError, ModelLoadError: a model failed to load (``exit_on_error`` only).
        """
        if "*" in names:
            wanted = self._all_folders() if not exit_on_error else self.available()
        else:
            wanted = list(dict.fromkeys(names))
        for name in wanted:
            _check_name(name)
            if not exit_on_error and name in self.server.model_names():
                continue  # loaded already, as a composing model of an ensemble
            try:
                await self.server.load_model(name)
            except (ConfigError, ModelLoadError) as exc:
                if exit_on_error:
                    raise
                _log.error("failed to load model '%s': %s", name, exc)
                self._failed_to_load(name, exc)
        self._expected = set(self.server.model_names()) | self._failed.keys()

    def _all_folders(self) -> list[str]:
        """Every folder of the repository (as loading it whole reads them), by name: one
        that is no model folder fails to load, as at a start that exits on errors."""
        root = self.server.model_repository
        if root is None or not root.is_dir():
            return []
        return sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))

    async def poll(self, interval: float, baseline: Mapping[str, object]) -> None:
        """Poll mode: apply repository changes every ``interval`` seconds, until cancelled.

        ``baseline`` is the repository as it was before the server loaded it (see
        `repository_fingerprints`), so a change made while it loaded is not missed. A model
        that fails to load is logged and left as it was; the server keeps serving.
        """
        seen = baseline
        while True:
            await trio.sleep(interval)
            now = await trio.to_thread.run_sync(self._fingerprints)
            await self.apply_changes(seen, now)
            seen = now

    async def apply_changes(
        self, before: Mapping[str, object], after: Mapping[str, object]
    ) -> None:
        """Reload changed folders, load new ones and unload removed ones (poll mode)."""
        for name in sorted(before.keys() - after.keys()):
            self._failed.pop(name, None)
            try:
                await self.server.unload_model(name, unload_dependents=True)
                self._expected.discard(name)
                _log.info("model folder '%s' removed: unloaded", name)
            except OrchestrionError as exc:
                _log.error("model folder '%s' removed, unloading failed: %s", name, exc)
        for name in sorted(after):
            if before.get(name) == after[name]:
                continue
            try:
                await self.server.load_model(name)
                self._expected.add(name)
                self._failed.pop(name, None)
                _log.info("model folder '%s' changed: loaded", name)
            except OrchestrionError as exc:
                _log.error("model folder '%s' changed, loading failed: %s", name, exc)
                if isinstance(exc, ConfigError | ModelLoadError) and name not in (
                    self.server.model_names()
                ):
                    self._failed_to_load(name, exc)

    def _fingerprints(self) -> dict[str, object]:
        """The served repository's `repository_fingerprints`."""
        root = self.server.model_repository
        return repository_fingerprints(root) if root is not None else {}


def model_folders(root: Path) -> list[Path]:
    """The model folders of a repository (each with a config.pbtxt, or the files of a model
    whose config is completed at load), by name."""
    if not root.is_dir():
        return []
    return sorted(folder for folder in root.iterdir() if is_model_folder(folder))


def repository_fingerprints(root: Path) -> dict[str, object]:
    """Per model folder of ``root``: its `folder_fingerprint`."""
    return {folder.name: folder_fingerprint(folder) for folder in model_folders(root)}


NAME_MAX = 255
"""The longest folder name (bytes) of common file systems."""


def _check_name(name: str) -> None:
    """A model name is one folder of the repository: never a path out of it."""
    if not name or name in (".", "..") or "/" in name or "\0" in name:
        raise InvalidRequestError(f"invalid model name {name!r:.80}: a repository folder name")
    if "\\" in name:  # a path on some systems; Triton's python backend refuses it too
        raise InvalidRequestError(
            f"invalid model name {name!r:.80}: a repository folder name, without '\\' "
            "(in Triton's python backend's words: Invalid stub name: contains invalid "
            "characters)"
        )
    if Path(name).name != name:
        raise InvalidRequestError(f"invalid model name {name!r:.80}")
    if len(name.encode(errors="surrogatepass")) > NAME_MAX:
        raise InvalidRequestError(
            f"invalid model name {name!r:.80}...: longer than a folder name can be "
            f"({NAME_MAX} bytes)"
        )
