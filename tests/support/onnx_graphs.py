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


def add_sub(data_type: DataType = DataType.INT32, width: int = 16) -> bytes:
    """``OUTPUT0 = INPUT0 + INPUT1``, ``OUTPUT1 = INPUT0 - INPUT1`` on ``[batch, width]``
    tensors of ``data_type``, computed in INT32 (strings cast to numbers and back), the shape
    of Triton's quick-start ``simple``, ``simple_int8`` and ``simple_string``."""
    element = ELEMENT_TYPES[data_type]
    nodes = [
        helper.make_node("Cast", [f"INPUT{i}"], [f"n{i}"], to=TensorProto.INT32) for i in (0, 1)
    ]
    nodes += [
        helper.make_node("Add", ["n0", "n1"], ["sum"]),
        helper.make_node("Sub", ["n0", "n1"], ["difference"]),
        helper.make_node("Cast", ["sum"], ["OUTPUT0"], to=element),
        helper.make_node("Cast", ["difference"], ["OUTPUT1"], to=element),
    ]
    dims = ["batch", width]
    inputs = [helper.make_tensor_value_info(f"INPUT{i}", element, dims) for i in (0, 1)]
    outputs = [helper.make_tensor_value_info(f"OUTPUT{i}", element, dims) for i in (0, 1)]
    return _model(helper.make_graph(nodes, "add_sub", inputs, outputs))


def sequence_controls(*, corrid: bool) -> bytes:
    """``OUTPUT = READY * (INPUT + START)``, plus ``END * CORRID`` when ``corrid``: INT32
    ``[batch, 1]`` tensors (CORRID UINT64), the shape of Triton's quick-start
    ``simple_sequence`` and ``simple_dyna_sequence``: the controls show in the answer."""
    names = ["INPUT", "START", "READY"] + (["END"] if corrid else [])
    inputs = [helper.make_tensor_value_info(n, TensorProto.INT32, ["batch", 1]) for n in names]
    nodes = [helper.make_node("Add", ["INPUT", "START"], ["started"])]
    total = "started"
    if corrid:
        inputs.append(helper.make_tensor_value_info("CORRID", TensorProto.UINT64, ["batch", 1]))
        nodes += [
            helper.make_node("Cast", ["CORRID"], ["id32"], to=TensorProto.INT32),
            helper.make_node("Mul", ["END", "id32"], ["ended"]),
            helper.make_node("Add", ["started", "ended"], ["total"]),
        ]
        total = "total"
    nodes.append(helper.make_node("Mul", ["READY", total], ["OUTPUT"]))
    output = helper.make_tensor_value_info("OUTPUT", TensorProto.INT32, ["batch", 1])
    return _model(helper.make_graph(nodes, "sequence", inputs, [output]))


def accumulator() -> bytes:
    """A running sum in implicit state: ``OUTPUT_STATE = INPUT + INPUT_STATE`` (the state
    fed back by the sequence batcher), ``OUTPUT = OUTPUT_STATE``, and ``READY`` passed
    through as ``ROW_READY``: INT32 ``[batch, 1]``."""
    names = ("INPUT", "INPUT_STATE", "READY")
    inputs = [helper.make_tensor_value_info(n, TensorProto.INT32, ["batch", 1]) for n in names]
    nodes = [
        helper.make_node("Add", ["INPUT", "INPUT_STATE"], ["OUTPUT_STATE"]),
        helper.make_node("Identity", ["OUTPUT_STATE"], ["OUTPUT"]),
        helper.make_node("Identity", ["READY"], ["ROW_READY"]),
    ]
    outputs = [
        helper.make_tensor_value_info(n, TensorProto.INT32, ["batch", 1])
        for n in ("OUTPUT", "OUTPUT_STATE", "ROW_READY")
    ]
    return _model(helper.make_graph(nodes, "accumulator", inputs, outputs))


def slot_probe() -> bytes:
    """What a sequence batcher hands a model, row by row: ``ROW`` (the row's place in the
    batch, from 1), ``SEEN_READY``, ``SEEN_START``, ``SEEN_END`` and ``SEEN_CORRID`` (its
    controls) and ``OUTPUT = INPUT``: INT32 ``[batch, 1]`` (CORRID INT64)."""
    flags = ("READY", "START", "END")
    inputs = [
        helper.make_tensor_value_info(n, TensorProto.INT32, ["batch", 1]) for n in ("INPUT", *flags)
    ]
    inputs.append(helper.make_tensor_value_info("CORRID", TensorProto.INT64, ["batch", 1]))
    zero = numpy_helper.from_array(np.array(0, np.int32), "zero")
    one = numpy_helper.from_array(np.array(1, np.int32), "one")
    axis = numpy_helper.from_array(np.array(0, np.int64), "axis")
    nodes = [
        helper.make_node("Mul", ["READY", "zero"], ["zeros"]),
        helper.make_node("Add", ["zeros", "one"], ["ones"]),
        helper.make_node("CumSum", ["ones", "axis"], ["ROW"]),
        helper.make_node("Identity", ["INPUT"], ["OUTPUT"]),
        helper.make_node("Identity", ["CORRID"], ["SEEN_CORRID"]),
    ]
    nodes += [helper.make_node("Identity", [f], [f"SEEN_{f}"]) for f in flags]
    outputs = [
        helper.make_tensor_value_info(n, TensorProto.INT32, ["batch", 1])
        for n in ("OUTPUT", "ROW", *(f"SEEN_{f}" for f in flags))
    ]
    outputs.append(helper.make_tensor_value_info("SEEN_CORRID", TensorProto.INT64, ["batch", 1]))
    graph = helper.make_graph(nodes, "slot_probe", inputs, outputs, [zero, one, axis])
    return _model(graph)


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
