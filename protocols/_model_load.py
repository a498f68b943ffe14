"""Load requests as Triton takes them: a ``config`` override and ``file:`` parameters.

How this works: a front end turns a load request's parameters into a `LoadOverride` (HTTP
sends each file as base64 text, gRPC as ``bytes_param``), refusing what Triton refuses (a
parameter of another name or of the wrong kind). `parse_config_override` reads the config's
JSON with Triton's schema, as Triton does (enum names in any case, unknown fields an error),
then into a `ModelConfig`, so every error names the field. `upload_problems` decides, without
touching a disk, whether the files may be written into a fresh model folder: each path stays
inside it (no ``..``, no absolute path, no backslash, NUL or control character, no empty or
over-long name), and their number and sizes stay within `UploadLimits`.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Mapping
from typing import Any

import attrs
from google.protobuf import descriptor, json_format
from tritonclient.grpc import model_config_pb2

from ._config import ModelConfig
from ._converter import model_config_from_dict
from ._errors import ConfigError, InvalidRequestError

FILE_PREFIX = "file:"
"""The name prefix of a load parameter that carries a file (``file:1/model.py``)."""
CONFIG_SOURCE = "load parameter 'config'"
"""How errors name the override's config."""
MAX_UPLOAD_FILES = 1024
"""The most files one load request may send."""
MAX_NAME_BYTES = 255
"""The longest file or folder name (bytes) of common file systems."""
MAX_PATH_BYTES = 1024
"""The longest path (bytes, below the model folder) a sent file may have."""
MAX_PATH_PARTS = 16
"""The deepest a sent file may sit below the model folder."""
_SHOWN = 10
"""Problems shown per request (the rest are counted)."""
DEFAULT_MAX_UPLOAD_SIZE = 256 * 1024 * 1024
"""The most bytes the files of one load request may hold together (each file included)."""


@attrs.frozen(kw_only=True)
class UploadLimits:
    """How much one load request may write into its model folder."""

    max_size: int = DEFAULT_MAX_UPLOAD_SIZE
    """Bytes of all files together (each file's too); 0 turns ``file:`` parameters off."""
    max_files: int = MAX_UPLOAD_FILES


@attrs.frozen(kw_only=True)
class LoadOverride:
    """What a load request sends besides the model's name: Triton's ``config`` (the JSON
    text of a model config, used instead of ``config.pbtxt``) and ``file:`` parameters (the
    files of the model folder to load from instead of the repository's)."""

    config: str | None = None
    files: Mapping[str, bytes] = attrs.field(factory=dict, eq=False, repr=False)
    """Each file's path below the model folder (``1/model.py``), and its bytes."""

    @property
    def empty(self) -> bool:
        """Whether the request is a plain load (neither a config nor files)."""
        return self.config is None and not self.files


def _unrecognized(name: str) -> InvalidRequestError:
    return InvalidRequestError(
        f"unrecognized load parameter '{name:.100}' (a load takes 'config' and "
        "'file:<version>/<name>' parameters)"
    )


def load_override_from_http(parameters: Mapping[str, object]) -> LoadOverride:
    """The override in an HTTP load request's ``parameters`` (files as base64 text).

    Raises:
        InvalidRequestError: a parameter of another name, a value that is not a string, or
            a file that is not base64.
    """
    config: str | None = None
    files: dict[str, bytes] = {}
    for name, value in parameters.items():
        if name != "config" and not name.startswith(FILE_PREFIX):
            raise _unrecognized(name)
        if not isinstance(value, str):
            raise InvalidRequestError(
                f"load parameter '{name:.100}' must be a string"
                + (" (the model config's JSON as text)" if name == "config" else " (base64)")
            )
        if name == "config":
            config = value
            continue
        try:
            files[_file_path(name)] = base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise InvalidRequestError(
                f"load parameter '{name:.100}' is not base64: {exc}"
            ) from None
    return LoadOverride(config=config, files=files)


def load_override_from_grpc(parameters: Mapping[str, Any]) -> LoadOverride:
    """The override in a gRPC ``RepositoryModelLoadRequest``'s ``parameters`` (a map of
    ``ModelRepositoryParameter``; ``config`` a ``string_param``, files ``bytes_param``).

    Raises:
        InvalidRequestError: a parameter of another name, or of the wrong kind (Triton's
            "expected string_param" / "expected bytes_param").
    """
    config: str | None = None
    files: dict[str, bytes] = {}
    for name, parameter in parameters.items():
        kind = parameter.WhichOneof("parameter_choice")
        if name == "config":
            if kind != "string_param":
                raise InvalidRequestError(
                    "invalid value type for load parameter 'config', expected string_param."
                )
            config = parameter.string_param
        elif name.startswith(FILE_PREFIX):
            if kind != "bytes_param":
                raise InvalidRequestError(
                    f"invalid value type for load parameter '{name:.100}', expected bytes_param."
                )
            files[_file_path(name)] = parameter.bytes_param
        else:
            raise _unrecognized(name)
    return LoadOverride(config=config, files=files)


def load_override_from_files(config: str | None, files: Mapping[str, bytes] | None) -> LoadOverride:
    """The override a model's code gives ``pb_utils.load_model``: the config's JSON text
    ("" or None: none) and files by ``file:`` name, as bytes.

    Raises:
        InvalidRequestError: a file name without the ``file:`` prefix, or not bytes.
    """
    paths: dict[str, bytes] = {}
    for name, data in (files or {}).items():
        if not name.startswith(FILE_PREFIX) or not isinstance(data, bytes):
            raise InvalidRequestError(
                f"load_model file '{name:.100}': give files as {{'{FILE_PREFIX}<path>': bytes}}"
            )
        paths[_file_path(name)] = data
    return LoadOverride(config=config or None, files=paths)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for key, value in pairs:
        if key in found:
            raise ValueError(f"duplicate key {key!r}")
        found[key] = value
    return found


