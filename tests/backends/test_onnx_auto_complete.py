"""Triton's auto-complete of an ONNX model's config from its graph, and the checks of a config
against the graph (the pure rules; the repository tests load real graphs)."""

from __future__ import annotations

import pytest

from orchestrion.backends._onnx_config import (
    Graph,
    GraphTensor,
    complete_config,
    config_problems,
)
from orchestrion.protocols import (
    ConfigError,
    DataType,
    DynamicBatching,
    ModelConfig,
    Reshape,
    SequenceBatching,
    TensorConfig,
)


def _graph_tensor(
    name: str, dims: tuple[int, ...], type_name: str = "tensor(float)"
) -> GraphTensor:
    return GraphTensor(name=name, type_name=type_name, dims=dims)


def _graph(inputs: dict[str, tuple[int, ...]], outputs: dict[str, tuple[int, ...]]) -> Graph:
    return Graph(
        inputs=tuple(_graph_tensor(n, d) for n, d in inputs.items()),
        outputs=tuple(_graph_tensor(n, d) for n, d in outputs.items()),
    )


def _tensor(name: str, dims: tuple[int, ...], **kw: object) -> TensorConfig:
    return TensorConfig(name=name, data_type=DataType.FP32, dims=dims, **kw)  # type: ignore[arg-type]


BATCHING = _graph({"X": (-1, 3, 8)}, {"Y": (-1, 10)})
FIXED = _graph({"X": (1, 3, 8)}, {"Y": (1, 10)})


def _complete(graph: Graph, **config: object) -> ModelConfig:
    return complete_config(ModelConfig(name="m", **config), graph, "m/config.pbtxt")  # type: ignore[arg-type]


def test_a_graph_that_can_batch_gets_max_batch_size_4_and_the_dynamic_batcher() -> None:
    """No config: every tensor has a variable first dimension, so Triton's default of 4,
    the dynamic batcher, and dims without the batch dimension; both platform names."""
    config = _complete(BATCHING)
    assert config.max_batch_size == 4
    assert config.dynamic_batching == DynamicBatching()
    assert config.input == (_tensor("X", (3, 8)),)
    assert config.output == (_tensor("Y", (10,)),)
    assert (config.platform, config.backend) == ("onnxruntime_onnx", "onnxruntime")


@pytest.mark.parametrize(("size", "batcher"), [(8, True), (1, False)])
def test_a_given_max_batch_size_is_kept(size: int, batcher: bool) -> None:
    """A config with only ``max_batch_size`` keeps it; the batcher comes only above 1."""
    config = _complete(BATCHING, max_batch_size=size)
    assert config.max_batch_size == size
    assert (config.dynamic_batching is not None) is batcher


def test_a_scheduler_in_the_config_is_not_replaced() -> None:
    """Sequence batching in the config: no dynamic batcher is added (Triton's rule)."""
    config = _complete(BATCHING, max_batch_size=8, sequence_batching=SequenceBatching())
    assert config.dynamic_batching is None


def test_a_graph_that_cannot_batch_keeps_its_whole_shape() -> None:
    """A fixed first dimension: no batching, and the dims are the graph's as they are."""
    config = _complete(FIXED)
    assert config.max_batch_size == 0
    assert config.dynamic_batching is None
    assert config.input == (_tensor("X", (1, 3, 8)),)


def test_max_batch_size_for_a_graph_that_cannot_batch_is_an_error() -> None:
    """Triton refuses ``max_batch_size`` for a graph without a variable first dimension; the
    message names the file and every shape."""
    with pytest.raises(
        ConfigError, match=r"m/config.pbtxt \(model 'm'\): max_batch_size is 2, but"
    ):
        _complete(FIXED, max_batch_size=2)


def test_scalars_become_dims_1_with_an_empty_reshape_when_batching() -> None:
    """A scalar per batch item is ``dims: [1]`` with ``reshape: { shape: [] }``; a scalar
    of a graph that cannot batch is ``dims: [1]``."""
    batched = _complete(_graph({"X": (-1,)}, {"Y": (-1,)}))
    assert batched.input == (_tensor("X", (1,), reshape=Reshape(shape=())),)
    plain = _complete(_graph({"X": ()}, {"Y": ()}))
    assert plain.input == (_tensor("X", (1,)),)


