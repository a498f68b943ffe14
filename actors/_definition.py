"""What a model is before it runs: its config and its code (the ``model.py`` contract).

A `Model` comes either from a repository folder (``<model>/<version>/model.py``, see
``_repository.py``) or straight from Python. `check_model` enforces the ``model.py`` contract
(one ``execute`` parameter per config input, by name; ``params`` first when ``initialize``
is defined; ``state`` for a stateful model; a generator exactly when the model is decoupled)
and asks the model's backend what its code cannot do there (``orchestrion.backends``), at
load time, so that mistakes surface as a `ConfigError` naming the file, not as a confusing
failure on the first request.
"""

from __future__ import annotations

import enum
import inspect

from ..backends import model_problems
from ..protocols import (
    INITIAL_STATE_FOLDER,
    ONNX_BACKEND,
    ONNX_PLATFORM,
    OWN_BACKENDS,
    Model,
    ModelConfig,
    SequenceTensors,
    initial_state_problem,
    sequence_problems,
    sequence_tensor_names,
)
from ._instances import ExecutionMode


class FusionMode(enum.StrEnum):
    """An ensemble's ``fusion`` parameter (see the module)."""

    ON = "on"
    """The steps' own executables, one after another (the default)."""
    XLA = "xla"
    """The steps traced into one ``jax.jit`` function."""
    OFF = "off"
    """The scheduler for every request."""


def fusion_mode(config: ModelConfig) -> FusionMode:
    """An ensemble's ``fusion`` parameter (checked by `check_model` at load)."""
    return FusionMode(config.parameters.get("fusion", FusionMode.ON))


def _mode_problems(model: Model, in_config: str) -> list[str]:
    mode = model.config.parameters.get("execution", ExecutionMode.AUTO)
    if mode in tuple(ExecutionMode):
        return []
    return [
        f"{in_config}: parameter 'execution' must be one of "
        f"{', '.join(m.value for m in ExecutionMode)}, got '{mode}'"
    ]


def check_model(model: Model) -> list[str]:
    """The ways ``model`` breaks the ``model.py`` contract (empty when it is fine)."""
    where = f"{model.source} (model '{model.name}')"
    in_config = f"{model.config_source} (model '{model.name}')"
    config = model.config
    if model.version < 1:
        return [f"{where}: version must be a positive integer, got {model.version}"]
    unlabelled = sorted(set(model.labels) - {t.name for t in config.output})
    if unlabelled:
        return [f"{where}: labels are given for {unlabelled}, which are not outputs"]
    if config.is_ensemble:
        if model.execute is not None or model.initialize is not None:
            return [f"{where}: an ensemble has no execute or initialize"]
        fusion = config.parameters.get("fusion", FusionMode.ON)
        if fusion not in tuple(FusionMode):
            return [
                f"{in_config}: parameter 'fusion' must be one of "
                f"{', '.join(m.value for m in FusionMode)}, got '{fusion}'"
            ]
        return []
    if config.backend not in OWN_BACKENDS and model.triton_model is None:
        return [
            f"{in_config}: backend '{config.backend}' is not supported (orchestrion runs "
            "Python/JAX models: backend 'python', 'jax' or empty; ONNX models: "
            f"'{ONNX_BACKEND}'; a python-based backend's TritonPythonModel: triton_model, "
            "or a repository's model with --backend-directory)"
        ]
    if model.triton_model is not None:
        if model.execute is not None or model.initialize is not None:
            return [f"{where}: a Triton python model (triton_model) has no execute or initialize"]
        return model_problems(model, where, in_config) + _initial_state_problems(model, in_config)
    if model.onnx is not None or config.is_onnx:
        return _onnx_problems(model, where, in_config) + _initial_state_problems(model, in_config)
    if model.execute is None or not callable(model.execute):
        return [f"{where}: defines no execute function"]
    if sequence_tensor_names(config):
        return [
            f"{in_config}: sequence_batching control_input and state are for Triton's "
            "backends (ONNX and python models): a model.py with execute receives its "
            "sequence's state through execute (a state parameter, (outputs, new_state) back)"
        ]
    errors = model_problems(model, where, in_config) + _mode_problems(model, in_config)
    errors += _kind_problems(model, where, in_config)
    return errors + _parameter_problems(model, where)


