"""One decoded request (`WireRequest`) through the server, with what the wire adds around the
model: inputs read from shared memory before it runs, outputs classified or written into
shared memory after. The HTTP and gRPC front ends (streams too) run every request here.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import AsyncGenerator
from typing import Any

import attrs
import numpy as np

from .._server import AsyncServer, CacheTierLink
from ..protocols import InferResponse, RequestOptions, WireRequest, classified
from ._offload import off_loop
from ._on_demand import OnDemand
from ._shared_memory import Lease, SharedMemory

CACHED_MODEL: contextvars.ContextVar[tuple[str, int] | None] = contextvars.ContextVar(
    "CACHED_MODEL", default=None
)
"""Set by `WireInfer.infer`, in the task that asked, to the model name and version whose
answer it returned when that answer is one the response cache may keep: the model caches
responses, and the request's bytes say everything it computed from (no shared memory). A
front end with a cache tier of its own stores the answer's bytes then."""


@attrs.define(eq=False)
class WireInfer:
    """Runs wire requests on one server, with its shared memory regions."""

    server: AsyncServer
    shared_memory: SharedMemory = attrs.field(factory=SharedMemory)
    on_demand: OnDemand | None = None
    """Loads models on first use (``--model-load-on-demand``; None: model control only).
    A front end holds a request's model (`holding`) from before it reads the model's config;
    a stream holds it itself, to its last response (a streamed answer outlives its route)."""
    _link: CacheTierLink = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._link = self.server.cache_tier_link()

    async def infer(self, wire: WireRequest, traceparent: str | None = None) -> InferResponse:
        """The one response to ``wire`` (shared memory outputs written, classes made).

        Raises:
            OrchestrionError: as `AsyncServer.infer`, or a shared memory or classification
                problem (named).
        """
        with self.shared_memory.lease(wire) as lease:
            inputs = await _inputs(wire, lease)
            response = await self.server.infer(
                wire.model_name, inputs, options=wire.options, traceparent=traceparent
            )
            finished = await self._finished(wire, lease, response)
            if lease is None and self._link.caches(response.model_name, response.model_version):
                CACHED_MODEL.set((response.model_name, response.model_version))
            return finished

    def holding(self, name: str) -> contextlib.AbstractAsyncContextManager[object]:
        """Hold model ``name`` while the block runs, loading it first when models load on
        demand (otherwise nothing)."""
        if self.on_demand is None:
            return contextlib.nullcontext()
        return self.on_demand.using(name)

    async def stream(
        self, wire: WireRequest, options: RequestOptions
    ) -> AsyncGenerator[InferResponse, None]:
        """The responses of a decoupled model to ``wire``, each finished as `infer`'s (a
        shared memory output holds the latest)."""
        async with self.holding(wire.model_name):
            with self.shared_memory.lease(wire) as lease:
                inputs = await _inputs(wire, lease)
                responses = self.server.stream_infer(wire.model_name, inputs, options=options)
                async with contextlib.aclosing(responses) as each:
                    async for response in each:
                        if response.error is not None:  # no outputs to finish
                            yield response
                        else:
                            yield await self._finished(wire, lease, response)

    async def _finished(
        self, wire: WireRequest, lease: Lease | None, response: InferResponse
    ) -> InferResponse:
        if wire.classifications:
            config = self.server.model_config(response.model_name, response.model_version)
            response = classified(
                response,
                wire.classifications,
                self.server.output_labels(response.model_name, response.model_version),
                batched=config.max_batch_size > 0,
            )
        if lease is not None:
            await off_loop(lease.size, lease.write_outputs, response.outputs)
        return response


async def _inputs(wire: WireRequest, lease: Lease | None) -> dict[str, np.ndarray[Any, Any]]:
    if lease is None:
        return wire.inputs
    shared = await off_loop(lease.size, lease.read_inputs)
    return {**wire.inputs, **shared}
