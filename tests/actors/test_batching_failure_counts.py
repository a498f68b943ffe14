"""How dynamic batching failures are counted."""

from __future__ import annotations

import time
from typing import Any

import attrs
import numpy as np
import trio
import trio.testing

import orchestrion
from orchestrion.protocols import DynamicBatching, InferenceTimeoutError, QueuePolicy
from orchestrion.testing import model, outcome, tensor


async def test_a_queue_policy_timeout_counts_as_rejected() -> None:
    """Triton counts a request timed out in the scheduler's queue as REJECTED, not CANCELED."""
    gate, results = trio.Event(), []

    async def execute(X: Any) -> dict[str, Any]:
        await gate.wait()
        return {"Y": X}

    definition = model(
        "m",
        execute,
        [tensor("X", dims=(4,))],
        [tensor("Y", dims=(4,))],
        jit=False,
        max_batch_size=1,
    )
    policy = QueuePolicy(default_timeout_microseconds=100_000, timeout_action="REJECT")
    config = attrs.evolve(
        definition.config, dynamic_batching=DynamicBatching(default_queue_policy=policy)
    )
    m = attrs.evolve(definition, config=config)
    x = np.ones((1, 4), np.float32)
    async with orchestrion.open_server(models=[m]) as server:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(outcome, server, results, "m", {"X": x})
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(outcome, server, results, "m", {"X": x})
            await trio.testing.wait_all_tasks_blocked()
            await trio.to_thread.run_sync(time.sleep, 0.2)  # the policy's clock is real time
            gate.set()
        stats = server.model_statistics("m")[0]
    assert any(isinstance(r, InferenceTimeoutError) for r in results), results
    assert stats.failures_by_reason == {"REJECTED": 1}, stats.failures_by_reason
