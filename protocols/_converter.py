"""Conversion between ``config.pbtxt`` text, Triton's protobuf message and `ModelConfig`.

How this works: the text is parsed with Triton's real schema (``model_config_pb2`` from
``tritonclient``) by ``google.protobuf.text_format``, so syntax errors and unknown fields are
reported exactly as Triton would. The message becomes a plain dict (``json_format``, proto
field names) and a cattrs converter structures it into the attrs classes, with extra keys
forbidden: a schema field orchestrion does not implement is an error that names it. cattrs'
`transform_error` turns structuring failures into "file: field: problem" lines.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import cattrs
from cattrs.gen import make_dict_structure_fn, make_dict_unstructure_fn
from google.protobuf import json_format, text_format
from tritonclient.grpc import model_config_pb2

from ._config import (
    DynamicBatching,
    EnsembleScheduling,
    EnsembleStep,
    InstanceGroup,
    ModelConfig,
    ModelTransactionPolicy,
    QueuePolicy,
    Reshape,
    ResponseCache,
    SequenceBatching,
    TensorConfig,
    VersionPolicy,
)
from ._dtypes import DataType
from ._errors import ConfigError

_ATTRS_CLASSES = (
    DynamicBatching,
    EnsembleScheduling,
    EnsembleStep,
    InstanceGroup,
    ModelConfig,
    ModelTransactionPolicy,
    QueuePolicy,
    Reshape,
    ResponseCache,
    SequenceBatching,
    TensorConfig,
)


def _structure_version_policy(value: Mapping[str, Any], _: type) -> VersionPolicy:
    if not isinstance(value, Mapping) or len(value) != 1:
        raise ValueError("expected exactly one of 'latest', 'all' or 'specific'")
    ((kind, body),) = value.items()
    if kind == "latest":
        return VersionPolicy(latest=int(body.get("num_versions", 0)))
    if kind == "all":
        return VersionPolicy(all=True)
    if kind == "specific":
        return VersionPolicy(specific=tuple(int(v) for v in body.get("versions", ())))
    raise ValueError(f"unknown version policy {kind!r}")


def _unstructure_version_policy(policy: VersionPolicy) -> dict[str, Any]:
    if policy.all:
        return {"all": {}}
    if policy.specific is not None:
        return {"specific": {"versions": list(policy.specific)}}
    # VersionPolicy() is Triton's default: the latest version only.
    return {"latest": {"num_versions": 1 if policy.latest is None else policy.latest}}


def _structure_parameters(value: Mapping[str, Any], _: type) -> dict[str, str]:
    # Triton: map<string, ModelParameter>, ModelParameter being { string_value }.
    return {
        # proto3 leaves an empty string_value out of the dict.
        str(k): str(v.get("string_value", "")) if isinstance(v, Mapping) else str(v)
        for k, v in value.items()
    }


def configure_converter(conv: cattrs.Converter) -> None:
    """Teach ``conv`` the shapes of Triton's JSON form of ``ModelConfig``."""
    conv.register_structure_hook(DataType, lambda v, _: DataType.from_config_name(v))
    conv.register_unstructure_hook(DataType, lambda t: t.config_name)
    conv.register_structure_hook(VersionPolicy, _structure_version_policy)
    conv.register_unstructure_hook(VersionPolicy, _unstructure_version_policy)
    for cls in _ATTRS_CLASSES:
        conv.register_structure_hook(
            cls, make_dict_structure_fn(cls, conv, _cattrs_forbid_extra_keys=True)
        )
        conv.register_unstructure_hook(
            cls, make_dict_unstructure_fn(cls, conv, _cattrs_omit_if_default=True)
        )
    # `parameters` is Mapping[str, str] in orchestrion, a message map in Triton.
    params_hook = make_dict_structure_fn(ModelConfig, conv, _cattrs_forbid_extra_keys=True)

    def structure_model_config(value: Mapping[str, Any], cls: type) -> ModelConfig:
        if isinstance(value, Mapping) and "parameters" in value:
            value = {**value, "parameters": _structure_parameters(value["parameters"], dict)}
        return params_hook(value, cls)

    conv.register_structure_hook(ModelConfig, structure_model_config)
    unstructure = make_dict_unstructure_fn(ModelConfig, conv, _cattrs_omit_if_default=True)

    def unstructure_model_config(config: ModelConfig) -> dict[str, Any]:
        out = unstructure(config)
        if "parameters" in out:
            out["parameters"] = {k: {"string_value": v} for k, v in out["parameters"].items()}
        return out

    conv.register_unstructure_hook(ModelConfig, unstructure_model_config)


