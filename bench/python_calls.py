"""Python function calls per request, counted: what the runtime's own code costs a request,
independent of the machine's speed and load.

Run: ``.venv/bin/python bench/python_calls.py [--requests N] [--warmup W]``.

Four served models, one request at a time through ``AsyncServer.infer`` (16 FP32 values):
a plain-Python model that runs inline, the same model batching dynamically (one row per
request), a 3-step ensemble of jitted steps (run fused) and the same ensemble of plain
steps (run by the scheduler's step actors). After ``W`` warm-up requests, ``sys.setprofile``
counts every Python ``call`` event (functions, generators resumed, comprehensions) during
``N`` requests; C functions are not counted. The count moves only when the code on a
request's path changes, so it compares two commits exactly where timings are noise.
"""

from __future__ import annotations

import argparse
import sys
from types import FrameType
from typing import Any

import attrs
import numpy as np
import trio
from _common import table

import orchestrion
from orchestrion.protocols import DynamicBatching
from orchestrion.testing import ensemble, infer_until_fused, model, step, tensor


def add_one(X: Any) -> dict[str, Any]:
    """Every step: its input plus one."""
    return {"Y": X + 1}


def _pipe(name: str, jit: bool) -> list[orchestrion.Model]:
    steps = [model(f"{name}{i}", add_one, [tensor("X")], [tensor("Y")], jit=jit) for i in range(3)]
    wiring = [
        step(f"{name}0", {"X": "X"}, {"Y": "a"}),
        step(f"{name}1", {"X": "a"}, {"Y": "b"}),
        step(f"{name}2", {"X": "b"}, {"Y": "Y"}),
    ]
    return [*steps, ensemble(name, [tensor("X")], [tensor("Y")], wiring)]


async def _count(server: orchestrion.AsyncServer, name: str, x: Any, n: int, warmup: int) -> float:
    for _ in range(warmup):
        await server.infer(name, {"X": x})
    calls = 0

    def profile(frame: FrameType, event: str, arg: object) -> None:
        nonlocal calls
        if event == "call":
            calls += 1

    sys.setprofile(profile)
    try:
        for _ in range(n):
            await server.infer(name, {"X": x})
    finally:
        sys.setprofile(None)
    return calls / n


async def _measure(n: int, warmup: int) -> list[tuple[str, str]]:
    x = np.ones(16, np.float32)
    plain = model("plain", add_one, [tensor("X")], [tensor("Y")], jit=False)
    batching = model("batching", add_one, [tensor("X")], [tensor("Y")], jit=False, max_batch_size=8)
    batching = attrs.evolve(
        batching, config=attrs.evolve(batching.config, dynamic_batching=DynamicBatching())
    )
    models = [plain, batching, *_pipe("fused", True), *_pipe("scheduled", False)]
    async with orchestrion.open_server(models=models) as server:
        fused = await infer_until_fused(server, "fused", {"X": x})
        rows = [
            ("plain model, inline", await _count(server, "plain", x, n, warmup)),
            ("batching model (one row)", await _count(server, "batching", x[None], n, warmup)),
            (
                "3-step ensemble, jitted steps, fused" if fused else "3-step jitted (NOT fused)",
                await _count(server, "fused", x, n, warmup),
            ),
            (
                "3-step ensemble, plain steps, scheduled",
                await _count(server, "scheduled", x, n, warmup),
            ),
        ]
    return [(what, f"{calls:.1f}") for what, calls in rows]


def main() -> None:
    """Print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=100, help="requests counted per model")
    parser.add_argument("--warmup", type=int, default=20, help="requests before counting")
    args = parser.parse_args()
    rows = trio.run(_measure, args.requests, args.warmup)
    print(table(("served model", "Python calls per request"), rows))


if __name__ == "__main__":
    main()
