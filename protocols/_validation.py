"""Load-time rules for single model configs and for a repository of them as a whole.

Every function here returns the list of problems it found instead of raising at the first one,
so that ``orchestrion validate`` can report everything at once; loaders raise `ConfigError`
with the whole list.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from ._config import ONNX_BACKEND, ONNX_PLATFORM, InstanceKind, ModelConfig, TensorConfig
from ._dtypes import DataType
from ._ensemble_validation import validate_ensemble
from ._sequence_tensors import sequence_problems


def _segments(shape: tuple[int, ...]) -> list[int]:
    """Element counts of the runs of fixed dims between ``-1`` wildcards."""
    counts, run = [], 1
    for d in shape:
        if d == -1:
            counts.append(run)
            run = 1
        else:
            run *= d
    return [*counts, run]


def _tensor_errors(model: str, kind: str, tensor: TensorConfig, max_batch_size: int) -> list[str]:
    where = f"model '{model}' {kind} '{tensor.name}'"
    errors = []
    if not tensor.name:
        errors.append(f"model '{model}': an {kind} has no name")
    if not tensor.dims:
        errors.append(
            f"{where}: dims is empty (Triton needs dims; for a batch of scalars write "
            "dims: [1] with reshape: { shape: [] })"
        )
    if any(d < -1 or d == 0 for d in tensor.dims):
        errors.append(f"{where}: dims must be positive or -1, got {list(tensor.dims)}")
    if kind == "output" and tensor.optional:
        errors.append(f"{where}: 'optional' applies to inputs only")
    if kind == "output" and tensor.format != "FORMAT_NONE":
        errors.append(f"{where}: 'format' applies to inputs only")
    if kind == "input" and tensor.label_filename:
        errors.append(f"{where}: 'label_filename' applies to outputs only")
    if tensor.format in ("FORMAT_NHWC", "FORMAT_NCHW") and len(tensor.dims) != 3:
        errors.append(f"{where}: {tensor.format} needs 3 dims, got {list(tensor.dims)}")
    if tensor.reshape is not None:
        shape = tensor.reshape.shape
        if any(d < -1 or d == 0 for d in shape):
            errors.append(f"{where}: reshape {list(shape)} must hold positive sizes or -1")
        elif not shape and max_batch_size == 0:
            errors.append(f"{where}: an empty reshape needs max_batch_size > 0")
        elif shape.count(-1) != tensor.dims.count(-1) or (
            _segments(shape) != _segments(tensor.dims)
            if -1 in shape
            else _segments(shape)[-1] != _segments(tensor.dims)[-1] and -1 not in tensor.dims
        ):
            errors.append(
                f"{where}: reshape {list(shape)} does not hold the elements of dims "
                f"{list(tensor.dims)} (same element count, same -1 wildcards)"
            )
    return errors


def _scheduling_errors(config: ModelConfig) -> list[str]:
    name = config.name
    errors = []
    batching = config.dynamic_batching
    if batching is not None:
        for size in batching.preferred_batch_size:
            if not 1 <= size <= max(config.max_batch_size, 0):
                errors.append(
                    f"model '{name}': dynamic_batching preferred_batch_size {size} must be "
                    f"between 1 and max_batch_size ({config.max_batch_size})"
                )
        levels = batching.priority_levels
        if levels and not 1 <= batching.default_priority_level <= levels:
            errors.append(
                f"model '{name}': dynamic_batching default_priority_level must be between 1 "
                f"and priority_levels ({levels})"
            )
        for key in batching.priority_queue_policy:
            if not str(key).isdigit() or not 1 <= int(key) <= levels:
                errors.append(
                    f"model '{name}': dynamic_batching priority_queue_policy level {key} is "
                    f"not between 1 and priority_levels ({levels})"
                )
        policies = [batching.default_queue_policy, *batching.priority_queue_policy.values()]
        if batching.preserve_ordering and any(
            p is not None and p.timeout_action == "DELAY" for p in policies
        ):
            errors.append(
                f"model '{name}': dynamic_batching preserve_ordering cannot be combined with "
                "timeout_action DELAY"
            )
    for group in config.instance_group:
        if group.kind is InstanceKind.KIND_CPU and group.gpus:
            errors.append(f"model '{name}': instance_group of kind KIND_CPU cannot list gpus")
    return errors


_BACKEND_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


def _platform_errors(config: ModelConfig) -> list[str]:
    """``platform`` and ``backend``: an ensemble, an ONNX model (either Triton name, or both
    together), or a Python/JAX model (``backend`` names one of orchestrion's own or a
    python-based backend, which the repository finds or refuses; see `OWN_BACKENDS`)."""
    name = config.name
    if config.is_onnx:
        if config.platform not in ("", ONNX_PLATFORM) or config.backend not in ("", ONNX_BACKEND):
            return [
                f"model '{name}': platform '{config.platform}' and backend '{config.backend}' "
                f"disagree (an ONNX model has platform '{ONNX_PLATFORM}', backend "
                f"'{ONNX_BACKEND}', or both)"
            ]
        return []
    errors = []
    if config.platform and not config.is_ensemble:
        errors.append(
            f"model '{name}': platform '{config.platform}' is not supported "
            f"(use 'ensemble', '{ONNX_PLATFORM}', or backend 'python'/'jax' or nothing for "
            "Python models)"
        )
    if not _BACKEND_NAME.fullmatch(config.backend) and config.backend:
        errors.append(
            f"model '{name}': backend '{config.backend}' is not a backend name (a "
            "python-based backend is a folder of the backend directory: letters, digits, "
            "'_', '-' and '.', starting with a letter, digit or '_')"
        )
    return errors


MAX_INSTANCES = 1024
"""Instances one model may have (Triton sets no limit; a typo of a few digits would
otherwise exhaust memory while loading)."""


def validate_model_config(config: ModelConfig) -> list[str]:
    """Rules of one config that need no other model (names, dims, kinds, ensemble fields)."""
    name = config.name
    errors: list[str] = []
    if not name:
        errors.append("a model config has no name")
    if config.max_batch_size < 0:
        errors.append(f"model '{name}': max_batch_size must be >= 0, got {config.max_batch_size}")
    errors.extend(_ensemble_field_errors(config))
    errors.extend(_platform_errors(config))
    errors.extend(_scheduling_errors(config))
    errors.extend(_tensor_list_errors(config))
    errors.extend(_instance_errors(config))
    errors.extend(_version_policy_errors(config))
    errors.extend(sequence_problems(config))
    stateful = config.sequence_batching is not None
    if stateful and config.response_cache is not None and config.response_cache.enable:
        # A decoupled model may: its whole stream is cached (Triton refuses it).
        errors.append(f"model '{name}': a sequence (stateful) model cannot enable response_cache")
    return errors


def _ensemble_field_errors(config: ModelConfig) -> list[str]:
    """``platform: "ensemble"`` exactly when there is ``ensemble_scheduling``."""
    if config.is_ensemble == (config.ensemble_scheduling is not None):
        return []
    if config.is_ensemble:
        return [f"ensemble '{config.name}': platform 'ensemble' needs ensemble_scheduling"]
    return [f"model '{config.name}': ensemble_scheduling is only allowed with platform 'ensemble'"]


def _tensor_list_errors(config: ModelConfig) -> list[str]:
    """Each input and output (named once), and at least one output."""
    name = config.name
    errors: list[str] = []
    for kind, tensors in (("input", config.input), ("output", config.output)):
        seen: set[str] = set()
        for tensor in tensors:
            if tensor.name in seen:
                errors.append(f"model '{name}': {kind} '{tensor.name}' is declared twice")
            seen.add(tensor.name)
            errors.extend(_tensor_errors(name, kind, tensor, config.max_batch_size))
    if not config.output:
        if config.is_ensemble:
            errors.append(f"ensemble '{name}': an ensemble needs at least one output")
        else:
            errors.append(f"model '{name}': a model needs at least one output")
    return errors


def _instance_errors(config: ModelConfig) -> list[str]:
    """A model's ``instance_group``: counts of at least one, at most `MAX_INSTANCES` in all."""
    if config.is_ensemble:
        return []
    name = config.name
    errors = [
        f"model '{name}': instance_group count must be >= 1"
        for group in config.instance_group
        if group.count < 1
    ]
    total = sum(max(group.count, 0) * max(len(group.gpus), 1) for group in config.instance_group)
    if total > MAX_INSTANCES:
        errors.append(
            f"model '{name}': instance_group asks for {total} instances (at most "
            f"{MAX_INSTANCES} per model: each is an actor with its own copy of the model)"
        )
    return errors


