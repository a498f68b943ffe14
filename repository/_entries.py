"""A model folder of a repository (`RepositoryEntry`), and what its files give besides its
config and its code: the fingerprint of a version (`revision`: the response cache's key
part that changes with any file), the class labels of its outputs (`read_labels`) and the
initial values of its sequence states (`read_initial_states`), each file read inside the
folder and bounded in size."""

from __future__ import annotations

from pathlib import Path

import attrs
import xxhash

from ..protocols import (
    INITIAL_STATE_FOLDER,
    ConfigError,
    ModelConfig,
    ModelLoadError,
    SequenceTensors,
    format_model_config,
    sequence_problems,
)

CONFIG_FILE = "config.pbtxt"
DEFAULT_MODEL_FILE = "model.py"
DEFAULT_ONNX_FILE = "model.onnx"
_SKIPPED = ("__pycache__",)


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
    backend_file: Path | None = None
    """The ``model.py`` of the python-based backend that runs every version (None: the
    version folders hold the code)."""

    def model_file(self, version: int) -> Path:
        """The code file of ``version`` (an ONNX model's graph; a folder of that name holds
        it as ``model.onnx``, as in Triton; a python-based backend's ``model.py``)."""
        if self.backend_file is not None:
            return self.backend_file
        onnx = self.config.is_onnx
        default = DEFAULT_ONNX_FILE if onnx else DEFAULT_MODEL_FILE
        path = self.path / str(version) / (self.config.default_model_filename or default)
        return path / DEFAULT_ONNX_FILE if onnx and path.is_dir() else path


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
    folders = [entry.path / str(version)]
    if entry.backend_file is not None:  # and the backend's code, which runs this model
        folders.append(entry.backend_file.parent)
    for folder in folders:
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
        where = f"{entry.path / entry.config_file}: output '{output.name}': label_filename"
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
