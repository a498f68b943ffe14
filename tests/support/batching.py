"""Small models for the dynamic batching tests: rows of 4 FP32 values, plain Python."""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np

import orchestrion
from orchestrion.protocols import DynamicBatching
from orchestrion.testing import model, tensor

ROW = (4,)


def batching(definition: orchestrion.Model, **settings: Any) -> orchestrion.Model:
    """``definition`` with ``dynamic_batching`` set to ``settings``."""
    config = attrs.evolve(definition.config, dynamic_batching=DynamicBatching(**settings))
    return attrs.evolve(definition, config=config)


def plain(name: str, execute: Any, max_batch_size: int = 8, count: int = 1) -> orchestrion.Model:
    """A non-jitted model X -> Y of rows of ``ROW``."""
    return model(
        name,
        execute,
        [tensor("X", dims=ROW)],
        [tensor("Y", dims=ROW)],
        jit=False,
        max_batch_size=max_batch_size,
        count=count,
    )


def row(value: float, rows: int = 1) -> np.ndarray:
    """``rows`` rows filled with ``value``."""
    return np.full((rows, *ROW), value, np.float32)
