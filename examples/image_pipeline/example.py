"""Driver of the image pipeline example, read by ``orchestrion run examples/image_pipeline``.

The model repository next to this file (``models/``) is the ensemble from Triton's
documentation (user_guide/ensemble_models.md): encoded image bytes are preprocessed once, and
the result feeds a classification model and a segmentation model that run concurrently. The
sample images are drawn in-process with Pillow (nothing is downloaded).
"""

import io
import threading

import numpy as np
from PIL import Image, ImageDraw

DESCRIPTION = (
    "Triton's ensemble doc example: PNG bytes -> preprocess -> classification + segmentation"
)
MODEL = "ensemble_model"
REQUESTS = 200
CONCURRENCY = 8

POOL_SIZE = 16
_POOL_SEED = 20240601
_pool: list[bytes] | None = None
_pool_lock = threading.Lock()


def _colour(rng: np.random.Generator) -> tuple[int, int, int]:
    r, g, b = (int(v) for v in rng.integers(0, 256, size=3))
    return (r, g, b)


def _draw_image(rng: np.random.Generator) -> bytes:
    """A PNG of a random size (160-320 px a side): a colour gradient and a few shapes."""
    width, height = (int(v) for v in rng.integers(160, 321, size=2))
    start = np.array(_colour(rng), dtype=np.float32)
    end = np.array(_colour(rng), dtype=np.float32)
    ramp = np.linspace(0.0, 1.0, width, dtype=np.float32)[None, :, None]
    ramp = np.broadcast_to(ramp, (height, width, 1))
    gradient = (start + (end - start) * ramp).astype(np.uint8)
    image = Image.fromarray(gradient, mode="RGB")
    draw = ImageDraw.Draw(image)
    for _ in range(int(rng.integers(3, 8))):
        x0, x1 = sorted(int(v) for v in rng.integers(0, width, size=2))
        y0, y1 = sorted(int(v) for v in rng.integers(0, height, size=2))
        box = (x0, y0, x1 + 1, y1 + 1)
        shape = int(rng.integers(3))
        if shape == 0:
            draw.rectangle(box, fill=_colour(rng))
        elif shape == 1:
            draw.ellipse(box, fill=_colour(rng))
        else:
            draw.line(box, fill=_colour(rng), width=int(rng.integers(1, 6)))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _images() -> list[bytes]:
    """The pool of sample images, drawn once (from a fixed seed) on first use."""
    global _pool
    with _pool_lock:
        if _pool is None:
            rng = np.random.default_rng(_POOL_SEED)
            _pool = [_draw_image(rng) for _ in range(POOL_SIZE)]
        return _pool


def make_inputs(index: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Inputs of request ``index``: one PNG from the pool, as a [1, 1] BYTES tensor."""
    pool = _images()
    image = pool[int(rng.integers(len(pool)))]
    tensor = np.empty((1, 1), dtype=object)
    tensor[0, 0] = image
    return {"IMAGE": tensor}


def check(inputs: dict[str, np.ndarray], outputs: dict[str, np.ndarray]) -> None:
    """Raise AssertionError unless ``outputs`` look like a valid answer to ``inputs``."""
    assert "CLASSIFICATION" in outputs, f"missing CLASSIFICATION, got {sorted(outputs)}"
    assert "SEGMENTATION" in outputs, f"missing SEGMENTATION, got {sorted(outputs)}"
    batch = len(inputs["IMAGE"])

    probs = np.asarray(outputs["CLASSIFICATION"])
    assert probs.shape == (batch, 1000), f"CLASSIFICATION shape {probs.shape}"
    assert probs.dtype == np.float32, f"CLASSIFICATION dtype {probs.dtype}"
    assert np.all(np.isfinite(probs)), "CLASSIFICATION is not finite"
    assert np.all(probs >= 0.0), "CLASSIFICATION has negative probabilities"
    sums = probs.sum(axis=-1, dtype=np.float64)
    assert np.allclose(sums, 1.0, atol=1e-3), f"CLASSIFICATION sums to {sums}, not 1"

    seg = np.asarray(outputs["SEGMENTATION"])
    assert seg.shape == (batch, 3, 224, 224), f"SEGMENTATION shape {seg.shape}"
    assert seg.dtype == np.float32, f"SEGMENTATION dtype {seg.dtype}"
    assert np.all(np.isfinite(seg)), "SEGMENTATION is not finite"
    assert seg.min() >= 0.0, f"SEGMENTATION below 0: {seg.min()}"
    assert seg.max() <= 1.0, f"SEGMENTATION above 1: {seg.max()}"
