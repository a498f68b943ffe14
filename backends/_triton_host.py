"""What the parts of a python-backend model's execution (a decoupled request's stream, the
gathered batches of a decoupled model, a rescheduled request's iterations) use of the
model's backend: a protocol, so that they depend on it and not the other way round
(``TritonPythonBackend`` in ``_triton_python.py`` is the one that meets it)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from ..protocols import InferenceError, InferRequest, Model, ModelConfig
from ._base import Capabilities, LoadedInstance
from ._triton_answers import Answer, Declared
from ._triton_requests import InferenceRequest, InferenceResponseSender


class GathersBatches(Protocol):
    """The open batches of a decoupled model with dynamic batching."""

    async def execute(
        self, instance: LoadedInstance, received: InferenceRequest, parent: InferRequest
    ) -> InferenceError | None:
        """Run ``received`` in one call of ``execute`` with the requests gathered with it;
        the error that answers it when the call failed."""


class TritonHost(Protocol):
    """A python-backend model's backend, as its execution's parts see it."""

    @property
    def model(self) -> Model:
        """The model's definition."""

    @property
    def config(self) -> ModelConfig:
        """The model's config."""

    @property
    def capabilities(self) -> Capabilities:
        """What the backend can do (``is_async``: an ``async def execute``)."""

    @property
    def declared(self) -> Declared:
        """What the config declares of the outputs."""

    @property
    def batches(self) -> GathersBatches | None:
        """The gathered batches of a decoupled model with dynamic batching, or None."""

    def call(
        self, instance: LoadedInstance, requests: list[InferenceRequest], parent: InferRequest
    ) -> Any:
        """One call of a synchronous ``execute``, in this thread."""

    async def call_async(
        self, instance: LoadedInstance, requests: list[InferenceRequest], parent: InferRequest
    ) -> Any:
        """One call of an ``async def execute`` on the model's asyncio loop."""

    def spawn(self, fn: Callable[[], Any]) -> None:
        """Start ``fn`` in the backend's nursery."""

    def failed(self, instance: LoadedInstance, exc: Exception) -> InferenceError:
        """``execute`` raised: the error of each of its requests (logged)."""

    def received(self, request: InferRequest, sender: InferenceResponseSender) -> InferenceRequest:
        """``request`` as the model's code receives it."""

    def returned(
        self, result: Any, answers: Sequence[Answer]
    ) -> list[Mapping[str, Any] | Exception | Answer]:
        """Per request: its outputs or error, or its `Answer` where ``execute``'s list
        holds None."""
