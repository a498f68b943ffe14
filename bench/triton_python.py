"""What Triton's python backend and scoped 64-bit types cost inside orchestrion.

Three comparisons, each side by side in one run (ratios, not absolutes, are what carry over
between machines):

1. The same numpy add_sub as a Triton python model (tests/triton_models/add_sub, unchanged:
   ``execute(requests)`` in a worker thread; and the same class with ``execution: inline``)
   and as orchestrion's own plain-Python model (``JIT = False``, inline when fast), at
   concurrency 1 and 16.
2. A BLS call (tests/triton_models/bls calling add_sub): inline, the call waiting through a
   greenback portal (what a short BLS model gets), and forced into a worker thread.
3. A jitted ``Y = X * 2 + 1`` on INT32 (JAX's default 32 bits) and on INT64 (64-bit types on
   for that model's calls only): per call of the backend alone, and per request.

    .venv/bin/python bench/triton_python.py [--seconds 2]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import trio
from _common import table

import orchestrion
from orchestrion.backends import backend_for
from orchestrion.protocols import DataType, ModelConfig, TensorConfig
from orchestrion.testing import inside

HERE = Path(__file__).resolve().parent
REPOSITORY = HERE.parent / "tests" / "triton_models"
A = np.array([1, 2, 3, 4], np.float32)
B = np.array([4, 3, 2, 1], np.float32)


def _plain_add_sub() -> orchestrion.Model:
    """add_sub in orchestrion's own contract, plain Python (numpy), the same arithmetic."""
    tensors = [
        TensorConfig(name=n, data_type=DataType.FP32, dims=(4,)) for n in ("INPUT0", "INPUT1")
    ]
    outputs = [
        TensorConfig(name=n, data_type=DataType.FP32, dims=(4,)) for n in ("OUTPUT0", "OUTPUT1")
    ]
    config = ModelConfig(name="plain_add_sub", input=tuple(tensors), output=tuple(outputs))

    def execute(INPUT0: Any, INPUT1: Any) -> dict[str, Any]:
        return {"OUTPUT0": INPUT0 + INPUT1, "OUTPUT1": INPUT0 - INPUT1}

    return orchestrion.Model(config=config, execute=execute, jit=False)


def _affine(name: str, dtype: str) -> orchestrion.Model:
    tensor = lambda n: TensorConfig(name=n, data_type=DataType[dtype], dims=(16,))  # noqa: E731
    config = ModelConfig(name=name, input=(tensor("X"),), output=(tensor("Y"),))
    return orchestrion.Model(config=config, execute=lambda X: {"Y": X * 2 + 1})


async def _rate(
    call: Callable[[], Awaitable[Any]], concurrency: int, seconds: float
) -> tuple[float, float]:
    """Requests per second and the median latency (µs) of ``call`` from ``concurrency``
    callers for ``seconds`` (after a short warm-up)."""
    for _ in range(50):
        await call()
    latencies: list[float] = []
    deadline = time.perf_counter() + seconds

    async def caller() -> None:
        while time.perf_counter() < deadline:
            start = time.perf_counter()
            await call()
            latencies.append(time.perf_counter() - start)

    began = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(caller)
    return len(latencies) / (time.perf_counter() - began), statistics.median(latencies) * 1e6


def _per_call_us(fn: Callable[[], Any], seconds: float) -> float:
    for _ in range(200):
        fn()
    calls = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(200):
            fn()
        calls += 200
    return (time.perf_counter() - start) / calls * 1e6


def _copy(server: orchestrion.AsyncServer, name: str, execution: str) -> orchestrion.Model:
    """The repository's python model ``name`` again, as ``<name>_<execution>`` with
    ``parameters { execution: <execution> }`` (the class as loaded, no file changed)."""
    loaded = inside(server).runner(name).model
    config = attrs.evolve(
        loaded.config,
        name=f"{name}_{execution}",
        parameters={**loaded.config.parameters, "execution": execution},
    )
    return orchestrion.Model(config=config, code=loaded.code)


def _backend_us(dtype: str, seconds: float) -> float:
    """µs per call of a jitted ``X * 2 + 1`` backend alone (no server)."""
    backend = backend_for(_affine("alone", dtype))
    instance = backend.load()[0]
    x = np.arange(16, dtype=np.int64 if dtype == "INT64" else np.int32)
    if dtype == "INT64":
        x = x + 2**40
    return _per_call_us(lambda: backend.execute(instance, {"X": x}), seconds)


async def main(seconds: float) -> None:
    rows: list[tuple[str, str, str, str]] = []
    models = [_plain_add_sub(), _affine("affine32", "INT32"), _affine("affine64", "INT64")]
    async with orchestrion.open_server(
        model_repository=REPOSITORY, load_models=["add_sub", "bls"], models=models
    ) as server:
        await server.load_model(_copy(server, "add_sub", "inline"))
        await server.load_model(_copy(server, "bls", "thread"))
        inputs = {"INPUT0": A, "INPUT1": B}
        bls_inputs = {"MODEL_NAME": np.array([b"add_sub"], dtype=object), **inputs}
        calls: list[tuple[str, Callable[[], Awaitable[Any]]]] = [
            (
                "add_sub, orchestrion plain Python (JIT = False)",
                lambda: server.infer("plain_add_sub", inputs),
            ),
            ("add_sub, Triton python model (unchanged)", lambda: server.infer("add_sub", inputs)),
            (
                "add_sub, Triton python model, execution: inline",
                lambda: server.infer("add_sub_inline", inputs),
            ),
            (
                "bls -> add_sub (one BLS call; inline, waiting through a portal)",
                lambda: server.infer("bls", bls_inputs),
            ),
            (
                "bls -> add_sub, execution: thread (the hop there and back)",
                lambda: server.infer("bls_thread", bls_inputs),
            ),
        ]
        for label, call in calls:
            for concurrency in (1, 16):
                rate, p50 = await _rate(call, concurrency, seconds)
                rows.append((label, str(concurrency), f"{rate:,.0f}", f"{p50:,.0f}"))
        x32 = np.arange(16, dtype=np.int32)
        x64 = np.arange(16, dtype=np.int64) + 2**40
        for label, name, x in (
            ("X*2+1 jitted, INT32", "affine32", x32),
            ("X*2+1 jitted, INT64 (x64 scoped)", "affine64", x64),
        ):
            rate, p50 = await _rate(lambda n=name, v=x: server.infer(n, {"X": v}), 1, seconds)
            rows.append((label, "1", f"{rate:,.0f}", f"{p50:,.0f}"))
    print(table(("what", "concurrency", "req/s", "p50 µs"), rows))
    print()
    alone = [
        ("X*2+1, INT32", f"{_backend_us('INT32', seconds):.2f}"),
        ("X*2+1, INT64 (x64 scoped)", f"{_backend_us('INT64', seconds):.2f}"),
    ]
    print(table(("backend.execute alone", "µs per call"), alone))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=2.0, help="seconds per measurement")
    trio.run(main, parser.parse_args().seconds)
