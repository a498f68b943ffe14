"""One round of box refinement: each side of each box moves inwards by up to 2 pixels while
the row or column it leaves is dark (below half the threshold). CHANGED says whether any box
moved; NEXT_ROUND counts the rounds."""

import numpy as np

JIT = False
STEP = 2


def _tighten(box: np.ndarray, image: np.ndarray, dark: float) -> np.ndarray:
    x0, y0, x1, y1 = (int(v) for v in box)
    for _ in range(STEP):
        if x1 - x0 > 2 and image[y0:y1, x0].max() < dark:
            x0 += 1
        if x1 - x0 > 2 and image[y0:y1, x1 - 1].max() < dark:
            x1 -= 1
        if y1 - y0 > 2 and image[y0, x0:x1].max() < dark:
            y0 += 1
        if y1 - y0 > 2 and image[y1 - 1, x0:x1].max() < dark:
            y1 -= 1
    return np.array([x0, y0, x1, y1], np.float32)


def execute(
    BOXES: np.ndarray, IMAGE: np.ndarray, THRESHOLD: np.ndarray, ROUND: np.ndarray
) -> dict[str, np.ndarray]:
    dark = float(THRESHOLD[0]) / 2
    refined = np.array([_tighten(b, IMAGE, dark) for b in BOXES], np.float32).reshape(-1, 4)
    return {
        "REFINED": refined,
        "CHANGED": np.array([bool((refined != BOXES).any())]),
        "NEXT_ROUND": (ROUND + 1).astype(np.int32),
    }
