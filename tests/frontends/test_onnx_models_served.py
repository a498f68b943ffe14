"""ONNX models under ``orchestrion serve`` with tritonclient: a repository shaped like Triton's
quick-start (``densenet_onnx``: an image classifier with a labels file, with its config and
without one) answers classification requests the way Triton's image client makes them, and
the ONNX pipeline example answers over HTTP and gRPC with its cache."""

from __future__ import annotations

import io
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from PIL import Image

from orchestrion.testing import Served, get
from support import onnx_graphs
from support.served import start_server

EXAMPLE_MODELS = onnx_graphs.EXAMPLE / "models"

DENSENET_CONFIG = """
name: "densenet_onnx"
platform: "onnxruntime_onnx"
max_batch_size: 0
input [
  {
    name: "data_0"
    data_type: TYPE_FP32
    format: FORMAT_NCHW
    dims: [ 3, 224, 224 ]
    reshape { shape: [ 1, 3, 224, 224 ] }
  }
]
output [
  {
    name: "fc6_1"
    data_type: TYPE_FP32
    dims: [ 1000 ]
    reshape { shape: [ 1, 1000, 1, 1 ] }
    label_filename: "densenet_labels.txt"
  }
]
"""
LABELS = [f"label-{i}" for i in range(1000)]


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The example's models, ``densenet_onnx`` with its config and labels, and
    ``densenet_auto``: the same graph with no config at all."""
    onnx_graphs.example_network()  # writes the example's graph
    root = tmp_path_factory.mktemp("onnx_repository")
    shutil.copytree(EXAMPLE_MODELS, root, dirs_exist_ok=True)
    graph = onnx_graphs.classifier()
    folder = onnx_graphs.model_folder(root, "densenet_onnx", graph, DENSENET_CONFIG)
    (folder / "densenet_labels.txt").write_text("".join(f"{label}\n" for label in LABELS))
    onnx_graphs.model_folder(root, "densenet_auto", graph)
    return root


@pytest.fixture(scope="module")
def server(repository: Path) -> Iterator[Served]:
    """``orchestrion serve`` on that repository, with a local cache."""
    served = start_server("--cache-config", "local,size=8388608", repository=repository)
    yield served
    assert served.stop() == 0, served.text()


def _image() -> Image.Image:
    """A 300x200 picture: a gradient with a rectangle."""
    pixels = np.zeros((200, 300, 3), np.uint8)
    pixels[..., 0] = np.linspace(0, 255, 300, dtype=np.uint8)[None, :]
    pixels[40:120, 60:200, 1] = 220
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG")
    return Image.open(io.BytesIO(buffer.getvalue()))


def _inception(image: Image.Image, height: int, width: int) -> np.ndarray[Any, Any]:
    """An image client's ``-s INCEPTION`` preprocessing: RGB, resized, to [-1, 1], CHW."""
    resized = np.asarray(image.convert("RGB").resize((width, height), Image.Resampling.BILINEAR))
    scaled = resized.astype(np.float32) / 127.5 - 1
    return np.ascontiguousarray(scaled.transpose(2, 0, 1))


def _top3(pixels: np.ndarray[Any, Any]) -> list[int]:
    """The three best classes, computed by ONNX Runtime directly."""
    session = onnxruntime.InferenceSession(
        onnx_graphs.classifier(), providers=["CPUExecutionProvider"]
    )
    (scores,) = session.run(None, {"data_0": pixels[None]})
    return [int(i) for i in np.argsort(-scores.reshape(-1))[:3]]