def _onnx_problems(model: Model, where: str, in_config: str) -> list[str]:
    """An ONNX model: its graph given, no code, a config that says what it is."""
    if model.onnx is None:
        return [
            f"{where}: platform '{model.config.platform or ONNX_PLATFORM}' runs an ONNX graph: "
            "give it (Model(onnx=path or bytes), or a <version>/model.onnx in a repository)"
        ]
    if model.execute is not None or model.initialize is not None:
        return [f"{where}: an ONNX model (onnx) has no execute or initialize"]
    if not model.config.is_onnx:
        return [
            f"{in_config}: an ONNX model's config has platform '{ONNX_PLATFORM}' (or backend "
            f"'{ONNX_BACKEND}'), not platform '{model.config.platform}' and backend "
            f"'{model.config.backend}'"
        ]
    return model_problems(model, where, in_config) + _mode_problems(model, in_config)


def _kind_problems(model: Model, where: str, in_config: str) -> list[str]:
    """What the config says the model is (decoupled, stateful, batching) against its code."""
    config = model.config
    errors = []
    generator = inspect.isgeneratorfunction(model.execute) or inspect.isasyncgenfunction(
        model.execute
    )
    if generator and not config.decoupled:
        errors.append(
            f"{where}: execute is a generator, which is how decoupled models respond; set "
            "model_transaction_policy { decoupled: true } in the config"
        )
    if config.decoupled and not generator:
        errors.append(
            f"{where}: a decoupled model's execute is a generator: yield each response "
            "(zero or more), instead of returning one"
        )
    if config.decoupled and config.stateful:
        errors.append(f"{in_config}: a decoupled model cannot also be stateful")
    stateful = config.stateful
    if stateful and config.dynamic_batching is not None:
        errors.append(f"{in_config}: sequence_batching and dynamic_batching exclude each other")
    if model.initial_state is not None and not stateful:
        errors.append(
            f"{where}: initial_state is for stateful models; the config has no sequence_batching"
        )
    return errors


def _initial_state_problems(model: Model, in_config: str) -> list[str]:
    """Each state's ``initial_state`` ``data_file``: given, and of the right size."""
    config = model.config
    if config.sequence_batching is None or sequence_problems(config):
        return []  # the config's own problems are reported with the config
    problems = []
    for state in SequenceTensors.of(config).states:
        if not state.data_file:
            continue
        data = model.initial_states.get(state.input_name)
        if data is None:
            problems.append(
                f"{in_config}: state '{state.input_name}': its initial_state data_file "
                f"'{state.data_file}' was not given (a repository's model reads it from "
                f"{INITIAL_STATE_FOLDER}/{state.data_file} in its folder)"
            )
            continue
        problem = initial_state_problem(state, data, in_config)
        if problem is not None:
            problems.append(problem)
    return problems


def _parameter_problems(model: Model, where: str) -> list[str]:
    """``execute``'s parameters against the config's inputs (params and state first)."""
    config = model.config
    stateful = config.stateful
    errors: list[str] = []
    try:
        signature = inspect.signature(model.execute)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return errors
    params = list(signature.parameters.values())
    inputs = {t.name for t in config.input}
    if model.initialize is not None:
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if not positional or positional[0].name in inputs:
            errors.append(
                f"{where}: initialize is defined, so execute receives its params first: "
                f"execute(params, {', '.join(t.name for t in config.input)})"
            )
            return errors
        params.remove(positional[0])
    params = [p for p in params if p.name != "request"]
    if stateful:
        if "state" not in {p.name for p in params}:
            errors.append(
                f"{where}: a stateful model (sequence_batching) receives its sequence's state: "
                f"execute({'params, ' if model.initialize else ''}state, "
                f"{', '.join(t.name for t in config.input)}) -> (outputs, new_state)"
            )
        params = [p for p in params if p.name != "state"]
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return errors
    accepted = {p.name for p in params if p.kind is not p.POSITIONAL_ONLY}
    missing = sorted(inputs - accepted)
    if missing:
        errors.append(
            f"{where}: execute has no parameter for inputs {', '.join(missing)} "
            "(one parameter per config input, by name)"
        )
    required = sorted(
        p.name
        for p in params
        if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL,) and p.name not in inputs
    )
    if required:
        errors.append(
            f"{where}: execute requires parameters that are not config inputs: "
            + ", ".join(required)
        )
    optional_without_default = sorted(
        t.name
        for t in config.input
        if t.optional
        and t.name in signature.parameters
        and signature.parameters[t.name].default is inspect.Parameter.empty
    )
    if optional_without_default:
        errors.append(
            f"{where}: optional inputs need a default value in execute: "
            + ", ".join(optional_without_default)
        )
    return errors
