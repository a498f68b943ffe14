"""ONNX graphs for the tests, made with the ``onnx`` package, and model folders holding them."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from orchestrion.protocols import DataType

OPSET = 17
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "onnx_pipeline"
"""The ONNX pipeline example (its ``network.py`` builds its classifier's graph)."""

ELEMENT_TYPES = {
    DataType.BOOL: TensorProto.BOOL,
    DataType.UINT8: TensorProto.UINT8,
    DataType.UINT16: TensorProto.UINT16,
    DataType.UINT32: TensorProto.UINT32,
    DataType.UINT64: TensorProto.UINT64,
    DataType.INT8: TensorProto.INT8,
    DataType.INT16: TensorProto.INT16,
    DataType.INT32: TensorProto.INT32,
    DataType.INT64: TensorProto.INT64,
    DataType.FP16: TensorProto.FLOAT16,
    DataType.FP32: TensorProto.FLOAT,
    DataType.FP64: TensorProto.DOUBLE,
    DataType.BF16: TensorProto.BFLOAT16,
    DataType.BYTES: TensorProto.STRING,
}

Dims = Sequence[int | str]
"""A graph tensor's shape: numbers, or names for symbolic (variable) dimensions."""


def _model(graph: object) -> bytes:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 8  # what every ONNX Runtime of the last years reads
    return bytes(model.SerializeToString())


def identity(pairs: Sequence[tuple[str, str, DataType, Dims]]) -> bytes:
    """A graph of Identity nodes: each ``(input, output, type, dims)`` copied through."""
    nodes = [helper.make_node("Identity", [i], [o]) for i, o, _, _ in pairs]
    inputs = [helper.make_tensor_value_info(i, ELEMENT_TYPES[t], list(d)) for i, _, t, d in pairs]
    outputs = [helper.make_tensor_value_info(o, ELEMENT_TYPES[t], list(d)) for _, o, t, d in pairs]
    return _model(helper.make_graph(nodes, "identity", inputs, outputs))


def add(dims: Dims = ("batch", 4), name_a: str = "A", name_b: str = "B") -> bytes:
    """``SUM = A + B`` and ``DIFF = A - B``, FP32."""
    nodes = [
        helper.make_node("Add", [name_a, name_b], ["SUM"]),
        helper.make_node("Sub", [name_a, name_b], ["DIFF"]),
    ]
    inputs = [
        helper.make_tensor_value_info(n, TensorProto.FLOAT, list(dims)) for n in (name_a, name_b)
    ]
    outputs = [
        helper.make_tensor_value_info(n, TensorProto.FLOAT, list(dims)) for n in ("SUM", "DIFF")
    ]
    return _model(helper.make_graph(nodes, "add", inputs, outputs))


def classifier(classes: int = 1000, seed: int = 0) -> bytes:
    """A small image classifier shaped like Triton's quick-start ``densenet_onnx``: input
    ``data_0`` FP32 [1, 3, 224, 224], output ``fc6_1`` FP32 [1, classes, 1, 1] (a strided
    convolution, ReLU, global average pooling and a 1x1 convolution, random weights)."""
    rng = np.random.default_rng(seed)
    conv = numpy_helper.from_array(rng.normal(0, 0.1, (8, 3, 7, 7)).astype(np.float32), "conv_w")
    head = numpy_helper.from_array(
        rng.normal(0, 1.0, (classes, 8, 1, 1)).astype(np.float32), "head_w"
    )
    bias = numpy_helper.from_array(rng.normal(0, 0.1, (classes,)).astype(np.float32), "head_b")
    nodes = [
        helper.make_node("Conv", ["data_0", "conv_w"], ["c1"], strides=[4, 4], pads=[3, 3, 3, 3]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("GlobalAveragePool", ["r1"], ["pooled"]),
        helper.make_node("Conv", ["pooled", "head_w", "head_b"], ["fc6_1"]),
    ]
    graph = helper.make_graph(
        nodes,
        "classifier",
        [helper.make_tensor_value_info("data_0", TensorProto.FLOAT, [1, 3, 224, 224])],
        [helper.make_tensor_value_info("fc6_1", TensorProto.FLOAT, [1, classes, 1, 1])],
        [conv, head, bias],
    )
    return _model(graph)


def model_folder(
    repository: Path,
    name: str,
    graph: bytes | None,
    config: str | None = None,
    *,
    filename: str = "model.onnx",
) -> Path:
    """``repository/name`` with ``1/<filename>`` holding ``graph`` (None: no file) and a
    ``config.pbtxt`` when ``config`` is given."""
    folder = repository / name
    (folder / "1").mkdir(parents=True)
    if graph is not None:
        (folder / "1" / filename).write_bytes(graph)
    if config is not None:
        (folder / "config.pbtxt").write_text(config)
    return folder


def example_network() -> ModuleType:
    """The ONNX pipeline example's ``network.py``, its graph written into the example's
    repository (as ``orchestrion run`` does first)."""
    spec = importlib.util.spec_from_file_location("_onnx_example_network", EXAMPLE / "network.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    module.ensure_graph()
    return module