def _enum_names_upper(data: Any, message: descriptor.Descriptor) -> Any:
    """``data`` (JSON of ``message``) with enum names in upper case, as Triton's parser
    (``case_insensitive_enum_parsing``) reads them; anything else is left for protobuf."""
    if not isinstance(data, dict):
        return data
    fixed = dict(data)
    for key, value in data.items():
        field = message.fields_by_name.get(key) or message.fields_by_camelcase_name.get(key)
        if field is None:
            continue
        if field.enum_type is not None:
            if isinstance(value, str):
                fixed[key] = value.upper()
            elif isinstance(value, list):
                fixed[key] = [v.upper() if isinstance(v, str) else v for v in value]
        elif field.message_type is not None and not field.message_type.GetOptions().map_entry:
            if isinstance(value, list):
                fixed[key] = [_enum_names_upper(v, field.message_type) for v in value]
            else:
                fixed[key] = _enum_names_upper(value, field.message_type)
    return fixed


def parse_config_override(text: str) -> ModelConfig:
    """A load request's ``config``: Triton's JSON form of ``ModelConfig`` (what
    ``GET /v2/models/<m>/config`` returns), which replaces ``config.pbtxt`` entirely.

    Raises:
        ConfigError: the text is not a JSON object, a field is unknown to Triton's schema
            or has a value of the wrong kind, or orchestrion does not support it (each
            named, prefixed with `CONFIG_SOURCE`).
    """
    try:
        data = json.loads(text, object_pairs_hook=_no_duplicates)
    except (ValueError, RecursionError) as exc:
        raise ConfigError(f"{CONFIG_SOURCE}: not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{CONFIG_SOURCE}: expected a JSON object (a model config)")
    message = model_config_pb2.ModelConfig()
    try:
        json_format.ParseDict(_enum_names_upper(data, message.DESCRIPTOR), message)
    except (json_format.ParseError, ValueError, TypeError, RecursionError) as exc:
        # protobuf lists every field of the message after the first line: the first says it.
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(f"{CONFIG_SOURCE}: {first}") from None
    fields = json_format.MessageToDict(message, preserving_proto_field_name=True)
    return model_config_from_dict(fields, source=CONFIG_SOURCE)


def _file_path(name: str) -> str:
    """The path of a ``file:`` load parameter below the model folder: ``file:1/model.py``,
    or ``file:/1/model.py`` as Triton's QA writes it (one leading slash names the folder)."""
    path = name.removeprefix(FILE_PREFIX)
    return path[1:] if path.startswith("/") and not path.startswith("//") else path


def _path_problem(path: str) -> str | None:
    """Why a sent file may not be written at ``path`` below the model folder (None: it may)."""
    if not path:
        return "the path is empty"
    if "\0" in path:
        return "the path holds a NUL character"
    if "\\" in path:
        return "the path holds a backslash (separate folders with '/')"
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in path):
        return "the path holds a control character"
    try:
        size = len(path.encode())
    except UnicodeEncodeError:
        return "the path is not valid UTF-8"
    if path.startswith("/"):
        return "the path is absolute (it must be relative to the model folder)"
    parts = path.split("/")
    if any(part in ("", ".", "..") for part in parts):
        return "the path has an empty, '.' or '..' part (it must stay inside the model folder)"
    if any(len(part.encode()) > MAX_NAME_BYTES for part in parts):
        return f"a name in the path is longer than {MAX_NAME_BYTES} bytes"
    if size > MAX_PATH_BYTES or len(parts) > MAX_PATH_PARTS:
        return f"the path is longer than {MAX_PATH_BYTES} bytes or {MAX_PATH_PARTS} levels"
    if path == "config.pbtxt":
        return "the model's config comes from the 'config' parameter"
    return None


def upload_problems(files: Mapping[str, bytes], limits: UploadLimits) -> list[str]:
    """Why the ``files`` of a load request may not be written (empty: they may): a path
    that would leave the model folder or that the file system cannot hold, a path that is
    both a file and a folder, too many files or too many bytes."""
    if not files:
        return []
    if limits.max_size <= 0:
        return ["'file:' parameters are turned off on this server (--model-upload-max-size 0)"]
    problems: list[str] = []
    if len(files) > limits.max_files:
        problems.append(f"{len(files)} files sent; at most {limits.max_files} are accepted")
    total = sum(len(data) for data in files.values())
    if total > limits.max_size:
        problems.append(
            f"the files sent hold {total} bytes, more than the {limits.max_size} accepted "
            "(--model-upload-max-size)"
        )
    if problems:  # too many: the paths of so many files are not worth reading
        return problems
    for path in sorted(files):
        why = _path_problem(path)
        if why is not None:
            problems.append(f"load parameter '{FILE_PREFIX}{path:.100}': {why}")
    folders = {"/".join(p.split("/")[:i]) for p in files for i in range(1, p.count("/") + 1)}
    for path in sorted(folders.intersection(files)):
        problems.append(f"load parameter '{FILE_PREFIX}{path:.100}': also the folder of a file")
    return problems[:_SHOWN] + (
        [f"... and {len(problems) - _SHOWN} more"] if len(problems) > _SHOWN else []
    )
