"""`Inside`: what a test or a benchmark may look at inside a running server (each model's
runner, its instances and their inline/thread mode, an ensemble's steps and fused call).

The one place that reads the server's runtime: tests and ``bench/`` ask an `Inside` instead
of a server's private attributes, so that the runtime can change behind it
(``tests/test_architecture.py`` checks that nothing else reaches in).
"""

from __future__ import annotations

from collections.abc import Iterator

import attrs

from orchestrion import AsyncServer
from orchestrion.actors import (
    EnsembleRunner,
    Fusion,
    Instance,
    ListedFusion,
    ModelRegistry,
    ModelRunner,
    Step,
)


@attrs.frozen
class Inside:
    """A running server's runtime, as tests see it (``inside(server)``)."""

    server: AsyncServer

    @property
    def registry(self) -> ModelRegistry:
        """The server's registry of loaded models (its lookups, the router's calls)."""
        return self.server._registry

    def runner(self, name: str, version: int = -1) -> ModelRunner:
        """The runner of model ``name`` (not an ensemble) at ``version`` (-1: the latest).

        Raises:
            ModelNotFoundError: no such model or version is loaded.
            TypeError: ``name`` is an ensemble (see `ensemble`).
        """
        runner = self.registry.resolve(name, version)
        if not isinstance(runner, ModelRunner):
            raise TypeError(f"'{name}' is an ensemble: use Inside.ensemble")
        return runner

    def ensemble(self, name: str, version: int = -1) -> EnsembleRunner:
        """The runner of ensemble ``name`` at ``version`` (-1: the latest).

        Raises:
            ModelNotFoundError: no such model or version is loaded.
            TypeError: ``name`` is a model, not an ensemble.
        """
        runner = self.registry.resolve(name, version)
        if not isinstance(runner, EnsembleRunner):
            raise TypeError(f"'{name}' is not an ensemble: use Inside.runner")
        return runner

    def instances(self, name: str, version: int = -1) -> list[Instance]:
        """Model ``name``'s instances (each one's device, inline or thread mode, busy)."""
        return self.runner(name, version).instances

    def steps(self, name: str) -> list[Step]:
        """Ensemble ``name``'s step actors (each one's plan, capacity and free slots)."""
        return self.ensemble(name)._steps

    def fusion(self, name: str) -> Fusion | ListedFusion | None:
        """Ensemble ``name``'s fused call as it stands (None: none, or not yet built)."""
        return self.ensemble(name)._fusion

    def loaded(self) -> Iterator[tuple[str, int, ModelRunner | EnsembleRunner]]:
        """Every loaded version: its name, version and runner."""
        server = self.server
        for name in server.model_names():
            for version in server.model_versions(name):
                runner = self.registry.resolve(name, version)
                assert isinstance(runner, ModelRunner | EnsembleRunner)
                yield name, version, runner


def inside(server: AsyncServer) -> Inside:
    """The runtime of ``server`` as tests and benchmarks may look at it (see `Inside`)."""
    return Inside(server)
