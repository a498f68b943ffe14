"""The classifier of the ONNX pipeline example, written twice from the same weights: as a JAX
function and as an ONNX graph built with the ``onnx`` package (nothing is downloaded).

A small convolutional network on 64x64 RGB images (NCHW, already normalised): three 3x3
convolutions of stride 2 with ReLU (32, 64 and 64 channels), global average pooling and a
dense layer to 10 classes. Its weights are random, drawn from a fixed seed: the example is
about serving, not accuracy. ``python examples/onnx_pipeline/network.py`` writes the graph
into the example's repository (``orchestrion run`` does it on its own first).
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np

SIZE = 64
CLASSES = 10
CHANNELS = (3, 32, 64, 64)
SEED = 20260601
GRAPH = Path(__file__).resolve().parent / "models" / "classifier" / "1" / "model.onnx"
"""Where the example's repository expects the graph."""
OPSET = 17


def weights() -> dict[str, np.ndarray]:
    """The network's weights (He-initialised from `SEED`): ``conv{i}_w``, ``conv{i}_b``,
    ``dense_w`` [64, CLASSES], ``dense_b``."""
    rng = np.random.default_rng(SEED)
    params: dict[str, np.ndarray] = {}
    for i, (cin, cout) in enumerate(itertools.pairwise(CHANNELS)):
        scale = np.sqrt(2.0 / (cin * 9))
        params[f"conv{i}_w"] = (rng.standard_normal((cout, cin, 3, 3)) * scale).astype(np.float32)
        params[f"conv{i}_b"] = (rng.standard_normal(cout) * 0.01).astype(np.float32)
    features = CHANNELS[-1]
    dense = rng.standard_normal((features, CLASSES)) * np.sqrt(1.0 / features)
    params["dense_w"] = dense.astype(np.float32)
    params["dense_b"] = np.zeros(CLASSES, np.float32)
    return params


def jax_forward(params: dict[str, Any], pixels: Any) -> Any:
    """The network in JAX: ``pixels`` FP32 [batch, 3, SIZE, SIZE] -> logits [batch, CLASSES]."""
    import jax
    import jax.numpy as jnp

    x = pixels
    for i in range(len(CHANNELS) - 1):
        x = jax.lax.conv_general_dilated(
            x,
            params[f"conv{i}_w"],
            window_strides=(2, 2),
            padding=((1, 1), (1, 1)),
            dimension_numbers=("NCHW", "OIHW", "NCHW"),
        )
        x = jax.nn.relu(x + params[f"conv{i}_b"][None, :, None, None])
    pooled = jnp.mean(x, axis=(2, 3))
    return pooled @ params["dense_w"] + params["dense_b"]


def onnx_graph() -> bytes:
    """The same network as an ONNX graph: input ``pixels`` FP32 [batch, 3, SIZE, SIZE],
    output ``logits`` FP32 [batch, CLASSES]; the batch dimension is symbolic, so Triton's
    auto-complete finds that the model can batch."""
    from onnx import TensorProto, helper, numpy_helper

    params = weights()
    nodes = []
    previous = "pixels"
    for i in range(len(CHANNELS) - 1):
        conv = helper.make_node(
            "Conv",
            [previous, f"conv{i}_w", f"conv{i}_b"],
            [f"conv{i}"],
            strides=[2, 2],
            pads=[1, 1, 1, 1],
            kernel_shape=[3, 3],
        )
        nodes += [conv, helper.make_node("Relu", [f"conv{i}"], [f"relu{i}"])]
        previous = f"relu{i}"
    nodes += [
        helper.make_node("GlobalAveragePool", [previous], ["pooled"]),
        helper.make_node("Flatten", ["pooled"], ["features"], axis=1),
        helper.make_node("Gemm", ["features", "dense_w", "dense_b"], ["logits"]),
    ]
    graph = helper.make_graph(
        nodes,
        "onnx_pipeline_classifier",
        [helper.make_tensor_value_info("pixels", TensorProto.FLOAT, ["batch", 3, SIZE, SIZE])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", CLASSES])],
        [numpy_helper.from_array(value, name) for name, value in params.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 8
    return bytes(model.SerializeToString())


def ensure_graph(path: Path = GRAPH) -> Path:
    """Write the graph to ``path`` unless it holds exactly these bytes already (a changed
    network is rewritten; an unchanged file is left as it is, so its revision stays)."""
    data = onnx_graph()
    if not path.is_file() or path.read_bytes() != data:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(".tmp")
        temporary.write_bytes(data)
        temporary.replace(path)
    return path


if __name__ == "__main__":
    print(f"wrote {ensure_graph()}")
