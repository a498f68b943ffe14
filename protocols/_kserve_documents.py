"""The JSON documents of Triton's metadata, config, statistics and repository calls.

How this works: each document is built once, as Triton's JSON: the HTTP front end sends it as
it is, and `_kserve_grpc` parses the same document into its gRPC message, so the two front ends
report the same thing. The model config goes through tritonclient's protobuf ``ModelConfig``
(with the defaults Triton fills in), written with every field present and 64-bit integers as
numbers, which is what perf_analyzer reads.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2

from ._config import ModelConfig
from ._converter import model_config_to_dict
from ._statistics import DurationStatistics, ModelStatistics

PROTOCOL_VERSION = "2"
"""The KServe v2 protocol; Triton reports its own release as the server version."""

EXTENSIONS = (
    "classification",
    "binary_tensor_data",
    "logging",
    "parameters",
    "statistics",
    "model_configuration",
    "model_repository",
    "model_repository(unload_dependents)",
    "schedule_policy",
    "sequence",
    "system_shared_memory",
)
"""The server metadata's ``extensions`` (perf_analyzer reads ``statistics`` from here)."""


def server_metadata(version: str, name: str = "orchestrion") -> dict[str, Any]:
    """The server metadata document (``GET /v2``); ``name``: the server's (``--id``)."""
    return {"name": name, "version": version, "extensions": list(EXTENSIONS)}


def _tensor_metadata(config: ModelConfig, tensors: Sequence[Any]) -> list[dict[str, Any]]:
    batch = [-1] if config.max_batch_size > 0 else []
    return [
        {"name": t.name, "datatype": t.data_type.value, "shape": [*batch, *t.dims]} for t in tensors
    ]


def model_metadata(config: ModelConfig, versions: Sequence[int]) -> dict[str, Any]:
    """The model metadata document: ``-1`` leads the shape when the model batches."""
    return {
        "name": config.name,
        "versions": [str(v) for v in versions],
        "platform": model_platform(config),
        "inputs": _tensor_metadata(config, config.input),
        "outputs": _tensor_metadata(config, config.output),
    }


def model_platform(config: ModelConfig) -> str:
    """What the metadata calls the model's platform (``ensemble`` for ensembles)."""
    return config.platform or config.backend or "jax"


def model_config_json(config: ModelConfig) -> dict[str, Any]:
    """The model config as Triton's JSON: proto field names, every field present (defaults
    included), and 64-bit integers as numbers, the way perf_analyzer reads it."""
    message = model_config_message(config)
    document: dict[str, Any] = _message_json(message)
    return document


def model_config_message(config: ModelConfig) -> Any:
    """The model config as Triton's protobuf ``ModelConfig`` message, with the defaults
    Triton fills in (version policy, transaction policy) present."""
    message = json_format.ParseDict(model_config_to_dict(config), model_config_pb2.ModelConfig())
    if not message.HasField("version_policy"):
        message.version_policy.latest.num_versions = 1
    message.model_transaction_policy.SetInParent()
    # `count` defaults to 1 here and to 0 in the proto: write it (Triton reports it too), and
    # the instance group a model gets without one.
    for group, written in zip(config.instance_group, message.instance_group, strict=True):
        written.count = group.count
    if not config.instance_group and not config.is_ensemble:
        message.instance_group.add(kind=model_config_pb2.ModelInstanceGroup.KIND_CPU, count=1)
    return message


_INTEGER_TYPES = frozenset({3, 4, 5, 6, 13, 15, 16, 17, 18})  # FieldDescriptor.TYPE_*INT*


def _message_json(message: Any) -> dict[str, Any]:
    """A protobuf message as JSON with defaults included and integers as numbers."""
    data = json_format.MessageToDict(
        message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    return _numbers(message, data)


def _numbers(message: Any, data: dict[str, Any]) -> dict[str, Any]:
    # protobuf's JSON writes 64-bit integers as strings; Triton (and perf_analyzer) use numbers.
    for field in message.DESCRIPTOR.fields:
        key = field.name
        if key not in data:
            continue
        value = getattr(message, key)
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            value_field = field.message_type.fields_by_name["value"]
            if value_field.message_type is not None:
                data[key] = {k: _numbers(value[k], data[key][k]) for k in data[key]}
            elif value_field.type in _INTEGER_TYPES:
                data[key] = {k: int(v) for k, v in data[key].items()}
        elif field.message_type is not None:
            if _is_repeated(field):
                data[key] = [_numbers(m, d) for m, d in zip(value, data[key], strict=True)]
            else:
                data[key] = _numbers(value, data[key])
        elif field.type in _INTEGER_TYPES:
            data[key] = [int(v) for v in data[key]] if _is_repeated(field) else int(data[key])
    return data


def _is_repeated(field: Any) -> bool:
    check = getattr(field, "is_repeated", None)  # protobuf >= 6.30; `label` is deprecated
    if check is None:
        return bool(field.label == field.LABEL_REPEATED)
    return bool(check() if callable(check) else check)


def _duration(stats: DurationStatistics) -> dict[str, int]:
    return {"count": stats.count, "ns": stats.ns}


def model_statistics_json(statistics: Sequence[ModelStatistics]) -> dict[str, Any]:
    """Triton's statistics document (``GET /v2/models/{m}/stats``)."""
    entries = []
    for s in statistics:
        infer = s.inference_stats
        entries.append(
            {
                "name": s.name,
                "version": str(s.version),
                "last_inference": s.last_inference,
                "inference_count": s.inference_count,
                "execution_count": s.execution_count,
                "inference_stats": {
                    "success": _duration(infer.success),
                    "fail": _duration(infer.fail),
                    "queue": _duration(infer.queue),
                    "compute_input": _duration(infer.compute_input),
                    "compute_infer": _duration(infer.compute_infer),
                    "compute_output": _duration(infer.compute_output),
                    "cache_hit": _duration(infer.cache_hit),
                    "cache_miss": _duration(infer.cache_miss),
                },
                "response_stats": {},
                "batch_stats": [
                    {
                        "batch_size": b.batch_size,
                        "compute_input": _duration(b.compute_input),
                        "compute_infer": _duration(b.compute_infer),
                        "compute_output": _duration(b.compute_output),
                    }
                    for b in s.batch_stats
                ],
                "memory_usage": [],
            }
        )
    return {"model_stats": entries}


def repository_index(
    loaded: Mapping[str, Sequence[int]],
    available: Sequence[str],
    *,
    ready_only: bool = False,
    failed: Mapping[str, str] | None = None,
) -> list[dict[str, str]]:
    """The repository index: every model folder, with its loaded versions ``READY`` and the
    others ``UNAVAILABLE``: the reason is why its last load failed (``failed``), else
    "unloaded"."""
    failed = failed or {}
    entries: list[dict[str, str]] = []
    for name in sorted(set(available) | set(loaded) | set(failed)):
        versions = loaded.get(name, ())
        if versions:
            entries.extend(
                {"name": name, "version": str(v), "state": "READY", "reason": ""} for v in versions
            )
        elif not ready_only:
            reason = failed.get(name, "unloaded")
            entries.append({"name": name, "version": "", "state": "UNAVAILABLE", "reason": reason})
    return entries
