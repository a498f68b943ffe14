"""Reading a Triton-layout model repository from disk.

Layout: ``<root>/<model>/config.pbtxt`` and numbered version folders
``<root>/<model>/<version>/model.py`` (an ONNX model's: ``model.onnx``). Folder names that
are not positive integers (or that start with ``0``) are not versions and are ignored.
``version_policy`` picks which versions are served (default: the latest one). A folder
without ``config.pbtxt`` is a Triton python model (a ``model.py``) or an ONNX model (a
``model.onnx``), whose config is completed at load, as Triton does. `scan_repository` reads
configs only and reports every problem it finds; `load_model_code` imports one version's
``model.py`` (or reads its ONNX graph), and fingerprints the config and the version folder
(`revision`), so that cached answers never outlive the code. `ConfigReading` holds Triton's
server-wide rules for configs: whether they may be auto-completed (a python-backend model's
``auto_complete_config``, an ONNX model's graph, a folder without ``config.pbtxt``), and
which file of a folder is its config (``--model-config-name``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import attrs
import xxhash

from ..backends import auto_complete, complete_onnx_config, import_code_file
from ..protocols import (
    ENSEMBLE_PLATFORM,
    INITIAL_STATE_FOLDER,
    ONNX_PLATFORM,
    ConfigError,
    ModelConfig,
    ModelLoadError,
    SequenceTensors,
    VersionPolicy,
    format_model_config,
    parse_model_config,
    sequence_problems,
)
from ._definition import Model, check_model

CONFIG_FILE = "config.pbtxt"
DEFAULT_MODEL_FILE = "model.py"
DEFAULT_ONNX_FILE = "model.onnx"
_log = logging.getLogger("orchestrion")


def _config_name(value: str) -> str:
    if value and (Path(value).name != value or value in (".", "..") or " " in value):
        raise ConfigError(
            f"--model-config-name: {value!r} is not a plain file name (configs/<name>.pbtxt)"
        )
    return value


@attrs.frozen(kw_only=True)
class ConfigReading:
    """How the server finds and completes model configs (Triton's server-wide flags).

    Raises:
        ConfigError: ``config_name`` is not a plain file name.
    """

    auto_complete: bool = True
    """A python-backend model's ``auto_complete_config`` (an ONNX model's graph) completes
    its config, and may stand in for a missing ``config.pbtxt``. False (Triton's
    ``--disable-auto-complete-config``, ``--strict-model-config=true``): every model folder
    needs its complete config file (an ONNX model's is still checked against its graph)."""
    config_name: str = attrs.field(default="", converter=_config_name)
    """Read ``<model>/configs/<name>.pbtxt`` instead of ``config.pbtxt`` in the folders that
    have one (Triton's ``--model-config-name``); "": always ``config.pbtxt``."""

    def config_file(self, folder: Path) -> str:
        """The config file of ``folder``, relative to it (it may not exist)."""
        if self.config_name:
            custom = f"configs/{self.config_name}.pbtxt"
            if (folder / custom).is_file():
                return custom
        return CONFIG_FILE


AUTO_COMPLETE = ConfigReading()
"""Triton's defaults: configs are auto-completed, and read from ``config.pbtxt``."""


@attrs.frozen(kw_only=True)
class RepositoryEntry:
    """One model folder of a repository, its config read and its versions chosen."""

    name: str
    config: ModelConfig
    path: Path
    versions: tuple[int, ...]
    """The versions ``version_policy`` selects, ascending."""
    config_source: str = ""
    """Where the config came from, for error messages ("": the folder's ``config.pbtxt``)."""
    config_file: str = CONFIG_FILE
    """The folder's config file, relative to it (``configs/<name>.pbtxt`` with
    ``--model-config-name``)."""
    auto_complete: bool = True
    """Whether a python-backend model's ``auto_complete_config`` (an ONNX model's graph)
    completes the config."""

    def model_file(self, version: int) -> Path:
        """The code file of ``version`` (an ONNX model's graph; a folder of that name holds
        it as ``model.onnx``, as in Triton)."""
        onnx = self.config.is_onnx
        default = DEFAULT_ONNX_FILE if onnx else DEFAULT_MODEL_FILE
        path = self.path / str(version) / (self.config.default_model_filename or default)
        return path / DEFAULT_ONNX_FILE if onnx and path.is_dir() else path


def _version_folders(path: Path) -> list[int]:
    return sorted(
        int(p.name)
        for p in path.iterdir()
        if p.is_dir() and p.name.isdigit() and not p.name.startswith("0")
    )


def select_versions(available: Sequence[int], policy: VersionPolicy | None) -> tuple[int, ...]:
    """The versions a ``version_policy`` serves out of ``available`` (ascending)."""
    ordered = sorted(available)
    if policy is None:
        return tuple(ordered[-1:])
    if policy.all:
        return tuple(ordered)
    if policy.specific is not None:
        return tuple(v for v in ordered if v in set(policy.specific))
    return tuple(ordered[-(policy.latest or 1) :])


def _without_config(path: Path) -> ModelConfig | None:
    """The config of a model folder that has no ``config.pbtxt``, as Triton finds it from
    the files of its version folders: a python-backend model (a ``model.py``) gets the
    empty config that its ``auto_complete_config`` completes at load, an ONNX model (a
    ``model.onnx``) the one its graph completes; anything else gets None."""
    versions = [path / str(v) for v in _version_folders(path)]
    if any((folder / DEFAULT_MODEL_FILE).is_file() for folder in versions):
        return ModelConfig(name=path.name, backend="python")
    if any((folder / DEFAULT_ONNX_FILE).exists() for folder in versions):
        return ModelConfig(name=path.name, platform=ONNX_PLATFORM)
    return None


def with_backend(config: ModelConfig, path: Path) -> ModelConfig:
    """``config`` with the platform Triton finds for it when it names none and no backend:
    ``ensemble`` for a config with ``ensemble_scheduling``, ONNX Runtime when
    ``default_model_filename`` is ``model.onnx`` or a version folder of ``path`` holds a
    ``model.onnx`` (as Triton's auto-complete of the backend fields does, for configs on disk
    and load requests' overrides alike); otherwise ``config`` as it is (a ``model.py``)."""
    if config.platform or config.backend:
        return config
    if config.ensemble_scheduling is not None:
        return attrs.evolve(config, platform=ENSEMBLE_PLATFORM)
    if config.default_model_filename:
        onnx = config.default_model_filename == DEFAULT_ONNX_FILE
    else:
        onnx = any((path / str(v) / DEFAULT_ONNX_FILE).exists() for v in _version_folders(path))
    return attrs.evolve(config, platform=ONNX_PLATFORM) if onnx else config


def is_model_folder(path: Path) -> bool:
    """Whether ``path`` is a model folder: it has a ``config.pbtxt``, or a version folder
    whose files say what the model is (see `_without_config`)."""
    if not path.is_dir() or path.name.startswith("."):
        return False
    return (path / CONFIG_FILE).is_file() or _without_config(path) is not None


def scan_model_folder(
    path: Path,
    override: ModelConfig | None = None,
    *,
    override_source: str = "",
    reading: ConfigReading = AUTO_COMPLETE,
) -> tuple[RepositoryEntry | None, list[str]]:
    """Read one model folder: its config and its version folders.

    Args:
        override: the config to use instead of the folder's ``config.pbtxt`` (a load
            request's), named ``override_source`` in errors.
        reading: how the folder's config is found and completed.
    """
    config_file = reading.config_file(path)
    config_path = path / config_file
    config_source = str(config_path)
    if override is not None:
        config, config_source = override, override_source
    elif not config_path.is_file():
        found = _without_config(path) if reading.auto_complete else None
        if found is None:
            return None, [
                f"{config_path}: missing (every model folder needs a {CONFIG_FILE}, except "
                "a Triton python model whose model.py completes its config, and an ONNX "
                f"model, whose {DEFAULT_ONNX_FILE} does)"
                if reading.auto_complete
                else f"{config_path}: missing (auto-complete is disabled: every model "
                f"folder needs a complete {CONFIG_FILE})"
            ]
        config = found
    else:
        try:
            config = parse_model_config(config_path.read_text(), source=str(config_path))
        except ConfigError as exc:
            return None, list(exc.errors)
        except (OSError, UnicodeDecodeError) as exc:
            return None, [f"{config_path}: cannot be read: {exc}"]
    errors = []
    config = with_backend(config, path)
    if not config.name:
        config = attrs.evolve(config, name=path.name)
    elif config.name != path.name:
        errors.append(
            f"{config_source}: field name: '{config.name}' does not match the "
            f"{'model' if override is not None else 'folder'} name '{path.name}'"
        )
    available = _version_folders(path)
    if not available:
        errors.append(f"{path}: no version folder (add '1/'; an ensemble's may be empty)")
    versions = select_versions(available, config.version_policy)
    if available and not versions:
        errors.append(
            f"{config_source}: field version_policy: selects none of the versions present "
            f"({', '.join(map(str, available))})"
        )
    if config.version_policy is not None and config.version_policy.specific:
        absent = sorted(set(config.version_policy.specific) - set(available))
        if absent:  # Triton serves the others and logs the missing ones
            _log.warning(
                "%s: field version_policy: versions %s have no folder", config_source, absent
            )
    entry = RepositoryEntry(
        name=config.name,
        config=config,
        path=path,
        versions=versions,
        config_source="" if override is None else config_source,
        config_file=config_file,
        auto_complete=reading.auto_complete,
    )
    if not config.is_ensemble:
        for version in versions:
            code = entry.model_file(version)
            if not code.is_file():
                what = "ONNX graph" if config.is_onnx else "code"
                errors.append(f"{code}: missing (the {what} of version {version})")
    return entry, errors


def scan_repository(
    root: Path, *, reading: ConfigReading = AUTO_COMPLETE
) -> tuple[list[RepositoryEntry], list[str]]:
    """Read every model folder under ``root``.

    Returns:
        the entries that could be read, and every problem found (files named).
    """
    if not root.exists():
        return [], [f"{root}: model repository does not exist"]
    if not root.is_dir():
        return [], [f"{root}: model repository is not a directory"]
    if (root / CONFIG_FILE).is_file():
        return [], [
            f"{root}: is a model folder (it has a {CONFIG_FILE}); the model repository is "
            f"the folder that contains it ({root.resolve().parent})"
        ]
    entries, errors = [], []
    for path in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        entry, problems = scan_model_folder(path, reading=reading)
        errors.extend(problems)
        if entry is not None:
            entries.append(entry)
    return entries, errors


_SKIPPED = ("__pycache__",)


def revision(entry: RepositoryEntry, version: int) -> str:
    """The fingerprint of what answers for ``version`` of ``entry``: its config (as parsed,
    so formatting does not matter) and every file of its version folder (names and bytes,
    the model's helpers and weights too; byte caches skipped). Equal on every replica that
    has the same files; different once any of them changes.

    Raises:
        ModelLoadError: a file of the version folder cannot be read.
    """
    hasher = xxhash.xxh3_128()

    def part(data: bytes) -> None:
        hasher.update(len(data).to_bytes(8, "little"))
        hasher.update(data)

    part(format_model_config(entry.config).encode())
    folder = entry.path / str(version)
    try:
        files = sorted(
            p
            for p in folder.rglob("*")
            if p.is_file() and not any(s in p.relative_to(folder).parts for s in _SKIPPED)
        )
        for path in files:
            part(path.relative_to(folder).as_posix().encode())
            with path.open("rb") as handle:
                size = path.stat().st_size
                hasher.update(size.to_bytes(8, "little"))
                while chunk := handle.read(1 << 20):
                    hasher.update(chunk)
    except OSError as exc:
        raise ModelLoadError(f"{folder}: cannot be read: {exc}") from exc
    return hasher.hexdigest()


def load_model_code(entry: RepositoryEntry, version: int) -> Model:
    """Import the ``model.py`` of one version and bind it to its config.

    Raises:
        ModelLoadError: importing the file raised (the message names the file and keeps the
            original error).
        ConfigError: the file breaks the ``model.py`` contract.
    """
    config = entry.config
    config_source = entry.config_source or str(entry.path / entry.config_file)
    if not entry.config_source and not (entry.path / entry.config_file).is_file():
        config_source = f"{entry.path} (no {CONFIG_FILE})"
    fingerprint = revision(entry, version)
    labels = read_labels(entry)
    initial_states = read_initial_states(entry)
    if config.is_ensemble:
        return Model(
            config=config,
            version=version,
            source=config_source,
            revision=fingerprint,
            labels=labels,
        )
    path = entry.model_file(version)
    if config.is_onnx:
        return _onnx_model(entry, version, config_source, fingerprint, labels, initial_states)
    module = import_code_file(path, f"{entry.name}_v{version}")
    triton_model = getattr(module, "TritonPythonModel", None)
    if isinstance(triton_model, type):
        if entry.auto_complete:
            config = auto_complete(triton_model, config, config_source)
        return _checked(
            Model(
                config=config,
                triton_model=triton_model,
                jit=False,
                version=version,
                source=str(path),
                config_source=config_source,
                revision=fingerprint,
                labels=labels,
                initial_states=initial_states,
            )
        )
    if not entry.config_source and not (entry.path / entry.config_file).is_file():
        raise ConfigError(
            f"{entry.path / CONFIG_FILE}: missing (only a model.py that defines "
            "TritonPythonModel can do without one)"
        )
    return _checked(
        Model(
            config=config,
            execute=getattr(module, "execute", None),
            initialize=getattr(module, "initialize", None),
            initial_state=getattr(module, "initial_state", None),
            jit=bool(getattr(module, "JIT", True)),
            version=version,
            source=str(path),
            config_source=config_source,
            revision=fingerprint,
            labels=labels,
        )
    )


def _onnx_model(
    entry: RepositoryEntry,
    version: int,
    config_source: str,
    fingerprint: str,
    labels: dict[str, tuple[str, ...]],
    initial_states: dict[str, bytes],
) -> Model:
    """An ONNX model of the repository, its config completed from its graph.

    Raises:
        ModelLoadError: the graph cannot be read.
        ConfigError: the config disagrees with the graph, or breaks a rule.
    """
    path = entry.model_file(version)
    return _checked(
        Model(
            config=complete_onnx_config(
                entry.config, path, config_source, complete=entry.auto_complete
            ),
            onnx=path,
            version=version,
            source=str(path),
            config_source=config_source,
            revision=fingerprint,
            labels=labels,
            initial_states=initial_states,
        )
    )


def _checked(model: Model) -> Model:
    """``model``, once `check_model` finds nothing wrong with it.

    Raises:
        ConfigError: what it found.
    """
    errors = check_model(model)
    if errors:
        raise ConfigError(errors)
    return model


MAX_LABELS_FILE = 64 * 1024 * 1024
"""The largest ``label_filename`` read (bytes): a million labels of 60 characters."""


def read_labels(entry: RepositoryEntry) -> dict[str, tuple[str, ...]]:
    """The class labels of each output that names a ``label_filename``: one per line of a
    file inside the model's folder.

    Raises:
        ConfigError: the file is missing, outside the model folder, too large, or not UTF-8.
    """
    labels: dict[str, tuple[str, ...]] = {}
    for output in entry.config.output:
        if not output.label_filename:
            continue
        where = f"{entry.path / CONFIG_FILE}: output '{output.name}': label_filename"
        data = _read_in_folder(entry.path, output.label_filename, where, MAX_LABELS_FILE)
        try:
            text = data.decode()
        except UnicodeDecodeError:
            raise ConfigError(f"{where} '{output.label_filename}' is not UTF-8 text") from None
        lines = text.split("\n")  # only newlines: a label's index is its line number
        if lines and not lines[-1]:
            lines.pop()
        labels[output.name] = tuple(line.removesuffix("\r") for line in lines)
    return labels


MAX_INITIAL_STATE_FILE = 256 * 1024 * 1024
"""The largest ``initial_state`` ``data_file`` read (bytes)."""


def read_initial_states(entry: RepositoryEntry) -> dict[str, bytes]:
    """The bytes of each implicit state's ``initial_state`` ``data_file`` (by the state's
    ``input_name``), from the model folder's ``initial_state/`` (as in Triton).

    Raises:
        ConfigError: a file is missing, outside that folder, or too large.
    """
    config = entry.config
    if config.sequence_batching is None or sequence_problems(config):
        return {}  # the config's problems are reported with it
    folder = entry.path / INITIAL_STATE_FOLDER
    found = {}
    for state in SequenceTensors.of(config).states:
        if state.data_file:
            where = (
                f"{entry.path / entry.config_file}: sequence_batching state "
                f"'{state.input_name}': initial_state data_file"
            )
            found[state.input_name] = _read_in_folder(
                folder, state.data_file, where, MAX_INITIAL_STATE_FILE
            )
    return found


def _read_in_folder(folder: Path, name: str, where: str, limit: int) -> bytes:
    """The bytes of the file ``name`` inside ``folder``.

    Raises:
        ConfigError: it is missing, outside the folder, or larger than ``limit`` bytes.
    """
    root = folder.resolve()
    path = (root / name).resolve()
    if not path.is_relative_to(root):
        raise ConfigError(f"{where} '{name}' is outside the folder {root}")
    try:
        with path.open("rb") as handle:
            data = handle.read(limit + 1)
    except OSError as exc:
        raise ConfigError(f"{where} '{name}' cannot be read: {exc}") from exc
    if len(data) > limit:
        raise ConfigError(f"{where} '{name}' is larger than {limit} bytes")
    return data
