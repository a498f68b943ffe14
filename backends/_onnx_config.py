"""An ONNX model's config against its graph: Triton's auto-complete, and the checks at load.

How this works: ONNX Runtime describes a graph's inputs and outputs (`GraphTensor`: a name,
ONNX Runtime's type string, the dims with ``-1`` for a symbolic or unknown one). Auto-complete
follows Triton's onnxruntime backend: a config that names both inputs and outputs is left as
it is; otherwise the graph decides whether the model can batch (every input and output has
a variable first dimension), a batching model without ``max_batch_size`` gets 4 (Triton's
``default-max-batch-size``) and, above 1, the dynamic batcher unless the config has a
scheduler, a model that cannot batch must not set ``max_batch_size``, and the missing inputs
or outputs are taken from the graph (the batch dimension left out; a scalar becomes ``dims:
[1]``, with an empty ``reshape`` when batching). `config_problems` then checks the config
against the graph: names, data types, ranks and every dimension both fix, the batch
dimension a batching model needs. Nothing here imports ONNX Runtime (``_onnx.py`` does).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from ..protocols import (
    ONNX_BACKEND,
    ONNX_PLATFORM,
    ConfigError,
    DataType,
    DynamicBatching,
    ModelConfig,
    Reshape,
    TensorConfig,
    sequence_tensor_names,
)

_log = logging.getLogger("orchestrion")

DEFAULT_MAX_BATCH_SIZE = 4
"""The ``max_batch_size`` auto-complete gives a model that can batch (Triton's
``--backend-config=onnxruntime,default-max-batch-size``, 4 by default)."""

_ORT_TYPES = {
    "tensor(bool)": DataType.BOOL,
    "tensor(uint8)": DataType.UINT8,
    "tensor(uint16)": DataType.UINT16,
    "tensor(uint32)": DataType.UINT32,
    "tensor(uint64)": DataType.UINT64,
    "tensor(int8)": DataType.INT8,
    "tensor(int16)": DataType.INT16,
    "tensor(int32)": DataType.INT32,
    "tensor(int64)": DataType.INT64,
    "tensor(float16)": DataType.FP16,
    "tensor(float)": DataType.FP32,
    "tensor(double)": DataType.FP64,
    "tensor(bfloat16)": DataType.BF16,
    "tensor(string)": DataType.BYTES,
}
"""ONNX Runtime's element types and Triton's data types, as Triton's backend maps them."""


@attrs.frozen(kw_only=True)
class GraphTensor:
    """An input or output of an ONNX graph, as ONNX Runtime describes it."""

    name: str
    type_name: str
    """ONNX Runtime's type: ``tensor(float)``, ``tensor(string)``, ``seq(...)``, ..."""
    dims: tuple[int, ...]
    """Its shape; -1 where the graph leaves a dimension open (symbolic or unknown)."""

    @property
    def data_type(self) -> DataType | None:
        """Its Triton data type (None: one Triton has none for, a sequence or a map)."""
        return _ORT_TYPES.get(self.type_name)

    @property
    def type_label(self) -> str:
        """Its type as a config writes it (``TYPE_FP32``), or ONNX Runtime's name."""
        data_type = self.data_type
        return data_type.config_name if data_type is not None else self.type_name

    @classmethod
    def of(cls, node: Any) -> GraphTensor:
        """From ONNX Runtime's ``NodeArg`` (``name``, ``type``, ``shape``)."""
        shape = node.shape if isinstance(node.shape, list | tuple) else []
        dims = tuple(d if isinstance(d, int) and d >= 0 else -1 for d in shape)
        return cls(name=node.name, type_name=str(node.type), dims=dims)


@attrs.frozen(kw_only=True)
class Graph:
    """What a config is checked against: the graph's inputs and outputs, and the
    initializers a request may override (which a config may declare as inputs)."""

    inputs: tuple[GraphTensor, ...]
    outputs: tuple[GraphTensor, ...]
    initializers: tuple[GraphTensor, ...] = ()

    def can_batch(self) -> bool:
        """Triton's rule: every input and output has a variable first dimension."""
        return all(t.dims and t.dims[0] == -1 for t in (*self.inputs, *self.outputs))


