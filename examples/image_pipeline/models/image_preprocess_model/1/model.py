"""Image preprocessing: encoded PNG/JPEG bytes -> normalised float32 CHW tensor.

Each image is decoded with Pillow, converted to RGB, resized to 224x224 (bilinear), scaled
to [0, 1] and normalised with the ImageNet mean and standard deviation, then transposed to
channels-first. Decoding bytes is work JAX cannot trace, so this model runs as plain Python
(``JIT = False``). It has no weights.
"""

import io

import numpy as np
from PIL import Image, UnidentifiedImageError

JIT = False

SIZE = 224
MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)


def _decode(index: int, data: object) -> np.ndarray:
    """One image as a float32 [3, SIZE, SIZE] array; ValueError if it cannot be decoded."""
    if isinstance(data, str):
        data = data.encode("latin-1")
    if not isinstance(data, bytes | bytearray | memoryview):
        raise ValueError(f"cannot decode image {index}: expected bytes, got {type(data).__name__}")
    try:
        with Image.open(io.BytesIO(bytes(data))) as image:
            rgb = image.convert("RGB").resize((SIZE, SIZE), Image.Resampling.BILINEAR)
    except UnidentifiedImageError as exc:
        raise ValueError(
            f"cannot decode image {index}: not an image format Pillow knows "
            f"({len(data)} bytes starting {bytes(data[:8])!r})"
        ) from exc
    except Exception as exc:  # truncated or corrupt data: OSError, SyntaxError, ...
        raise ValueError(f"cannot decode image {index}: {exc}") from exc
    pixels = np.asarray(rgb, dtype=np.float32) / 255.0
    pixels = (pixels - MEAN) / STD
    return np.ascontiguousarray(pixels.transpose(2, 0, 1))


def execute(RAW_IMAGE: np.ndarray) -> dict[str, np.ndarray]:
    """RAW_IMAGE: object array [B, 1] of encoded image bytes."""
    images = np.asarray(RAW_IMAGE, dtype=object).reshape(len(RAW_IMAGE), -1)
    batch = np.empty((len(images), 3, SIZE, SIZE), dtype=np.float32)
    for i, row in enumerate(images):
        batch[i] = _decode(i, row[0])
    return {"PREPROCESSED_OUTPUT": batch}
