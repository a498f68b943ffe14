"""orchestrion's own model config parameters (``parameters { key: ... }`` in a
``config.pbtxt``, which Triton's parser accepts as they are): where a model's executions run
(``execution``) and how an ensemble's steps may be fused (``fusion``). Checked when a model
is loaded (`orchestrion.backends.check_model`)."""

from __future__ import annotations

import enum

from ._config import ModelConfig


class ExecutionMode(enum.StrEnum):
    """Where a model's executions run (its ``execution`` parameter)."""

    AUTO = "auto"
    """Measured per instance (``actors/_instances.py``)."""
    INLINE = "inline"
    """Always on the event loop."""
    THREAD = "thread"
    """Always in a worker thread."""


def execution_mode(config: ModelConfig) -> ExecutionMode:
    """The model's ``execution`` parameter (checked at load)."""
    return ExecutionMode(config.parameters.get("execution", ExecutionMode.AUTO))


class FusionMode(enum.StrEnum):
    """An ensemble's ``fusion`` parameter (``actors/_fusion.py``)."""

    ON = "on"
    """The steps' own executables, one after another (the default)."""
    XLA = "xla"
    """The steps traced into one ``jax.jit`` function."""
    OFF = "off"
    """The scheduler for every request."""


def fusion_mode(config: ModelConfig) -> FusionMode:
    """An ensemble's ``fusion`` parameter (checked at load)."""
    return FusionMode(config.parameters.get("fusion", FusionMode.ON))
