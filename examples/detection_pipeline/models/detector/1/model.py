"""The detector: smooth the image (KERNEL), then every 16x16 cell whose brightest pixel passes
THRESHOLD is a detection: its box (x0, y0, x1, y1, in pixels) and its crop. UNSURE says
whether some cell was close to the threshold (the pipeline then asks for a second opinion)."""

import numpy as np

JIT = False  # the number of detections varies: plain numpy
CELL = 16
MARGIN = 0.15


def _smooth(image: np.ndarray, kernel: np.ndarray) -> np.ndarray:
    padded = np.pad(image, 1, mode="edge")
    out = np.zeros_like(image)
    for dy in range(3):
        for dx in range(3):
            out += kernel[dy, dx] * padded[dy : dy + image.shape[0], dx : dx + image.shape[1]]
    return out


def execute(IMAGE: np.ndarray, THRESHOLD: np.ndarray, KERNEL: np.ndarray) -> dict[str, np.ndarray]:
    smooth = _smooth(np.asarray(IMAGE, np.float32), np.asarray(KERNEL, np.float32))
    threshold = float(THRESHOLD[0])
    boxes, crops, unsure = [], [], False
    for row in range(0, smooth.shape[0], CELL):
        for col in range(0, smooth.shape[1], CELL):
            peak = float(smooth[row : row + CELL, col : col + CELL].max())
            unsure |= abs(peak - threshold) < MARGIN
            if peak > threshold:
                boxes.append([col, row, col + CELL, row + CELL])
                crops.append(IMAGE[row : row + CELL, col : col + CELL])
    return {
        "BOXES": np.array(boxes, np.float32).reshape(-1, 4),
        "CROPS": np.array(crops, np.float32).reshape(-1, CELL, CELL),
        "UNSURE": np.array([unsure]),
    }
