"""Driver of the detection pipeline example (``orchestrion run examples/detection_pipeline``).

The model repository next to this file (``models/``) is an ensemble with control flow: a
detector, a classifier mapped over each detection, a second opinion asked only when the
detector is unsure, and a box refinement repeated at most 3 times, with constants from its
config. The images are drawn in-process (bright squares on a dark 64x64 field; nothing is
downloaded).
"""

import numpy as np

DESCRIPTION = (
    "detector -> classifier mapped over each detection, second opinion when unsure, "
    "refinement loop (at most 3 rounds)"
)
MODEL = "detection_pipeline"
REQUESTS = 200
CONCURRENCY = 8

SIZE = 64
CELL = 16


def make_inputs(index: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Inputs of request ``index``: a 64x64 image with 0-8 squares of random size and
    brightness (some near the detector's threshold), one per 16x16 cell at most."""
    image = rng.normal(0.05, 0.02, size=(SIZE, SIZE)).astype(np.float32)
    cells = rng.permutation(16)[: int(rng.integers(0, 9))]
    for cell in cells:
        row, col = divmod(int(cell), 4)
        side = int(rng.integers(5, 13))
        top = row * CELL + int(rng.integers(0, CELL - side + 1))
        left = col * CELL + int(rng.integers(0, CELL - side + 1))
        image[top : top + side, left : left + side] = rng.uniform(0.35, 1.0)
    return {"IMAGE": np.clip(image, 0.0, 1.0)}


def check(inputs: dict[str, np.ndarray], outputs: dict[str, np.ndarray]) -> None:
    """Raise AssertionError unless ``outputs`` look like a valid answer to ``inputs``."""
    boxes, probabilities = outputs["BOXES"], outputs["CLASS_PROBABILITIES"]
    assert boxes.shape[1:] == (4,), boxes.shape
    assert probabilities.shape == (len(boxes), 4), (boxes.shape, probabilities.shape)
    assert np.allclose(probabilities.sum(axis=1), 1.0, atol=1e-4)
    assert ((boxes >= 0) & (boxes <= SIZE)).all()
    assert (boxes[:, 2] > boxes[:, 0]).all(), boxes
    assert (boxes[:, 3] > boxes[:, 1]).all(), boxes
    rounds = int(outputs["ROUNDS"][0])
    assert 1 <= rounds <= 3, rounds
    opinion = outputs["SECOND_OPINION"]
    assert (opinion == -1).all() or np.isclose(opinion.sum(), 1.0, atol=1e-4), opinion
