"""Metric values at the edges: reloads, inline refusals, failed durations, coalesced hits."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
import trio

import orchestrion
from orchestrion.testing import cached, ensemble, gated, model, plus_one, step, tensor
from support.metrics import metric_value

X = np.arange(16, dtype=np.float32)


async def test_reloading_a_model_never_moves_its_counters_backwards() -> None:
    """A reload of the same name+version keeps the same label set: its counters must not reset."""
    async with orchestrion.open_server(models=[plus_one("a")]) as server:
        for _ in range(3):
            await server.infer("a", {"X": X})
        before = metric_value(server.metrics_text(), "nv_inference_request_success", model="a")
        await server.load_model(plus_one("a"))  # same name, same version 1
        after = metric_value(server.metrics_text(), "nv_inference_request_success", model="a")
    assert before == 3
    assert after >= before


def shrinking_pipe(async_second: bool) -> list[orchestrion.Model]:
    """a returns 8 values where b needs 16: b refuses every request of the ensemble."""
    first = model("a", lambda X: {"Y": X[:8]}, [tensor("X")], [tensor("Y", dims=(-1,))], jit=False)
    if async_second:

        async def run(X: Any) -> dict[str, Any]:
            return {"Y": X}

        second = model("b", run, [tensor("X")], [tensor("Y")], jit=False)
    else:
        second = model("b", lambda X: {"Y": X}, [tensor("X")], [tensor("Y")], jit=False)
    pipe = ensemble(
        "pipe",
        [tensor("IN")],
        [tensor("OUT")],
        [step("a", {"X": "IN"}, {"Y": "mid"}), step("b", {"X": "mid"}, {"Y": "OUT"})],
    )
    return [first, second, pipe]


@pytest.mark.parametrize("async_second", [True, False], ids=["queued", "inline"])
async def test_a_step_request_refused_by_its_model_is_rejected_either_way(
    async_second: bool,
) -> None:
    """A composing model's refusal counts as REJECTED whether the step ran inline or queued."""
    async with orchestrion.open_server(models=shrinking_pipe(async_second)) as server:
        with pytest.raises(orchestrion.InferenceError):
            await server.infer("pipe", {"IN": X})
        text = server.metrics_text()
    assert metric_value(text, "nv_inference_request_failure", model="b", reason="REJECTED") == 1


async def test_request_duration_counts_successes_only() -> None:
    """Triton adds to nv_inference_request_duration_us only on success: failures add nothing."""

    def failing(X: Any) -> Any:
        time.sleep(0.05)
        raise RuntimeError("no")

    broken = model("f", failing, [tensor("X")], [tensor("Y")], jit=False)
    async with orchestrion.open_server(models=[broken]) as server:
        with pytest.raises(orchestrion.InferenceError):
            await server.infer("f", {"X": X})
        text = server.metrics_text()
    assert metric_value(text, "nv_inference_request_success", model="f") == 0
    assert metric_value(text, "nv_inference_request_duration_us", model="f") == 0


async def test_coalesced_requests_agree_with_the_cache_wide_hits() -> None:
    """Per-model cache hits and the cache-wide nv_cache_num_hits count the same lookups."""
    gate = trio.Event()
    slow = cached(gated("g", gate))
    async with orchestrion.open_server(models=[slow], cache_config="local,size=1048576") as server:
        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(server.infer, "g", {"X": X})
            await trio.testing.wait_all_tasks_blocked()
            gate.set()
        text = server.metrics_text()
    per_model = metric_value(text, "nv_cache_num_hits_per_model", model="g")
    assert per_model == metric_value(text, "nv_cache_num_hits")
