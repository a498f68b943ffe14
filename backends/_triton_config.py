"""A Triton python-backend model's view of its config: the ``args`` of ``initialize`` and the
``ModelConfig`` its static ``auto_complete_config`` fills in.

How this works: the model sees Triton's JSON form of its config (proto field names, every
field present, 64-bit integers as numbers, ``parameters`` as ``{"key": {"string_value":
...}}``), made from orchestrion's `ModelConfig` by `model_config_json`. Auto-complete may set
only ``max_batch_size``, ``input``, ``output``, ``dynamic_batching`` and
``model_transaction_policy``; `auto_complete` takes exactly those fields back, through
Triton's schema (so a wrong field is reported as any config error is), onto the config the
model folder had (or the empty one of a folder without ``config.pbtxt``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2

from ..protocols import (
    ConfigError,
    InstanceKind,
    model_config_from_dict,
    model_config_json,
    model_config_to_dict,
)
from ..protocols import ModelConfig as ServedConfig
from ._triton_metrics import ModelScope, enter_scope, leave_scope

_COMPLETED = ("max_batch_size", "input", "output", "dynamic_batching", "model_transaction_policy")
_INPUT_FIELDS = ("name", "data_type", "dims", "optional")
_OUTPUT_FIELDS = ("name", "data_type", "dims")


class ModelConfig:
    """A model's config as its ``auto_complete_config`` sees and completes it (Triton's
    ``pb_utils.ModelConfig``). Only ``max_batch_size``, inputs, outputs, dynamic batching
    and the transaction policy can be set."""

    def __init__(self, model_config: str | Mapping[str, Any]) -> None:
        loaded = json.loads(model_config) if isinstance(model_config, str) else model_config
        self._config: dict[str, Any] = dict(loaded)
        self._config.setdefault("input", [])
        self._config.setdefault("output", [])
        self._config.setdefault("max_batch_size", 0)

    def as_dict(self) -> dict[str, Any]:
        """The config, as Triton's JSON (read it; change it through the setters)."""
        return self._config

    @property
    def _name(self) -> str:
        return str(self._config.get("name", ""))

    def set_max_batch_size(self, max_batch_size: int) -> None:
        """Set ``max_batch_size``.

        Raises:
            ValueError: the config already allows a larger batch than the model would.
        """
        configured = int(self._config.get("max_batch_size", 0))
        if configured > max_batch_size:
            raise ValueError(
                f"model '{self._name}': the config sets max_batch_size {configured}, but "
                f"auto_complete_config sets {max_batch_size}"
            )
        self._config["max_batch_size"] = int(max_batch_size)

    def set_dynamic_batching(self) -> None:
        """Use the dynamic batcher (with its defaults) unless the config has one.

        Raises:
            ValueError: the config uses sequence batching or is an ensemble.
        """
        for other in ("sequence_batching", "ensemble_scheduling"):
            if self._config.get(other):
                raise ValueError(
                    f"model '{self._name}': the config uses {other}, so auto_complete_config "
                    "cannot set dynamic_batching"
                )
        self._config.setdefault("dynamic_batching", {})

    def add_input(self, input: Mapping[str, Any]) -> None:
        """Add an input (``name``, ``data_type``, ``dims``, optionally ``optional``), or
        complete the config's input of that name.

        Raises:
            ValueError: a property missing or unknown, or one that contradicts the config.
        """
        self._add("input", input, _INPUT_FIELDS)

    def add_output(self, output: Mapping[str, Any]) -> None:
        """Add an output (``name``, ``data_type``, ``dims``), or complete the config's
        output of that name.

        Raises:
            ValueError: a property missing or unknown, or one that contradicts the config.
        """
        self._add("output", output, _OUTPUT_FIELDS)

    def _add(self, kind: str, tensor: Mapping[str, Any], allowed: tuple[str, ...]) -> None:
        name = tensor.get("name")
        where = f"model '{self._name}': {kind} '{name}' in auto_complete_config"
        unknown = sorted(set(tensor) - set(allowed))
        if unknown:
            raise ValueError(f"{where}: unknown properties {unknown} (allowed: {list(allowed)})")
        for needed in ("name", "data_type", "dims"):
            if needed not in tensor:
                raise ValueError(f"{where}: the '{needed}' property is missing")
        for existing in self._config[kind]:
            if existing.get("name") != name:
                continue
            configured_type = existing.get("data_type", "TYPE_INVALID")
            if configured_type not in ("TYPE_INVALID", tensor["data_type"]):
                raise ValueError(
                    f"{where}: the config says data_type {configured_type}, the model "
                    f"{tensor['data_type']}"
                )
            configured_dims = [int(d) for d in existing.get("dims", [])]
            if configured_dims and configured_dims != [int(d) for d in tensor["dims"]]:
                raise ValueError(
                    f"{where}: the config says dims {configured_dims}, the model "
                    f"{list(tensor['dims'])}"
                )
            if (
                "optional" in tensor
                and existing.get("optional", tensor["optional"]) != tensor["optional"]
            ):
                raise ValueError(
                    f"{where}: the config says optional {existing['optional']}, the model "
                    f"{tensor['optional']}"
                )
            existing.update({k: tensor[k] for k in allowed if k in tensor})
            return
        self._config[kind].append(dict(tensor))

    def set_model_transaction_policy(self, transaction_policy_dict: Mapping[str, Any]) -> None:
        """Set ``model_transaction_policy`` (only ``decoupled``).

        Raises:
            ValueError: another property, or a ``decoupled`` that contradicts the config.
        """
        unknown = sorted(set(transaction_policy_dict) - {"decoupled"})
        if unknown:
            raise ValueError(
                f"model '{self._name}': model_transaction_policy in auto_complete_config has "
                f"unknown properties {unknown} (only 'decoupled')"
            )
        policy = self._config.setdefault("model_transaction_policy", {})
        if "decoupled" in transaction_policy_dict:
            wanted = bool(transaction_policy_dict["decoupled"])
            if "decoupled" in policy and bool(policy["decoupled"]) != wanted:
                raise ValueError(
                    f"model '{self._name}': auto_complete_config sets decoupled {wanted}, but "
                    f"the config says {policy['decoupled']}"
                )
            policy["decoupled"] = wanted


