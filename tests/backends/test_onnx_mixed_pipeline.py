"""The ONNX pipeline example through the embedding API: JAX preprocessing, the ONNX
classifier and JAX postprocessing as one ensemble, with the response cache and
``max_inflight_requests``; the ONNX graph and the JAX network agree."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import jax
import numpy as np
import pytest
import trio

import orchestrion
from support import onnx_graphs

EXAMPLE = onnx_graphs.EXAMPLE
MEAN = np.array([0.485, 0.456, 0.406], np.float32)
STD = np.array([0.229, 0.224, 0.225], np.float32)


@pytest.fixture(scope="module")
def network() -> ModuleType:
    """The example's network module (its graph written)."""
    return onnx_graphs.example_network()


def expected(network: ModuleType, images: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """What the pipeline should answer: the JAX network on the normalised images, softmaxed."""
    pixels = ((images.astype(np.float32) / 255.0 - MEAN) / STD).transpose(0, 3, 1, 2)
    logits = jax.jit(network.jax_forward)(network.weights(), pixels)
    return np.asarray(jax.nn.softmax(logits, axis=-1))


def images(count: int, seed: int = 0) -> np.ndarray[Any, Any]:
    """``count`` random 64x64 RGB images."""
    return np.random.default_rng(seed).integers(0, 256, (count, 64, 64, 3), dtype=np.uint8)


def test_the_onnx_graph_computes_what_the_jax_network_does(network: ModuleType) -> None:
    """Built from the same weights, the two forms of the network agree to float precision."""
    import onnxruntime

    session = onnxruntime.InferenceSession(network.onnx_graph(), providers=["CPUExecutionProvider"])
    pixels = np.random.default_rng(1).standard_normal((5, 3, 64, 64)).astype(np.float32)
    (onnx_logits,) = session.run(None, {"pixels": pixels})
    jax_logits = np.asarray(jax.jit(network.jax_forward)(network.weights(), pixels))
    np.testing.assert_allclose(onnx_logits, jax_logits, rtol=1e-4, atol=1e-5)


async def test_the_mixed_pipeline_answers_through_the_embedding_api(network: ModuleType) -> None:
    """A batch of images through JAX -> ONNX Runtime -> JAX: the probabilities the JAX
    network gives, the top class; the same request again is a cache hit."""
    batch = images(3)
    async with orchestrion.open_server(
        model_repository=EXAMPLE / "models", cache_config="local,size=1048576"
    ) as server:
        first = await server.infer("pipeline", {"IMAGE": batch})
        again = await server.infer("pipeline", {"IMAGE": batch})
        cache = server.cache_statistics()
        classifier = server.model_config("classifier")
    probabilities = first.outputs["PROBABILITIES"]
    np.testing.assert_allclose(probabilities, expected(network, batch), rtol=1e-4, atol=1e-6)
    assert first.outputs["LABEL"][:, 0].tolist() == probabilities.argmax(axis=-1).tolist()
    np.testing.assert_array_equal(again.outputs["PROBABILITIES"], probabilities)
    assert cache is not None
    assert (cache.hits, cache.misses) == (1, 1)
    assert [(t.name, t.dims) for t in classifier.input] == [("pixels", (3, 64, 64))]


async def test_concurrent_requests_stay_within_max_inflight_requests(network: ModuleType) -> None:
    """Forty distinct requests at once: every one answered correctly, and no step ever has
    more than its 16 requests in flight."""
    batch = images(40, seed=2)
    answers: dict[int, np.ndarray[Any, Any]] = {}
    peak = 0
    async with orchestrion.open_server(model_repository=EXAMPLE / "models") as server:
        limits = {s.model_name: s.max_inflight_requests for s in server.step_statistics("pipeline")}

        async def one(index: int) -> None:
            response = await server.infer("pipeline", {"IMAGE": batch[index : index + 1]})
            answers[index] = response.outputs["PROBABILITIES"][0]

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                for index in range(len(batch)):
                    nursery.start_soon(one, index)
                while len(answers) < len(batch):
                    peak = max([peak, *(s.in_flight for s in server.step_statistics("pipeline"))])
                    await trio.sleep(0.001)
    assert limits == {"preprocess": 16, "classifier": 16, "postprocess": 16}
    assert 1 <= peak <= 16
    got = np.stack([answers[i] for i in range(len(batch))])
    np.testing.assert_allclose(got, expected(network, batch), rtol=1e-4, atol=1e-6)