def test_the_quick_start_classifier_answers_an_image_client(server: Served) -> None:
    """As Triton's image client does over gRPC (``-m densenet_onnx -c 3 -s INCEPTION``):
    the metadata and config describe an NCHW image input without batching, and the top
    three classes come back as ``score:index:label``, the labels from the labels file."""
    client = grpcclient.InferenceServerClient(server.grpc)
    metadata = client.get_model_metadata("densenet_onnx")
    config = client.get_model_config("densenet_onnx").config
    assert metadata.platform == "onnxruntime_onnx"
    assert [(t.name, t.datatype, list(t.shape)) for t in metadata.inputs] == [
        ("data_0", "FP32", [3, 224, 224])
    ]
    assert config.max_batch_size == 0
    assert config.input[0].format == grpcclient.model_config_pb2.ModelInput.FORMAT_NCHW
    pixels = _inception(_image(), 224, 224)
    request = grpcclient.InferInput("data_0", [3, 224, 224], "FP32")
    request.set_data_from_numpy(pixels)
    wanted = grpcclient.InferRequestedOutput("fc6_1", class_count=3)
    result = client.infer("densenet_onnx", [request], outputs=[wanted])
    entries = [v.decode().split(":") for v in result.as_numpy("fc6_1")]
    assert [int(index) for _, index, _ in entries] == _top3(pixels)
    assert [label for _, index, label in entries] == [LABELS[int(i)] for _, i, _ in entries]
    scores = [float(score) for score, _, _ in entries]
    assert scores == sorted(scores, reverse=True)
    client.close()


def test_a_quick_start_folder_without_a_config_serves_its_graph(server: Served) -> None:
    """``densenet_auto`` is only ``1/model.onnx``: its config comes from the graph (a fixed
    batch of 1, so no batching), and it classifies over HTTP."""
    status, body = get(server.http, "/v2/models/densenet_auto/config")
    assert status == 200
    config = json.loads(body)
    assert config["platform"] == "onnxruntime_onnx"
    assert config.get("max_batch_size", 0) == 0
    assert [(t["name"], t["data_type"], t["dims"]) for t in config["input"]] == [
        ("data_0", "TYPE_FP32", [1, 3, 224, 224])
    ]
    client = httpclient.InferenceServerClient(server.http)
    pixels = _inception(_image(), 224, 224)[None]
    request = httpclient.InferInput("data_0", [1, 3, 224, 224], "FP32")
    request.set_data_from_numpy(pixels)
    wanted = httpclient.InferRequestedOutput("fc6_1", class_count=3)
    result = client.infer("densenet_auto", [request], outputs=[wanted])
    indexes = [int(v.decode().split(":")[1]) for v in result.as_numpy("fc6_1").reshape(-1)]
    assert indexes == _top3(pixels[0])
    client.close()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_the_mixed_pipeline_answers_over_the_network(server: Served, protocol: str) -> None:
    """JAX -> ONNX Runtime -> JAX through tritonclient: probabilities and their top class
    for a batch; the repeated request is answered by the cache."""
    module: Any = grpcclient if protocol == "grpc" else httpclient
    client = module.InferenceServerClient(server.grpc if protocol == "grpc" else server.http)
    seed = 10 if protocol == "grpc" else 11
    batch = np.random.default_rng(seed).integers(0, 256, (2, 64, 64, 3), dtype=np.uint8)
    request = module.InferInput("IMAGE", [2, 64, 64, 3], "UINT8")
    request.set_data_from_numpy(batch)
    first = client.infer("pipeline", [request])
    second = client.infer("pipeline", [request])
    probabilities = first.as_numpy("PROBABILITIES")
    assert probabilities.shape == (2, 10)
    np.testing.assert_allclose(probabilities.sum(axis=-1), 1.0, rtol=1e-5)
    assert first.as_numpy("LABEL")[:, 0].tolist() == probabilities.argmax(axis=-1).tolist()
    np.testing.assert_array_equal(second.as_numpy("PROBABILITIES"), probabilities)
    stats = client.get_inference_statistics("pipeline")
    if protocol == "grpc":
        hits = stats.model_stats[0].inference_stats.cache_hit.count
    else:
        hits = stats["model_stats"][0]["inference_stats"]["cache_hit"]["count"]
    assert int(hits) >= 1
    client.close()