def graph_problems(graph: Graph, where: str) -> list[str]:
    """Inputs and outputs whose type Triton's data types cannot carry."""
    return [
        f"{where}: {kind} '{tensor.name}' is {tensor.type_name}, which no Triton data type "
        "carries (tensors of numbers, booleans or strings only)"
        for kind, tensors in (("input", graph.inputs), ("output", graph.outputs))
        for tensor in tensors
        if tensor.data_type is None
    ]


def _tensor_configs(
    tensors: Sequence[GraphTensor], max_batch_size: int
) -> tuple[TensorConfig, ...]:
    made = []
    for tensor in tensors:
        assert tensor.data_type is not None  # graph_problems first
        dims = tensor.dims[1:] if max_batch_size > 0 else tensor.dims
        reshape = None
        if not dims:  # a scalar per batch item (or a scalar): Triton's dims [1]
            dims = (1,)
            reshape = Reshape(shape=()) if max_batch_size > 0 else None
        made.append(
            TensorConfig(name=tensor.name, data_type=tensor.data_type, dims=dims, reshape=reshape)
        )
    return tuple(made)


def complete_config(config: ModelConfig, graph: Graph, source: str) -> ModelConfig:
    """``config`` completed from ``graph`` as Triton's onnxruntime backend does (see the
    module), with both ``platform`` and ``backend`` named.

    Raises:
        ConfigError: the graph has a tensor no Triton type carries, or the config sets
            ``max_batch_size`` for a graph that cannot batch (``source`` named).
    """
    config = attrs.evolve(config, platform=ONNX_PLATFORM, backend=ONNX_BACKEND)
    if config.input and config.output:
        return config  # Triton: "inputs and outputs already specified"
    where = f"{source} (model '{config.name}')"
    problems = graph_problems(graph, where)
    if problems:
        raise ConfigError(problems)
    max_batch_size = config.max_batch_size
    dynamic_batching = config.dynamic_batching
    if graph.can_batch():
        if max_batch_size == 0:
            max_batch_size = DEFAULT_MAX_BATCH_SIZE
            _log.warning(
                "%s: max_batch_size set to %d: the graph can batch and the config sets none "
                "(set max_batch_size for another size, as in Triton)",
                where,
                max_batch_size,
            )
        if max_batch_size > 1 and dynamic_batching is None and config.sequence_batching is None:
            dynamic_batching = DynamicBatching()
    elif max_batch_size != 0:
        shapes = ", ".join(f"'{t.name}' {list(t.dims)}" for t in (*graph.inputs, *graph.outputs))
        raise ConfigError(
            f"{where}: max_batch_size is {max_batch_size}, but the graph cannot batch: not "
            f"every input and output has a variable first dimension ({shapes})"
        )
    # A sequence batcher's control and state tensors are the runtime's, not the client's.
    batcher = sequence_tensor_names(config)
    inputs = [t for t in graph.inputs if t.name not in batcher]
    outputs = [t for t in graph.outputs if t.name not in batcher]
    return attrs.evolve(
        config,
        max_batch_size=max_batch_size,
        dynamic_batching=dynamic_batching,
        input=config.input or _tensor_configs(inputs, max_batch_size),
        output=config.output or _tensor_configs(outputs, max_batch_size),
    )


def _shape_problem(
    tensor: TensorConfig, graph_dims: tuple[int, ...], max_batch_size: int
) -> str | None:
    """How ``tensor``'s shape (its ``reshape`` when it has one) disagrees with the graph's
    (None: it agrees): ranks, and each dimension both fix; a scalar of the graph is any
    shape of ones."""
    dims = tensor.reshape.shape if tensor.reshape is not None else tensor.dims
    if not graph_dims and max_batch_size == 0:
        return None if all(d == 1 for d in dims) else f"a scalar in the graph, {list(dims)}"
    full = (-1, *dims) if max_batch_size > 0 else dims
    if max_batch_size > 0 and (not graph_dims or graph_dims[0] != -1):
        return (
            f"shape {list(graph_dims)} in the graph, whose first dimension is not variable, "
            f"so it cannot take a batch (max_batch_size {max_batch_size})"
        )
    if len(full) != len(graph_dims) or any(
        c != g and c != -1 and g != -1 for c, g in zip(full, graph_dims, strict=False)
    ):
        shown = "[batch, " + ", ".join(map(str, dims)) + "]" if max_batch_size > 0 else list(dims)
        return f"shape {list(graph_dims)} in the graph, {shown} in the config"
    return None


