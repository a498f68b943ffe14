"""The observer protocol: how the runtime tells telemetry what happens.

Actors call these hooks at each event; the base class does nothing, so an observer overrides
only what it cares about (the idea of ``trio.abc.Instrument``). Hooks run synchronously on the
hot path: keep them cheap, and never block in them.
"""

from __future__ import annotations

from ._messages import InferRequest


class Observer:
    """Receives runtime events. Subclass and override the hooks you need."""

    def request_started(self, model_name: str, version: int, request: InferRequest) -> None:
        """A request for a model (or ensemble) version was accepted."""

    def request_finished(
        self,
        model_name: str,
        version: int,
        request: InferRequest,
        error: BaseException | None,
        duration_ns: int,
    ) -> None:
        """A request ended: with ``error`` None on success."""

    def cache_looked_up(
        self,
        model_name: str,
        version: int,
        request: InferRequest,
        hit: bool,
        duration_ns: int,
    ) -> None:
        """The response cache answered a request for a model with caching enabled
        (``hit``: the model did not run; ``duration_ns``: the lookup's time)."""

    def execution_finished(
        self,
        model_name: str,
        version: int,
        batch_size: int,
        queue_ns: int,
        compute_ns: int,
    ) -> None:
        """A model instance ran ``execute`` once (successfully or not)."""

    def step_started(
        self, ensemble: str, step: int, model_name: str, request: InferRequest
    ) -> None:
        """An ensemble step sent ``request`` to its composing model."""

    def step_finished(
        self,
        ensemble: str,
        step: int,
        model_name: str,
        request: InferRequest,
        error: BaseException | None,
    ) -> None:
        """The composing model answered a step's request (``error`` None on success)."""