def _version_policy_errors(config: ModelConfig) -> list[str]:
    """``version_policy``: a positive count of latest versions, positive specific ones."""
    policy = config.version_policy
    if policy is None:
        return []
    errors = []
    if policy.latest is not None and policy.latest < 1:
        errors.append(f"model '{config.name}': version_policy latest num_versions must be >= 1")
    if policy.specific is not None and (not policy.specific or any(v < 1 for v in policy.specific)):
        errors.append(f"model '{config.name}': version_policy specific needs positive versions")
    return errors


def _cycle_errors(models: Mapping[str, ModelConfig]) -> list[str]:
    """Ensembles may nest, but not in cycles; each cycle is reported once with its path."""
    errors: list[str] = []
    reported: set[frozenset[str]] = set()
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        path.append(name)
        config = models[name]
        assert config.ensemble_scheduling is not None
        for step in config.ensemble_scheduling.step:
            child = models.get(step.model_name)
            if child is None or not child.is_ensemble or child.ensemble_scheduling is None:
                continue
            if state.get(child.name) == 1:
                cycle = [*path[path.index(child.name) :], child.name]
                if frozenset(cycle) not in reported:
                    reported.add(frozenset(cycle))
                    errors.append("ensembles form a cycle: " + " -> ".join(f"'{c}'" for c in cycle))
            elif child.name not in state:
                visit(child.name, path)
        path.pop()
        state[name] = 2

    for name, config in sorted(models.items()):
        if config.is_ensemble and config.ensemble_scheduling is not None and name not in state:
            visit(name, [])
    return errors