def triton_json(config: ServedConfig) -> dict[str, Any]:
    """``config`` as Triton's JSON, the way a python-backend model reads it."""
    return model_config_json(config)


def auto_complete(
    model_class: type,
    config: ServedConfig,
    source: str,
    directory: Path | None = None,
    version: int = 1,
) -> ServedConfig:
    """``config`` completed by the model's static ``auto_complete_config`` (the config as
    it is when the class has none), which runs as ``version`` of the model (its folder
    ``directory``, for ``pb_utils.get_model_dir()``).

    Raises:
        ConfigError: the function raised, returned something else than the config, or set
            a field wrongly (``source`` named).
    """
    complete = getattr(model_class, "auto_complete_config", None)
    if complete is None:
        return config
    document = triton_json(config)
    if not config.model_transaction_policy:
        document.pop("model_transaction_policy", None)  # not set by the config: free to set
    given = ModelConfig(json.dumps(document))
    scope = enter_scope(ModelScope(config.name, version, directory=str(directory or "")))
    try:
        returned = complete(given)
    except Exception as exc:
        raise ConfigError(
            f"{source}: auto_complete_config failed: {type(exc).__name__}: {exc}"
        ) from exc
    finally:
        leave_scope(scope)
    if not isinstance(returned, ModelConfig):
        raise ConfigError(
            f"{source}: auto_complete_config must return the pb_utils.ModelConfig it was "
            f"given, got {type(returned).__name__}"
        )
    completed = returned.as_dict()
    merged = model_config_to_dict(config)
    for field in _COMPLETED:
        if field in completed:
            merged[field] = completed[field]
    try:  # through Triton's schema, as config.pbtxt is: defaults dropped, names checked
        message = json_format.ParseDict(merged, model_config_pb2.ModelConfig())
    except json_format.ParseError as exc:
        raise ConfigError(f"{source}: auto_complete_config set a wrong field: {exc}") from exc
    data = json_format.MessageToDict(message, preserving_proto_field_name=True)
    return model_config_from_dict(data, source=f"{source} (after auto_complete_config)")


def initialize_args(
    config: ServedConfig,
    version: int,
    folder: Path | None,
    kind: InstanceKind,
    device: int,
    instance_name: str,
) -> dict[str, str]:
    """Triton's ``args`` for ``initialize``: every key and value a string (the model's
    folder is its ``model_repository``; the kind is ``GPU``, ``MODEL`` or ``CPU``, as
    Triton names a group's kind, ``KIND_AUTO`` being ``CPU`` here)."""
    return {
        "model_config": json.dumps(triton_json(config)),
        "model_instance_kind": _KIND_NAMES.get(kind, "CPU"),
        "model_instance_name": instance_name,
        "model_instance_device_id": str(device),
        "model_repository": str(folder) if folder is not None else "",
        "model_version": str(version),
        "model_name": config.name,
    }


STUB_NAME_INVALID = ";|&$`<>()[]{}\\\"'*?~#!"
"""Characters Triton's python backend refuses in a model's name (its stub's name): its
words, "Invalid stub name: contains invalid characters", are what its QA looks for."""


_KIND_NAMES = {InstanceKind.KIND_GPU: "GPU", InstanceKind.KIND_MODEL: "MODEL"}


def instance_names(config: ServedConfig) -> list[tuple[InstanceKind, str]]:
    """Each instance's kind and Triton's name for it: ``<group name>_<index>``, a group's
    name defaulting to ``<model>_<group index>`` (one CPU instance without groups)."""
    return [
        (group.kind, f"{group.name or f'{config.name}_{number}'}_{index}")
        for number, group in enumerate(config.instance_group)
        for index in range(group.count)
    ] or [(InstanceKind.KIND_CPU, f"{config.name}_0_0")]


def stub_name_problem(config: ServedConfig, in_config: str, *, auto_complete: bool) -> str:
    """Why ``config``'s model cannot run as a python-backend model, in Triton's words
    ("": it can). Triton names a stub process after each instance, and its auto-complete
    stub after the model; a name holding one of ``STUB_NAME_INVALID`` is refused."""
    stubs = [("the model", config.name)] if auto_complete else []
    stubs += [("an instance", name) for _, name in instance_names(config)]
    for what, name in stubs:
        if any(c in STUB_NAME_INVALID for c in name):
            return (
                f"{in_config}: Invalid stub name: contains invalid characters ({name!r}, "
                f"the name of {what}, may hold none of {STUB_NAME_INVALID}, as in Triton's "
                "python backend)"
            )
    return ""