def config_problems(
    config: ModelConfig, graph: Graph, config_source: str, model_file: str
) -> list[str]:
    """Every way ``config`` disagrees with ``graph`` (empty: none), each naming the config
    and the model file: an input or output the graph lacks, a data type, a shape, a graph
    input the config leaves out."""
    where = f"{config_source} (model '{config.name}')"
    problems = []
    graph_inputs = {t.name: t for t in (*graph.initializers, *graph.inputs)}
    graph_outputs = {t.name: t for t in graph.outputs}
    declared = {t.name for t in config.input}
    missing = [t.name for t in graph.inputs if t.name not in declared]
    if missing:
        problems.append(
            f"{where}: the graph in {model_file} has inputs the config does not declare: "
            f"{', '.join(missing)}"
        )
    for kind, tensors, found in (
        ("input", config.input, graph_inputs),
        ("output", config.output, graph_outputs),
    ):
        for tensor in tensors:
            problem = _tensor_problem(tensor, found, config.max_batch_size)
            if problem is not None:
                problems.append(f"{where}: {kind} '{tensor.name}': {problem} ({model_file})")
    return problems


def _tensor_problem(
    tensor: TensorConfig, found: Mapping[str, GraphTensor], max_batch_size: int
) -> str | None:
    in_graph = found.get(tensor.name)
    if in_graph is None:
        return f"not in the graph, whose names are {', '.join(found) or 'none'}"
    if in_graph.data_type is not tensor.data_type:
        return f"{tensor.data_type.config_name} in the config, {in_graph.type_label} in the graph"
    return _shape_problem(tensor, in_graph.dims, max_batch_size)


_BOOLS = {"1": True, "true": True, "on": True, "0": False, "false": False, "off": False}


def parse_bool(value: str) -> bool:
    """A boolean parameter as Triton reads one (``1``/``true``/``on``, ``0``/``false``/``off``).

    Raises:
        ValueError: anything else.
    """
    try:
        return _BOOLS[value.strip().lower()]
    except KeyError:
        raise ValueError(f"'{value}' is not a boolean (1, true, on, 0, false, off)") from None


INT_PARAMETERS = ("intra_op_thread_count", "inter_op_thread_count")
BOOL_PARAMETERS = ("enable_mem_arena", "enable_mem_pattern")


def parameter_problems(config: ModelConfig, where: str) -> list[str]:
    """The ONNX Runtime parameters (Triton's names) whose values cannot be used."""
    parameters = config.parameters
    problems = []
    for name in INT_PARAMETERS:
        if name in parameters:
            value = parameters[name]
            if not value.strip().lstrip("+").isdigit():
                problems.append(f"{where}: parameter '{name}' must be a count >= 0, got '{value}'")
    for name in BOOL_PARAMETERS:
        if name in parameters:
            try:
                parse_bool(parameters[name])
            except ValueError as exc:
                problems.append(f"{where}: parameter '{name}': {exc}")
    if parameters.get("execution_mode", "0").strip() not in ("0", "1"):
        problems.append(
            f"{where}: parameter 'execution_mode' must be 0 (sequential) or 1 (parallel), got "
            f"'{parameters['execution_mode']}'"
        )
    level = graph_level(config)
    if level not in (-1, 0, 1, 2):
        problems.append(
            f"{where}: optimization graph level must be -1 (basic), 1 (extended), 2 (none) or "
            f"0 (all, the default), got {level!r}"
        )
    return problems


def graph_level(config: ModelConfig) -> object:
    """``optimization { graph { level } }`` (0 when absent: every optimization)."""
    optimization = config.optimization or {}
    graph = optimization.get("graph") if isinstance(optimization, Mapping) else None
    if not isinstance(graph, Mapping):
        return 0
    level = graph.get("level", 0)
    try:
        return int(level)
    except (TypeError, ValueError):
        return level
