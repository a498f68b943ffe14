"""Where a request's time goes: cost per ensemble step and the parts of one step.

Prints (1) microseconds per request for chains of 1..4 identical tiny steps at concurrency 16
(the slope is the cost of one step, the intercept the fixed cost of a request), and (2) the
cost of the layers of one synchronous step, timed in a tight loop.

    .venv/bin/python bench/step_costs.py
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import trio

import orchestrion
from orchestrion.protocols import (
    DataType,
    EnsembleScheduling,
    EnsembleStep,
    InferRequest,
    ModelConfig,
    TensorConfig,
)
from orchestrion.testing import inside

ROW = (1, 16)
X = np.arange(16, dtype=np.float32).reshape(ROW)


def _tensor(name: str) -> TensorConfig:
    return TensorConfig(name=name, data_type=DataType.FP32, dims=ROW)


def _model(name: str) -> orchestrion.Model:
    config = ModelConfig(name=name, input=(_tensor("X"),), output=(_tensor("Y"),))
    return orchestrion.Model(config=config, execute=lambda X: {"Y": X * 2 + 1})


def chain(length: int) -> list[orchestrion.Model]:
    """``length`` tiny models in a row, and the ensemble ``e`` that chains them."""
    steps = tuple(
        EnsembleStep(
            model_name=f"m{i}",
            input_map={"X": "IN" if i == 0 else f"t{i}"},
            output_map={"Y": "OUT" if i == length - 1 else f"t{i + 1}"},
        )
        for i in range(length)
    )
    ensemble = ModelConfig(
        name="e",
        platform="ensemble",
        input=(_tensor("IN"),),
        output=(_tensor("OUT"),),
        ensemble_scheduling=EnsembleScheduling(step=steps),
    )
    return [*(_model(f"m{i}") for i in range(length)), orchestrion.Model(config=ensemble)]


async def per_request(
    models: list[orchestrion.Model], name: str, n: int, concurrency: int
) -> float:
    """Microseconds per request, ``n`` requests from ``concurrency`` clients."""
    key = "X" if name.startswith("m") else "IN"
    async with orchestrion.open_server(models=models) as server:
        for _ in range(300):
            await server.infer(name, {key: X})
        left = [n]

        async def client() -> None:
            while left[0] > 0:
                left[0] -= 1
                await server.infer(name, {key: X})

        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for _ in range(concurrency):
                nursery.start_soon(client)
        return (time.perf_counter() - start) / n * 1e6


def loop_cost(fn: Callable[[], Any], n: int = 20000) -> float:
    """Microseconds per call of ``fn`` in a tight loop."""
    for _ in range(500):
        fn()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1e6


async def layers() -> list[tuple[str, float]]:
    """The cost of each layer of one synchronous step."""
    async with orchestrion.open_server(models=[_model("m")]) as server:
        registry = inside(server).registry
        runner = inside(server).runner("m")
        instance = runner.instances[0]
        request = InferRequest(model_name="m", inputs={"X": X}, requested_outputs=frozenset({"Y"}))
        fn = jax.jit(lambda X: {"Y": X * 2 + 1})
        return [
            (
                "jitted call + np.asarray",
                loop_cost(lambda: {k: np.asarray(v) for k, v in fn(X=X).items()}),
            ),
            (
                "+ execute wrapper (timings, output checks)",
                loop_cost(lambda: runner.pool.run_inline(instance, request, None)),
            ),
            ("+ instance, execution stats, response", loop_cost(lambda: runner.infer_now(request))),
            (
                "+ admission: resolve, input checks, request stats",
                loop_cost(lambda: registry.infer_now(request)),
            ),
        ]


def main() -> None:
    """Print both tables."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10000, help="requests per pipeline")
    n = parser.parse_args().requests
    print(f"jax {jax.__version__}, trio {trio.__version__}, {n} requests at concurrency 16\n")
    print(f"{'pipeline':<22}{'µs/request':>12}")
    print(f"{'direct model call':<22}{trio.run(per_request, [_model('m0')], 'm0', n, 16):>12.1f}")
    for length in (1, 2, 3, 4):
        cost = trio.run(per_request, chain(length), "e", n, 16)
        print(f"{f'ensemble, {length} step(s)':<22}{cost:>12.1f}")
    print(f"\n{'one synchronous step, cumulative':<52}{'µs':>6}")
    for label, cost in trio.run(layers):
        print(f"{label:<52}{cost:>6.2f}")


if __name__ == "__main__":
    main()
