"""The decoupled tests' generator models (X and Y: FP32 of one element) and their values."""

from __future__ import annotations

from typing import Any

import numpy as np
import trio


def single(v: float) -> np.ndarray:
    """``[v]``, FP32: one X (or Y) of the decoupled tests' models."""
    return np.array([v], np.float32)


def repeat(X: Any) -> Any:
    """Yield X * i for i in range(X): value v gives v responses."""
    for i in range(int(X[0])):
        yield {"Y": X * i}


async def arepeat(X: Any) -> Any:
    """`repeat` as an async generator, with a checkpoint before each response."""
    for i in range(int(X[0])):
        await trio.lowlevel.checkpoint()
        yield {"Y": X * i}
