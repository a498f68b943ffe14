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
from types import ModuleType
from typing import TypedDict

import attrs
import numpy as np

from ..backends import (
    auto_complete,
    check_model,
    complete_onnx_config,
    forget_code,
    import_code_file,
    stub_name_problem,
)
from ..protocols import (
    ENSEMBLE_PLATFORM,
    ONNX_PLATFORM,
    OWN_BACKENDS,
    ConfigError,
    DataType,
    Model,
    ModelConfig,
    OnnxGraph,
    TritonClass,
    VersionPolicy,
    parse_model_config,
    read_control,
)
from ._entries import (
    CONFIG_FILE,
    DEFAULT_MODEL_FILE,
    DEFAULT_ONNX_FILE,
    RepositoryEntry,
    read_initial_states,
    read_labels,
    revision,
)

TRITON_BACKEND_DIRECTORY = "/opt/tritonserver/backends"
"""Triton's default ``--backend-directory``."""
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
    backend_directory: Path = attrs.field(default=Path(TRITON_BACKEND_DIRECTORY), converter=Path)
    """Where python-based backends are (Triton's ``--backend-directory``, and its default):
    a config whose ``backend`` is none of orchestrion's own runs
    ``<backend_directory>/<backend>/model.py`` for each of its versions."""

    def backend_file(self, config: ModelConfig) -> Path | None:
        """The ``model.py`` of the python-based backend ``config`` names (None: the model
        runs on a backend of orchestrion's own, or is an ensemble or an ONNX model)."""
        if config.backend in OWN_BACKENDS or config.is_ensemble or config.is_onnx:
            return None
        return self.backend_directory / config.backend / DEFAULT_MODEL_FILE

    def config_file(self, folder: Path) -> str:
        """The config file of ``folder``, relative to it (it may not exist)."""
        if self.config_name:
            custom = f"configs/{self.config_name}.pbtxt"
            if (folder / custom).is_file():
                return custom
        return CONFIG_FILE


AUTO_COMPLETE = ConfigReading()
"""Triton's defaults: configs are auto-completed, and read from ``config.pbtxt``."""


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
        backend_file=reading.backend_file(config),
    )
    return entry, errors + _code_problems(entry, config_source)


def _code_problems(entry: RepositoryEntry, config_source: str) -> list[str]:
    """What is missing of the code of ``entry``'s versions: a python-based backend, or a
    version's ``model.py`` (an ONNX model's graph)."""
    config = entry.config
    backend_file = entry.backend_file
    if backend_file is not None:
        if backend_file.is_file():
            return []
        return [
            f"{config_source}: field backend: '{config.backend}' is not one of "
            "orchestrion's backends (python, jax, onnxruntime), and no python-based "
            f"backend of that name is in the backend directory ({backend_file} does not "
            "exist; serve --backend-directory names the directory)"
        ]
    if config.is_ensemble:
        return []
    missing = [
        (version, code)
        for version in entry.versions
        if not (code := entry.model_file(version)).is_file()
    ]
    if config.is_onnx:
        return [f"{code}: missing (the ONNX graph of version {v})" for v, code in missing]
    if config.backend == "python":  # Triton's line for it, which its QA reads in the log
        return [
            f"failed to load '{config.name}' version {v}: Failed to preinitialize Python "
            f"stub: Python model file not found in '{code}'"
            for v, code in missing
        ]
    return [f"{code}: missing (the code of version {v})" for v, code in missing]


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
    if config.is_ensemble:
        return Model(
            config=config,
            version=version,
            source=config_source,
            revision=fingerprint,
            labels=labels,
            constants=read_declared_files(config, entry.path / str(version), config_source),
        )
    path = entry.model_file(version)
    found = _Found(  # what every model of the folder has, whatever its code
        version=version,
        source=str(path),
        config_source=config_source,
        revision=fingerprint,
        labels=labels,
        initial_states=read_initial_states(entry),
    )
    if config.is_onnx:
        completed = complete_onnx_config(config, path, config_source, complete=entry.auto_complete)
        return _checked(Model(config=completed, code=OnnxGraph(path), **found))
    directory = entry.path / str(version)
    if config.backend == "python" or entry.backend_file is not None:  # before its code runs
        problem = stub_name_problem(config, config_source, auto_complete=entry.auto_complete)
        if problem:
            raise ConfigError(problem)
    module = import_code_file(path, f"{entry.name}_v{version}")
    try:
        return _model_of_code(module, entry, config, path, directory, found)
    except BaseException:
        forget_code(module)  # nothing of a model that did not load stays in sys.modules
        raise


def _model_of_code(
    module: ModuleType,
    entry: RepositoryEntry,
    config: ModelConfig,
    path: Path,
    directory: Path,
    found: _Found,
) -> Model:
    """The `Model` that the imported ``model.py`` of ``entry`` defines."""
    config_source, version = found["config_source"], found["version"]
    triton_model = getattr(module, "TritonPythonModel", None)
    if isinstance(triton_model, type):
        if entry.auto_complete:
            config = auto_complete(triton_model, config, config_source, directory, version)
        code = TritonClass(triton_model)
        return _checked(Model(config=config, code=code, directory=directory, **found))
    if entry.backend_file is not None:
        raise ConfigError(
            f"{path}: defines no TritonPythonModel class (the model.py of python-based "
            f"backend '{config.backend}', which runs model '{entry.name}')"
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
            directory=directory,
            **found,
        )
    )


class _Found(TypedDict):
    """A version folder's `Model` fields besides its config and code."""

    version: int
    source: str
    config_source: str
    revision: str
    labels: dict[str, tuple[str, ...]]
    initial_states: dict[str, bytes]


def _checked(model: Model) -> Model:
    """``model``, once `check_model` finds nothing wrong with it.

    Raises:
        ConfigError: what it found.
    """
    errors = check_model(model)
    if errors:
        raise ConfigError(errors)
    return model


def read_declared_files(config: ModelConfig, folder: Path, source: str) -> dict[str, np.ndarray]:
    """The values of an ensemble's constants and defaults declared with a ``file``: ``.npy``
    files of its version folder, each of the declared data type and dims.

    Raises:
        ConfigError: a file is missing, unreadable or of another type or shape (every such
            problem, each naming the file and the parameter).
    """
    control, _ = read_control(config)  # its mistakes are reported by the ensemble's checks
    values: dict[str, np.ndarray] = {}
    problems = []
    for kind, declared in (("constant", control.constants), ("default", control.defaults)):
        for name, spec in declared.items():
            if spec.file is None:
                continue
            path = folder / spec.file
            if spec.data_type is DataType.BYTES:
                problems.append(
                    f"{source}: parameters '{kind}.{name}': give a TYPE_STRING tensor as "
                    "'value' (a .npy file of strings needs pickle, which is not read)"
                )
                continue
            where = f"{source}: parameters '{kind}.{name}': {path}"
            try:
                value = np.load(path, allow_pickle=False)
            except (OSError, ValueError) as exc:
                problems.append(f"{where}: cannot be read as a .npy file ({exc})")
                continue
            expected = spec.data_type.numpy_dtype
            if value.dtype != expected:
                problems.append(
                    f"{where}: holds {value.dtype}, and the parameter declares "
                    f"{spec.data_type.config_name} ({expected})"
                )
            elif value.shape != spec.dims:
                problems.append(
                    f"{where}: has shape {list(value.shape)}, and the parameter declares "
                    f"dims {list(spec.dims)}"
                )
            else:
                value.setflags(write=False)
                values[name] = value
    if problems:
        raise ConfigError(problems)
    return values
