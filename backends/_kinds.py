"""The one table of model code kinds: which `Model` each backend runs, the backend's class,
and its load-time checks. A new backend is its module and one row here."""

from __future__ import annotations

from collections.abc import Callable

import attrs

from ..protocols import Model
from ._base import Backend, ServerCalls
from ._jax import JaxBackend, jax_problems
from ._onnx import OnnxBackend, onnx_problems
from ._python import PythonBackend, python_problems
from ._triton_python import TritonPythonBackend, triton_problems

Problems = Callable[[Model, str, str], list[str]]
"""``(model, where, in_config)``: the ways the code cannot run (``where`` names the code,
``in_config`` the config, in the messages)."""


@attrs.frozen
class BackendKind:
    """One kind of model code."""

    name: str
    runs: Callable[[Model], bool]
    """Whether this kind runs ``model`` (the first row that says so does)."""
    backend: Callable[[Model, ServerCalls | None], Backend]
    problems: Problems
    reschedules: bool = False
    """Its code can reschedule requests (``sequence_batching { iterative_sequence }``)."""


KINDS = (
    BackendKind(
        "triton_python",
        lambda m: m.triton_model is not None,
        TritonPythonBackend,
        triton_problems,
        reschedules=True,
    ),
    BackendKind("onnx", lambda m: m.onnx is not None, lambda m, _: OnnxBackend(m), onnx_problems),
    BackendKind("jax", lambda m: m.jit, lambda m, _: JaxBackend(m), jax_problems),
    BackendKind("python", lambda m: True, lambda m, _: PythonBackend(m), python_problems),
)


def kind_of(model: Model) -> BackendKind:
    """The kind of ``model``'s code (a model, not an ensemble)."""
    return next(kind for kind in KINDS if kind.runs(model))


def backend_for(model: Model, calls: ServerCalls | None = None) -> Backend:
    """The backend that runs ``model``'s code (a model, not an ensemble); ``calls``: what its
    code may call on the server (None: nothing, as in a model tested alone)."""
    return kind_of(model).backend(model, calls)


def model_problems(model: Model, where: str, in_config: str) -> list[str]:
    """The ways ``model``'s code cannot run on its backend (empty when it can): ``where``
    names the code, ``in_config`` the config, in the messages."""
    kind = kind_of(model)
    problems = []
    if model.config.iterative and not kind.reschedules:
        problems.append(
            f"{in_config}: sequence_batching iterative_sequence is for python-backend models "
            "(a TritonPythonModel reschedules its requests); this model cannot"
        )
    return problems + kind.problems(model, where, in_config)