def test_a_config_with_inputs_and_outputs_is_not_completed() -> None:
    """Inputs and outputs given: nothing is deduced (not even batching), as in Triton."""
    inputs, outputs = (_tensor("X", (-1, 3, 8)),), (_tensor("Y", (-1, 10)),)
    config = _complete(BATCHING, input=inputs, output=outputs)
    assert (config.max_batch_size, config.input, config.output) == (0, inputs, outputs)


def test_only_the_missing_side_is_completed() -> None:
    """Inputs given, outputs not: the outputs come from the graph, the inputs stay."""
    inputs = (_tensor("X", (3, -1)),)
    config = _complete(BATCHING, max_batch_size=2, input=inputs)
    assert config.input == inputs
    assert config.output == (_tensor("Y", (10,)),)


def test_a_tensor_no_triton_type_carries_is_an_error() -> None:
    """A sequence output cannot be completed: the error names it and its type."""
    graph = Graph(
        inputs=(_graph_tensor("X", (-1,)),),
        outputs=(_graph_tensor("Y", (), "seq(tensor(float))"),),
    )
    with pytest.raises(ConfigError, match=r"output 'Y' is seq\(tensor\(float\)\)"):
        _complete(graph)


def _problems(config: ModelConfig, graph: Graph = BATCHING) -> list[str]:
    return config_problems(config, graph, "m/config.pbtxt", "m/1/model.onnx")


def _config(inputs: tuple[TensorConfig, ...], max_batch_size: int = 4) -> ModelConfig:
    output = _tensor("Y", (10,) if max_batch_size else (-1, 10))
    return ModelConfig(name="m", max_batch_size=max_batch_size, input=inputs, output=(output,))


@pytest.mark.parametrize(
    ("inputs", "max_batch_size", "expected"),
    [
        (
            (_tensor("X", (3, 8)), _tensor("Z", (1,))),
            4,
            "input 'Z': not in the graph, whose names are X",
        ),
        (
            (TensorConfig(name="X", data_type=DataType.INT64, dims=(3, 8)),),
            4,
            "input 'X': TYPE_INT64 in the config, TYPE_FP32 in the graph",
        ),
        ((_tensor("X", (24,)),), 4, "input 'X': shape [-1, 3, 8] in the graph, [batch, 24] in"),
        ((_tensor("X", (3, 9)),), 4, "input 'X': shape [-1, 3, 8] in the graph, [batch, 3, 9]"),
        ((_tensor("X", (-1, 3, 8)),), 0, None),
        ((_tensor("X", (5, 3, 8)),), 0, None),
        ((_tensor("X", (3, -1)),), 4, None),
        ((_tensor("X", (2, 12), reshape=Reshape(shape=(3, 8))),), 4, None),
        ((), 4, "the graph in m/1/model.onnx has inputs the config does not declare: X"),
    ],
)
def test_config_against_graph(
    inputs: tuple[TensorConfig, ...], max_batch_size: int, expected: str | None
) -> None:
    """Names, types, ranks and dimensions both fix must agree (a ``reshape`` is what the
    graph sees; -1 on either side matches anything); each problem names the config, the
    tensor and the model file."""
    problems = _problems(_config(inputs, max_batch_size))
    if expected is None:
        assert problems == []
    else:
        assert len(problems) == 1, problems
        assert problems[0].startswith("m/config.pbtxt (model 'm'): ")
        assert expected in problems[0]
        assert "m/1/model.onnx" in problems[0]


def test_batching_needs_a_variable_first_dimension_in_the_graph() -> None:
    """``max_batch_size > 0`` against a graph whose first dimension is fixed says why."""
    problems = _problems(_config((_tensor("X", (3, 8)),)), FIXED)
    assert any(
        "input 'X': shape [1, 3, 8] in the graph, whose first dimension is not variable" in p
        for p in problems
    )


def test_an_overridable_initializer_may_be_declared_as_an_input() -> None:
    """A config input naming an initializer the graph lets requests override is accepted."""
    graph = Graph(
        inputs=BATCHING.inputs,
        outputs=BATCHING.outputs,
        initializers=(_graph_tensor("SCALE", (1,)),),
    )
    config = ModelConfig(
        name="m",
        input=(_tensor("X", (-1, 3, 8)), _tensor("SCALE", (1,))),
        output=(_tensor("Y", (-1, 10)),),
    )
    assert _problems(config, graph) == []