def validate_repository(
    models: Mapping[str, ModelConfig],
    versions: Mapping[str, Iterable[int]] | None = None,
    sources: Mapping[str, str] | None = None,
) -> list[str]:
    """Every rule for a set of models that will be served together.

    Args:
        models: configs by model name.
        versions: available versions by model name, to check ``model_version`` of steps.
        sources: where each model's config came from (its ``config.pbtxt``): each error
            about one model starts with it.
    """

    def located(name: str, found: list[str]) -> list[str]:
        source = (sources or {}).get(name)
        return [f"{source}: {error}" for error in found] if source else found

    errors: list[str] = []
    for name, config in models.items():
        errors.extend(located(name, validate_model_config(config)))
    errors.extend(_cycle_errors(models))
    for name, config in models.items():
        if config.is_ensemble and config.ensemble_scheduling is not None:
            errors.extend(located(name, validate_ensemble(config, models, versions)))
            errors.extend(located(name, _ensemble_cache_errors(config, models)))
    return errors


def _ensemble_cache_errors(config: ModelConfig, models: Mapping[str, ModelConfig]) -> list[str]:
    """An ensemble that contains a stateful model cannot be cached (one that contains a
    decoupled model streams, and its whole stream is cached).

    Nested ensembles count: their composing models are searched too.
    """
    if config.response_cache is None or not config.response_cache.enable:
        return []
    assert config.ensemble_scheduling is not None
    todo = [config]
    seen = {config.name}  # cycles are reported elsewhere; just do not loop
    while todo:
        current = todo.pop(0)
        assert current.ensemble_scheduling is not None
        for step in current.ensemble_scheduling.step:
            model = models.get(step.model_name)
            if model is not None and model.sequence_batching is not None:
                return [
                    f"ensemble '{config.name}': cannot enable response_cache because it "
                    f"contains the sequence model '{model.name}'"
                ]
            if (
                model is not None
                and model.ensemble_scheduling is not None
                and model.name not in seen
            ):
                seen.add(model.name)
                todo.append(model)
    return []


def bytes_tensors(config: ModelConfig) -> list[str]:
    """Names of the BYTES inputs and outputs of ``config`` (which JAX cannot trace)."""
    return [t.name for t in (*config.input, *config.output) if t.data_type is DataType.BYTES]
