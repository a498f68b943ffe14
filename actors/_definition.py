"""A model's checks before it runs, and its execution and fusion modes.

A `Model` (``orchestrion.protocols``) comes either from a repository folder
(``<model>/<version>/model.py``, see ``_repository.py``) or straight from Python.
`check_model` checks what holds for every model (a positive version, labels of outputs, an
ensemble without code, a backend orchestrion has) and asks the model's backend what its code
cannot do there (``orchestrion.backends``: the ``model.py`` contract of a Python function is
the function backends', ``contract_problems``), at load time, so that mistakes surface as a
`ConfigError` naming the file, not as a confusing failure on the first request.
"""

from __future__ import annotations

import enum

from ..backends import contract_problems, model_problems
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
    return errors + contract_problems(model, where, in_config)


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