def make_converter() -> cattrs.Converter:
    """A converter configured for model configurations."""
    conv = cattrs.Converter(forbid_extra_keys=True)
    configure_converter(conv)
    return conv


_CONVERTER = make_converter()


def _line_of(field: str, text: str | None) -> str:
    """``:N`` for the first line of ``text`` that sets ``field`` (best effort)."""
    if text is None:
        return ""
    match = re.search(rf"(?m)^(.*?\b){re.escape(field)}\s*[:{{\[]", text)
    return f":{text.count(chr(10), 0, match.start()) + 1}" if match else ""


def _format_errors(exc: Exception, source: str, text: str | None = None) -> list[str]:
    lines = []
    for message in cattrs.transform_error(exc, path="$"):
        problem, _, where = message.rpartition(" @ ")
        field = where.removeprefix("$").lstrip(".")
        if problem.startswith("extra fields found"):
            # Known to Triton's schema (text_format accepted it) but not implemented here.
            for name in problem.removeprefix("extra fields found (").rstrip(")").split(", "):
                path = f"{field}.{name}" if field else name
                lines.append(
                    f"{source}{_line_of(name, text)}: field {path}: not supported by orchestrion"
                )
            continue
        lines.append(f"{source}: field {field or '(top level)'}: {problem}")
    return lines


def model_config_from_dict(
    data: Mapping[str, Any], *, source: str = "<config>", text: str | None = None
) -> ModelConfig:
    """Structure Triton's JSON form of a model configuration (proto field names).

    Raises:
        ConfigError: naming ``source`` and each field that is wrong or not supported.
    """
    try:
        return _CONVERTER.structure(data, ModelConfig)
    except (cattrs.BaseValidationError, ValueError, TypeError, KeyError) as exc:
        raise ConfigError(_format_errors(exc, source, text)) from exc


def parse_model_config(text: str, *, source: str = "config.pbtxt") -> ModelConfig:
    """Parse ``config.pbtxt`` text with Triton's schema.

    Args:
        text: protobuf text format of ``inference.ModelConfig``.
        source: how to name the file in errors (its path).

    Raises:
        ConfigError: a syntax error, a field unknown to Triton's schema, a field orchestrion
            does not support, or a value of the wrong kind; the message names ``source``.
    """
    message = model_config_pb2.ModelConfig()
    try:
        text_format.Parse(text, message)
    except text_format.ParseError as exc:
        raise ConfigError(f"{source}:{exc}") from exc
    except ValueError as exc:  # a number the field's type cannot hold ("Value out of range")
        raise ConfigError(f"{source}: {exc}") from exc
    data = json_format.MessageToDict(message, preserving_proto_field_name=True)
    return model_config_from_dict(data, source=source, text=text)


def model_config_to_dict(config: ModelConfig) -> dict[str, Any]:
    """Triton's JSON form of ``config`` (proto field names, defaults left out)."""
    data: dict[str, Any] = _CONVERTER.unstructure(config)
    return data


def format_model_config(config: ModelConfig) -> str:
    """``config`` as ``config.pbtxt`` text that Triton and `parse_model_config` read back."""
    message = json_format.ParseDict(model_config_to_dict(config), model_config_pb2.ModelConfig())
    text: str = text_format.MessageToString(message)
    return text
