"""A model's checks before it runs, and its execution and fusion modes.

A `Model` (``orchestrion.protocols``) comes either from a repository folder
(``<model>/<version>/model.py``, see ``_repository.py``) or straight from Python.
`check_model` checks what holds for every model (a positive version, labels of outputs, an
ensemble without code, the runtime's ``execution`` parameter) and asks the backends what the
model's code cannot do (``orchestrion.backends.model_problems``: its kind against its config,
the ``model.py`` contract of a Python function, ONNX's rules), at load time, so that
mistakes surface as a `ConfigError` naming the file, not as a confusing failure on the first
request.
"""

from __future__ import annotations

import enum

from ..backends import kind_of, model_problems
from ..protocols import Model, ModelConfig
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
    """The ways ``model`` cannot be served (empty when it can): what holds for every model
    here, its code's problems from its backend (`model_problems`)."""
    where = f"{model.source} (model '{model.name}')"
    in_config = f"{model.config_source} (model '{model.name}')"
    config = model.config
    if model.version < 1:
        return [f"{where}: version must be a positive integer, got {model.version}"]
    unlabelled = sorted(set(model.labels) - {t.name for t in config.output})
    if unlabelled:
        return [f"{where}: labels are given for {unlabelled}, which are not outputs"]
    if config.is_ensemble:
        if model.code is not None:
            return [f"{where}: an ensemble has no code (execute, initialize, a class or a graph)"]
        fusion = config.parameters.get("fusion", FusionMode.ON)
        if fusion not in tuple(FusionMode):
            return [
                f"{in_config}: parameter 'fusion' must be one of "
                f"{', '.join(m.value for m in FusionMode)}, got '{fusion}'"
            ]
        return []
    problems = model_problems(model, where, in_config)
    if model.code is not None and kind_of(model).chooses_execution:
        problems += _mode_problems(model, in_config)
    return problems
