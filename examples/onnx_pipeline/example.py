"""Driver of the ONNX pipeline example, read by ``orchestrion run examples/onnx_pipeline``.

The model repository next to this file (``models/``) is a mixed ensemble: JAX preprocessing,
an ONNX classifier run by ONNX Runtime and JAX postprocessing, with the response cache and
``max_inflight_requests``. The classifier's graph is built here, by ``network.py`` with the
``onnx`` package, before the server reads the repository (nothing is downloaded). The images
are random pixels from a fixed seed, a pool of 32, so repeated ones are cache hits.
"""

import importlib.util
import sys
from pathlib import Path

import numpy as np

DESCRIPTION = "JAX preprocess -> ONNX Runtime classifier -> JAX postprocess, cached"
MODEL = "pipeline"
REQUESTS = 200
CONCURRENCY = 8
POOL_SIZE = 32
_POOL_SEED = 20260602


def _network():
    """``network.py`` beside this file, imported by its path."""
    path = Path(__file__).resolve().parent / "network.py"
    spec = importlib.util.spec_from_file_location("_onnx_pipeline_network", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


network = _network()
network.ensure_graph()  # before `orchestrion run` reads models/
_pool = np.random.default_rng(_POOL_SEED).integers(
    0, 256, size=(POOL_SIZE, network.SIZE, network.SIZE, 3), dtype=np.uint8
)


def make_inputs(index: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Inputs of request ``index``: one image from the pool, as a batch of one."""
    return {"IMAGE": _pool[int(rng.integers(POOL_SIZE))][None]}


def check(inputs: dict[str, np.ndarray], outputs: dict[str, np.ndarray]) -> None:
    """Raise AssertionError unless ``outputs`` are probabilities and their top class."""
    batch = len(inputs["IMAGE"])
    probabilities = np.asarray(outputs["PROBABILITIES"])
    assert probabilities.shape == (batch, network.CLASSES), probabilities.shape
    assert np.allclose(probabilities.sum(axis=-1), 1.0, atol=1e-4), probabilities.sum(axis=-1)
    label = np.asarray(outputs["LABEL"])
    assert label.shape == (batch, 1), label.shape
    assert (label[:, 0] == probabilities.argmax(axis=-1)).all(), (label, probabilities)
