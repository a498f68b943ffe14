"""`Model` is frozen data: a config and its code as one of a union of kinds (`Function`,
`TritonClass`, `OnnxGraph`), given as ``code=`` or by the keyword arguments; more than one
kind is refused when the model is made, naming it; each kind runs on the backend its row of
the table names."""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np
import pytest

import orchestrion
from orchestrion.backends import KINDS, kind_of
from orchestrion.protocols import DataType, ModelConfig, TensorConfig


def _config(name: str = "m", **fields: Any) -> ModelConfig:
    x = TensorConfig(name="X", data_type=DataType.FP32, dims=(2,))
    y = TensorConfig(name="Y", data_type=DataType.FP32, dims=(2,))
    return ModelConfig(name=name, input=(x,), output=(y,), **fields)


def _double(X: Any) -> dict[str, Any]:
    return {"Y": X * 2}


class _Triton:
    def execute(self, requests: list[Any]) -> list[Any]:
        return []


def test_keywords_make_one_kind_of_code() -> None:
    """Each keyword spelling gives its kind, the same as ``code=`` does."""
    function = orchestrion.Model(_config(), execute=_double, jit=False)
    assert function.code == orchestrion.Function(_double, jit=False)
    assert kind_of(function).name == "python"
    assert kind_of(orchestrion.Model(_config(), execute=_double)).name == "jax"
    triton = orchestrion.Model(_config(backend="python"), triton_model=_Triton)
    assert triton.code == orchestrion.TritonClass(_Triton)
    assert kind_of(triton).name == "triton_python"
    graph = orchestrion.Model(_config(platform="onnxruntime_onnx"), onnx=b"graph")
    assert graph.code == orchestrion.OnnxGraph(b"graph")
    assert kind_of(graph).name == "onnx"
    same = orchestrion.Model(_config(), code=orchestrion.Function(_double, jit=False))
    assert same.code == function.code
    assert orchestrion.Model(_config(platform="ensemble")).code is None


def test_every_kind_has_a_row() -> None:
    """Every kind of the union is run by some row of the table (and only those kinds)."""
    assert {row.code for row in KINDS} == {
        orchestrion.Function,
        orchestrion.TritonClass,
        orchestrion.OnnxGraph,
    }


@pytest.mark.parametrize(
    ("arguments", "given"),
    [
        ({"execute": _double, "triton_model": _Triton}, "execute/initialize/initial_state and "),
        ({"onnx": b"g", "triton_model": _Triton}, "triton_model and onnx"),
        ({"initialize": lambda c: None, "onnx": b"g"}, "and onnx"),
    ],
)
def test_two_kinds_of_code_are_refused_when_the_model_is_made(
    arguments: dict[str, Any], given: str
) -> None:
    with pytest.raises(orchestrion.ConfigError) as caught:
        orchestrion.Model(_config("two"), source="two/1/model.py", **arguments)
    message = str(caught.value)
    assert message.startswith("two/1/model.py (model 'two'): a model's code is one kind")
    assert given in message


def test_code_given_twice_is_refused() -> None:
    with pytest.raises(orchestrion.ConfigError, match=r"model 'm'\): give its code once"):
        orchestrion.Model(_config(), triton_model=_Triton, code=orchestrion.Function(_double))
    with pytest.raises(orchestrion.ConfigError, match=r"initialize, jit are parts of a Python"):
        orchestrion.Model(
            _config(), initialize=lambda c: 1, jit=False, code=orchestrion.TritonClass(_Triton)
        )


def test_function_keywords_change_a_functions_parts() -> None:
    """As ``attrs.evolve(model, initial_state=...)`` passes them: the rest is kept."""
    m = orchestrion.Model(_config(), execute=_double, jit=False)
    start = lambda config: 0  # noqa: E731
    changed = attrs.evolve(m, initial_state=start)
    assert changed.code == orchestrion.Function(_double, initial_state=start, jit=False)
    assert attrs.evolve(m, jit=True).code == orchestrion.Function(_double, jit=True)


@pytest.mark.parametrize("execute", [None, 3])
def test_initialize_without_a_callable_execute_says_so(execute: Any) -> None:
    with pytest.raises(orchestrion.ConfigError, match=r"m/1/model.py \(model 'm'\): defines no"):
        orchestrion.Model(
            _config(), execute=execute, initialize=lambda c: None, source="m/1/model.py"
        )


def test_a_model_is_frozen_and_changed_by_evolve() -> None:
    m = orchestrion.Model(_config(), execute=_double, jit=False, revision="r1")
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        m.revision = "r2"  # type: ignore[misc]
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        m.code.jit = True  # type: ignore[union-attr, misc]
    changed = attrs.evolve(m, revision="r2")
    assert (changed.revision, changed.code) == ("r2", m.code)
    assert m.revision == "r1"
    assert orchestrion.Model(_config()).revision != orchestrion.Model(_config()).revision


async def test_an_ensemble_with_code_is_refused_at_load() -> None:
    ensemble = orchestrion.Model(_config("e", platform="ensemble"), execute=_double)
    with pytest.raises(orchestrion.ConfigError, match=r"model 'e'\): an ensemble has no code"):
        async with orchestrion.open_server(models=[ensemble]):
            pass


async def test_a_model_given_as_code_serves() -> None:
    m = orchestrion.Model(_config(), code=orchestrion.Function(_double, jit=False))
    async with orchestrion.open_server(models=[m]) as server:
        response = await server.infer("m", {"X": np.array([1.0, 2.0], np.float32)})
    assert response.outputs["Y"].tolist() == [2.0, 4.0]
