"""A decoupled python-backend model with ``dynamic_batching``: its requests gathered into one
``execute(requests)`` call, as Triton's dynamic batcher gives them (each request keeps its
own inputs and its own response sender; nothing is concatenated).

How this works. Each instance has at most one open batch. The first request to find none
opens one and leads it: it waits for the batch to fill (``preferred_batch_size``'s largest,
else ``max_batch_size``, counted in rows, the first dimension of a request's inputs) for at
most ``max_queue_delay_microseconds``, then for the instance (a synchronous ``execute``
runs one call at a time per instance; requests keep joining meanwhile, as they queue in
Triton while the instance is busy), closes the batch and runs the call. The requests that
joined wait for it. The leader's part is shielded from its own request's cancellation, so
the others are never left without their call; a request whose reader has gone is still in
the call, and what its sender sends is dropped.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs
import trio

from ..protocols import InferenceError, InferRequest
from ._base import LoadedInstance
from ._triton_api import TritonModelException
from ._triton_requests import InferenceRequest

if TYPE_CHECKING:
    from ._triton_host import TritonHost


@attrs.define(eq=False)
class _Batch:
    received: list[InferenceRequest]
    rows: int
    full: trio.Event = attrs.field(factory=trio.Event)
    done: trio.Event = attrs.field(factory=trio.Event)
    failure: str | None = None
    """The call's failure in Triton's words (each request gets its own error of it)."""


def _rows(received: InferenceRequest) -> int:
    inputs = received.inputs()
    shape = inputs[0].shape() if inputs else ()
    return int(shape[0]) if shape else 1


class DecoupledBatches:
    """The open batch of each instance of one decoupled model with dynamic batching."""

    def __init__(self, backend: TritonHost) -> None:
        config = backend.config
        assert config.dynamic_batching is not None
        self._backend = backend
        self._limit = config.max_batch_size
        preferred = config.dynamic_batching.preferred_batch_size
        self._target = min(max(preferred, default=self._limit), self._limit)
        self._delay = config.dynamic_batching.max_queue_delay_microseconds / 1e6
        self._open: dict[int, _Batch] = {}

    @classmethod
    def of(cls, backend: TritonHost) -> DecoupledBatches | None:
        """The batches of ``backend``'s model, or None where its requests run alone (not
        decoupled, no dynamic batching, no batch dimension, or a stateful model)."""
        config = backend.config
        gathers = config.decoupled and config.dynamic_batching is not None
        return cls(backend) if gathers and config.max_batch_size > 0 else None

    async def execute(
        self, instance: LoadedInstance, received: InferenceRequest, parent: InferRequest
    ) -> InferenceError | None:
        """Run ``received`` in a call of ``execute`` with the other requests gathered with
        it; the error that answers it when the call failed."""
        rows = _rows(received)
        batch = self._open.get(instance.index)
        if batch is not None and batch.rows + rows <= self._limit:
            batch.received.append(received)
            batch.rows += rows
            if batch.rows >= self._target:
                batch.full.set()
            await batch.done.wait()
        else:
            batch = _Batch([received], rows)
            self._open[instance.index] = batch
            with trio.CancelScope(shield=True):  # the others wait on this call
                await self._lead(instance, batch, parent)
        if batch.failure is None:
            return None
        return InferenceError(batch.failure, model_name=self._backend.model.name)

    async def _lead(self, instance: LoadedInstance, batch: _Batch, parent: InferRequest) -> None:
        backend = self._backend
        try:
            if batch.rows < self._target:
                with trio.move_on_after(self._delay):
                    await batch.full.wait()
            if backend.capabilities.is_async:  # concurrent on the model's loop, as Triton's
                self._close(instance, batch)
                result = await backend.call_async(instance, batch.received, parent)
            else:
                async with instance.params.lock:
                    self._close(instance, batch)
                    result = await trio.to_thread.run_sync(
                        backend.call, instance, batch.received, parent
                    )
            if result is not None:
                raise TritonModelException(
                    f"Python model '{instance.params.name}' is using the decoupled mode and "
                    "the execute function must return None."
                )
        except Exception as exc:
            batch.failure = str(backend.failed(instance, exc))  # logged once, for the call
        finally:
            self._close(instance, batch)
            batch.done.set()

    def _close(self, instance: LoadedInstance, batch: _Batch) -> None:
        if self._open.get(instance.index) is batch:
            del self._open[instance.index]
