"""The one table of model code kinds: which `ModelCode` each backend runs, the backend's class,
and its load-time checks. A new backend is its module and one row here.

`check_model` is every check a `Model` gets before it is served, at load time, so that
mistakes surface as a `ConfigError` naming the file, not as a confusing failure on the first
request: what holds for every model (a positive version, labels of outputs, an ensemble
without code, orchestrion's own ``execution`` and ``fusion`` parameters) and
`model_problems`, what its code cannot do (its kind against what its config names, the
``model.py`` contract of a Python function, ONNX's rules, the kind's own checks)."""

from __future__ import annotations

from collections.abc import Callable

import attrs

from ..protocols import (
    INITIAL_STATE_FOLDER,
    ONNX_BACKEND,
    ONNX_PLATFORM,
    OWN_BACKENDS,
    ExecutionMode,
    Function,
    FusionMode,
    Model,
    OnnxGraph,
    SequenceTensors,
    TritonClass,
    initial_state_problem,
    sequence_problems,
)
from ._base import Backend, ServerCalls
from ._function_contract import contract_problems
from ._jax import JaxBackend, jax_problems
from ._onnx import OnnxBackend, onnx_problems
from ._python import PythonBackend, python_problems
from ._triton_python import TritonPythonBackend, triton_problems

Problems = Callable[[Model, str, str], list[str]]
"""``(model, where, in_config)``: the ways the code cannot run (``where`` names the code,
``in_config`` the config, in the messages)."""


@attrs.frozen
class BackendKind:
    """One kind of model code and the backend that runs it."""

    name: str
    code: type
    """The `ModelCode` kind it runs."""
    backend: Callable[[Model, ServerCalls | None], Backend]
    problems: Problems
    runs: Callable[[Model], bool] = lambda _: True
    """Of the models with code of its kind, whether it runs ``model`` (the first row whose
    kind and test match does)."""
    reschedules: bool = False
    """Its code can reschedule requests (``sequence_batching { iterative_sequence }``)."""
    takes_states: bool = False
    """Its code takes a sequence's control inputs and implicit states as tensors (their
    ``initial_state`` data files are checked)."""
    chooses_execution: bool = True
    """The runtime's ``execution`` parameter (inline, thread) applies to it."""


def _jitted(model: Model) -> bool:
    return isinstance(model.code, Function) and model.code.jit


KINDS = (
    BackendKind(
        "triton_python",
        TritonClass,
        TritonPythonBackend,
        triton_problems,
        reschedules=True,
        takes_states=True,
        chooses_execution=False,
    ),
    BackendKind("onnx", OnnxGraph, lambda m, _: OnnxBackend(m), onnx_problems, takes_states=True),
    BackendKind("jax", Function, lambda m, _: JaxBackend(m), jax_problems, runs=_jitted),
    BackendKind("python", Function, lambda m, _: PythonBackend(m), python_problems),
)


def kind_of(model: Model) -> BackendKind:
    """The kind of ``model``'s code (a model with code, not an ensemble)."""
    return next(k for k in KINDS if isinstance(model.code, k.code) and k.runs(model))


def backend_for(model: Model, calls: ServerCalls | None = None) -> Backend:
    """The backend that runs ``model``'s code (a model, not an ensemble); ``calls``: what its
    code may call on the server (None: nothing, as in a model tested alone)."""
    return kind_of(model).backend(model, calls)


def model_problems(model: Model, where: str, in_config: str) -> list[str]:
    """The ways ``model``'s code cannot run on its backend (empty when it can): its kind
    against what its config names, then its kind's own checks. ``where`` names the code,
    ``in_config`` the config, in the messages."""
    config = model.config
    code = model.code
    if config.backend not in OWN_BACKENDS and not isinstance(code, TritonClass):
        return [
            f"{in_config}: backend '{config.backend}' is not supported (orchestrion runs "
            "Python/JAX models: backend 'python', 'jax' or empty; ONNX models: "
            f"'{ONNX_BACKEND}'; a python-based backend's TritonPythonModel: triton_model, "
            "or a repository's model with --backend-directory)"
        ]
    if config.is_onnx and not isinstance(code, OnnxGraph | TritonClass):
        return [
            f"{where}: platform '{config.platform or ONNX_PLATFORM}' runs an ONNX graph: "
            "give it (Model(onnx=path or bytes), or a <version>/model.onnx in a repository)"
        ]
    if isinstance(code, OnnxGraph) and not config.is_onnx:
        return [
            f"{in_config}: an ONNX model's config has platform '{ONNX_PLATFORM}' (or backend "
            f"'{ONNX_BACKEND}'), not platform '{config.platform}' and backend "
            f"'{config.backend}'"
        ]
    if code is None:
        return [f"{where}: defines no execute function"]
    kind = kind_of(model)
    problems = []
    if config.iterative and not kind.reschedules:
        problems.append(
            f"{in_config}: sequence_batching iterative_sequence is for python-backend models "
            "(a TritonPythonModel reschedules its requests); this model cannot"
        )
    problems += kind.problems(model, where, in_config)
    if isinstance(code, Function):
        problems += contract_problems(model, where, in_config)
    if kind.takes_states:
        problems += _initial_state_problems(model, in_config)
    return problems


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
