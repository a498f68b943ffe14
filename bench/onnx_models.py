"""One network three ways: jitted JAX and ONNX Runtime inside orchestrion, and ONNX Runtime
(and JAX) called directly, at batch 1 to 64 and under concurrent clients.

Run: ``.venv/bin/python bench/onnx_models.py [--quick] [--seconds S] [--repeats R]
[--batches 1,4,16,64] [--clients 1,8,32]``. ``--quick`` makes every measurement tiny (the
smoke test in tests/test_benchmarks_run.py uses it); its numbers mean little.

The network is the ONNX pipeline example's classifier (examples/onnx_pipeline/network.py):
three 3x3 convolutions of stride 2 (32, 64, 64 channels) with ReLU, global average pooling
and a dense layer to 10 classes, on FP32 [3, 64, 64] images; about 16 MFLOP per image. Its
weights come from one seed; the ONNX graph and the JAX function are built from the same
weights, and every variant's answer to one batch is checked against JAX's before timing.

Table 1, one client, batch B (each call carries B images, B from ``--batches``):
  ``ONNX Runtime, direct``   ``session.run`` in a loop (no server);
  ``orchestrion ONNX``       the graph as ``Model(onnx=...)``, ``await server.infer`` in a loop;
  ``orchestrion JAX``        ``jax_forward`` as a jitted orchestrion model, the same loop;
  ``JAX jit, direct``        the jitted function in a loop, ``np.asarray`` on its result.
Every session and model has ONNX Runtime's and XLA's default threads (all cores) and one
instance; the orchestrion models have ``max_batch_size: 64`` and no dynamic batcher (the
client sends whole batches). ``images/s`` is B over the mean time per call; ``p50``/``p99``
are per call.

Table 2, C concurrent clients sending one image per request (closed loop, C from
``--clients``): the direct variants call from C threads (ONNX Runtime and XLA release the
GIL); the orchestrion models add ``dynamic_batching {}`` so concurrent requests join, and
``mean batch`` is their inference count over their execution count. ``req/s`` is requests
answered per second.

Each measurement runs ``--seconds`` (after a warm-up of a quarter of that); variants are
interleaved and the table shows the median of ``--repeats`` runs. The machine may be shared:
compare within a run.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import jax
import numpy as np
import onnxruntime
import trio
from _common import table

import orchestrion
from orchestrion.protocols import (
    DataType,
    DynamicBatching,
    InstanceGroup,
    InstanceKind,
    ModelConfig,
    TensorConfig,
)

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "onnx_pipeline"
Result = tuple[float, float, float, float]
"""Calls or requests per second, p50 µs, p99 µs, mean batch (0: not measured)."""


def load_network() -> ModuleType:
    """The example's ``network.py`` (by its path: examples/ is no package)."""
    spec = importlib.util.spec_from_file_location("_bench_network", EXAMPLE / "network.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


NET = load_network()
SHAPE = (3, NET.SIZE, NET.SIZE)
VARIANTS = ("ONNX Runtime, direct", "orchestrion ONNX", "orchestrion JAX", "JAX jit, direct")
"""The rows of each table, in order."""


def _config(name: str, batching: bool, **more: Any) -> ModelConfig:
    return ModelConfig(
        name=name,
        max_batch_size=64,
        input=(TensorConfig(name="pixels", data_type=DataType.FP32, dims=SHAPE),),
        output=(TensorConfig(name="logits", data_type=DataType.FP32, dims=(NET.CLASSES,)),),
        dynamic_batching=DynamicBatching() if batching else None,
        instance_group=(InstanceGroup(kind=InstanceKind.KIND_CPU),),
        **more,
    )


def models(batching: bool) -> list[orchestrion.Model]:
    """The network as an ONNX model (``onnx``) and as a jitted JAX one (``jax``)."""

    def execute(params: Any, pixels: Any) -> dict[str, Any]:
        return {"logits": NET.jax_forward(params, pixels)}

    return [
        orchestrion.Model(
            config=_config("onnx", batching, platform="onnxruntime_onnx"), onnx=NET.onnx_graph()
        ),
        orchestrion.Model(
            config=_config("jax", batching), execute=execute, initialize=lambda c: NET.weights()
        ),
    ]


def _summary(calls: int, seconds: float, latencies: list[int], batch: float) -> Result:
    ordered = sorted(latencies)
    p50 = ordered[len(ordered) // 2] / 1e3
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] / 1e3
    return calls / seconds, p50, p99, batch


def _timed(call: Callable[[], object], seconds: float) -> Result:
    end = time.perf_counter() + seconds / 4
    while time.perf_counter() < end:  # warm-up
        call()
    latencies: list[int] = []
    start = time.perf_counter()
    end = start + seconds
    while (now := time.perf_counter()) < end:
        t0 = time.perf_counter_ns()
        call()
        latencies.append(time.perf_counter_ns() - t0)
    return _summary(len(latencies), now - start, latencies, 0.0)


def _threads(call: Callable[[], object], clients: int, seconds: float) -> Result:
    """``call`` from ``clients`` threads for ``seconds`` (after a warm-up)."""
    _timed(call, seconds / 4)
    latencies: list[list[int]] = [[] for _ in range(clients)]
    end = time.perf_counter() + seconds

    def worker(mine: list[int]) -> None:
        while time.perf_counter() < end:
            t0 = time.perf_counter_ns()
            call()
            mine.append(time.perf_counter_ns() - t0)

    start = time.perf_counter()
    workers = [threading.Thread(target=worker, args=(m,)) for m in latencies]
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join()
    every = [v for m in latencies for v in m]
    return _summary(len(every), time.perf_counter() - start, every, 0.0)


async def _clients(
    server: orchestrion.AsyncServer,
    name: str,
    x: np.ndarray[Any, Any],
    clients: int,
    seconds: float,
) -> tuple[list[int], float]:
    """``clients`` trio tasks sending ``x`` to ``name`` for ``seconds``: the latencies, and
    how long they took."""
    latencies: list[int] = []
    end = time.perf_counter() + seconds

    async def client() -> None:
        while time.perf_counter() < end:
            t0 = time.perf_counter_ns()
            await server.infer(name, {"pixels": x})
            latencies.append(time.perf_counter_ns() - t0)

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(clients):
            nursery.start_soon(client)
    return latencies, time.perf_counter() - start


async def _served(
    server: orchestrion.AsyncServer,
    name: str,
    x: np.ndarray[Any, Any],
    clients: int,
    seconds: float,
) -> Result:
    """`_clients` after a warm-up of a quarter of ``seconds``, with the mean batch."""
    await _clients(server, name, x, clients, seconds / 4)
    before = server.model_statistics(name)[0]
    latencies, took = await _clients(server, name, x, clients, seconds)
    after = server.model_statistics(name)[0]
    executions = after.execution_count - before.execution_count
    batch = (after.inference_count - before.inference_count) / max(executions, 1)
    return _summary(len(latencies), took, latencies, batch)


def _check(outputs: dict[str, np.ndarray[Any, Any]], x: np.ndarray[Any, Any]) -> None:
    reference = np.asarray(jax.jit(NET.jax_forward)(NET.weights(), x))
    for name, got in outputs.items():
        np.testing.assert_allclose(got, reference, rtol=1e-3, atol=1e-4, err_msg=name)


def _direct() -> tuple[Any, Callable[..., Any]]:
    session = onnxruntime.InferenceSession(NET.onnx_graph(), providers=["CPUExecutionProvider"])
    fn = jax.jit(NET.jax_forward)
    params = jax.device_put(NET.weights())
    return session, lambda x: np.asarray(fn(params, x))


def _images(batch: int, seed: int = 0) -> np.ndarray[Any, Any]:
    return np.random.default_rng(seed).standard_normal((batch, *SHAPE)).astype(np.float32)


async def one_client(batches: list[int], seconds: float, repeats: int) -> list[list[str]]:
    """Table 1: the median over ``repeats`` of each variant at each batch size."""
    session, jitted = _direct()
    found: dict[tuple[int, str], list[Result]] = {}
    async with orchestrion.open_server(models=models(batching=False)) as server:
        x = _images(max(batches))
        served = {
            n: (await server.infer(n, {"pixels": x})).outputs["logits"] for n in ("onnx", "jax")
        }
        _check({**served, "direct": session.run(None, {"pixels": x})[0], "jit": jitted(x)}, x)
        for repeat in range(repeats):
            for batch in batches[repeat % len(batches) :] + batches[: repeat % len(batches)]:
                x = _images(batch)
                variants: dict[str, Any] = {
                    "ONNX Runtime, direct": lambda x=x: session.run(None, {"pixels": x}),
                    "JAX jit, direct": lambda x=x: jitted(x),
                }
                for name, call in variants.items():
                    result = await trio.to_thread.run_sync(_timed, call, seconds)
                    found.setdefault((batch, name), []).append(result)
                for name, model in (("orchestrion ONNX", "onnx"), ("orchestrion JAX", "jax")):
                    result = await _served(server, model, x, 1, seconds)
                    found.setdefault((batch, name), []).append(result)
    rows = []
    for batch in batches:
        for name in VARIANTS:
            results = found[(batch, name)]
            rate = statistics.median(r[0] for r in results)
            rows.append(
                [
                    str(batch),
                    name,
                    f"{rate * batch:,.0f}",
                    f"{statistics.median(r[1] for r in results):,.0f}",
                    f"{statistics.median(r[2] for r in results):,.0f}",
                ]
            )
    return rows


async def many_clients(clients: list[int], seconds: float, repeats: int) -> list[list[str]]:
    """Table 2: one image per request from C clients; the median over ``repeats``."""
    session, jitted = _direct()
    x = _images(1)
    found: dict[tuple[int, str], list[Result]] = {}
    async with orchestrion.open_server(models=models(batching=True)) as server:
        for _ in range(repeats):
            for count in clients:
                direct = {
                    "ONNX Runtime, direct": lambda: session.run(None, {"pixels": x}),
                    "JAX jit, direct": lambda: jitted(x),
                }
                for name, call in direct.items():
                    result = await trio.to_thread.run_sync(_threads, call, count, seconds)
                    found.setdefault((count, name), []).append(result)
                for name, model in (("orchestrion ONNX", "onnx"), ("orchestrion JAX", "jax")):
                    result = await _served(server, model, x, count, seconds)
                    found.setdefault((count, name), []).append(result)
    rows = []
    for count in clients:
        for name in VARIANTS:
            results = found[(count, name)]
            batch = statistics.median(r[3] for r in results)
            rows.append(
                [
                    str(count),
                    name,
                    f"{statistics.median(r[0] for r in results):,.0f}",
                    f"{statistics.median(r[1] for r in results):,.0f}",
                    f"{statistics.median(r[2] for r in results):,.0f}",
                    f"{batch:.1f}" if batch else "-",
                ]
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny measurements (a smoke test)")
    parser.add_argument("--seconds", type=float, default=2.0, help="per measurement (2)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per variant (3)")
    parser.add_argument("--batches", default="1,4,16,64", help="table 1's batch sizes")
    parser.add_argument("--clients", default="1,8,32", help="table 2's concurrent clients")
    args = parser.parse_args()
    seconds, repeats = (0.05, 1) if args.quick else (args.seconds, args.repeats)
    batches = [int(b) for b in args.batches.split(",")]
    clients = [int(c) for c in args.clients.split(",")]
    print(
        f"{platform.machine()}, {os.cpu_count()} CPUs; onnxruntime {onnxruntime.__version__}, "
        f"jax {jax.__version__}; {seconds} s per measurement, median of {repeats}"
    )
    rows = trio.run(one_client, batches, seconds, repeats)
    print("\nOne client, B images per call")
    print(table(["batch", "variant", "images/s", "p50 µs", "p99 µs"], rows, left=2))
    rows = trio.run(many_clients, clients, seconds, repeats)
    print("\nC clients, one image per request (orchestrion: dynamic batching)")
    print(table(["clients", "variant", "req/s", "p50 µs", "p99 µs", "mean batch"], rows, left=2))


if __name__ == "__main__":
    main()
