"""JAX on a GPU, through orchestrion: KIND_GPU placement and MLP throughput by batch size.

One prepared script for a machine with an NVIDIA GPU (``pip install 'orchestrion[cuda]'``):

    .venv/bin/python bench/gpu.py             # needs a GPU; says so and exits 2 without one
    .venv/bin/python bench/gpu.py --allow-cpu # the same measurements on the CPU (a dry run)

It prints (1) the devices JAX sees, (2) a jitted MLP 512 → 2048 → 2048 → 512 called directly
at batch sizes 1 … 512 (µs per call, rows/s), side by side with (3) the same model served by
orchestrion with ``instance_group { kind: KIND_GPU gpus: [0] }`` and dynamic batching, under
closed-loop clients, checking that the instance really sits on the GPU and that answers match
a float64 numpy reference.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from typing import Any

import jax
import numpy as np
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
from orchestrion.testing import inside

SIZES = (512, 2048, 2048, 512)
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def initialize(config: ModelConfig) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    params: dict[str, np.ndarray] = {}
    for i, (fan_in, fan_out) in enumerate(itertools.pairwise(SIZES)):
        params[f"w{i}"] = (rng.standard_normal((fan_in, fan_out)) / np.sqrt(fan_in)).astype(
            np.float32
        )
        params[f"b{i}"] = np.zeros(fan_out, np.float32)
    return params


def execute(params: dict[str, jax.Array], X: jax.Array) -> dict[str, jax.Array]:
    h = X
    layers = len(SIZES) - 1
    for i in range(layers):
        h = h @ params[f"w{i}"] + params[f"b{i}"]
        if i < layers - 1:
            h = jax.nn.relu(h)
    return {"Y": h}


def reference(params: dict[str, np.ndarray], x: np.ndarray) -> np.ndarray:
    h = x.astype(np.float64)
    layers = len(SIZES) - 1
    for i in range(layers):
        h = h @ params[f"w{i}"].astype(np.float64) + params[f"b{i}"]
        if i < layers - 1:
            h = np.maximum(h, 0)
    return h


def served_model(kind: InstanceKind, max_batch: int) -> orchestrion.Model:
    config = ModelConfig(
        name="mlp",
        max_batch_size=max_batch,
        input=(TensorConfig(name="X", data_type=DataType.FP32, dims=(SIZES[0],)),),
        output=(TensorConfig(name="Y", data_type=DataType.FP32, dims=(SIZES[-1],)),),
        instance_group=(
            InstanceGroup(kind=kind, count=1, gpus=(0,) if kind is InstanceKind.KIND_GPU else ()),
        ),
        dynamic_batching=DynamicBatching(max_queue_delay_microseconds=200),
    )
    return orchestrion.Model(config=config, execute=execute, initialize=initialize)


def plain_jax(device: Any, batches: tuple[int, ...], seconds: float) -> list[list[str]]:
    params = jax.device_put(initialize(ModelConfig(name="mlp")), device)
    fn = jax.jit(execute)
    rows = []
    for batch in batches:
        x = jax.device_put(np.ones((batch, SIZES[0]), np.float32), device)
        fn(params, x)["Y"].block_until_ready()  # compile
        calls, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            fn(params, x)["Y"].block_until_ready()
            calls += 1
        per_call = (time.perf_counter() - start) / calls
        rows.append([str(batch), f"{per_call * 1e6:,.1f}", f"{batch / per_call:,.0f}"])
    return rows


async def served(kind: InstanceKind, clients: int, requests: int, max_batch: int) -> list[str]:
    params = initialize(ModelConfig(name="mlp"))
    rng = np.random.default_rng(1)
    inputs = rng.standard_normal((clients, 1, SIZES[0])).astype(np.float32)
    latencies: list[float] = []
    async with orchestrion.open_server(models=[served_model(kind, max_batch)]) as server:
        runner: Any = inside(server).runner("mlp")
        platform = runner.instances[0].device.platform
        first = await server.infer("mlp", {"X": inputs[0]})
        np.testing.assert_allclose(
            first.outputs["Y"], reference(params, inputs[0]), rtol=2e-2, atol=2e-2
        )
        remaining = iter(range(requests))

        async def client(i: int) -> None:
            for _ in remaining:
                start = time.perf_counter()
                await server.infer("mlp", {"X": inputs[i]})
                latencies.append(time.perf_counter() - start)

        began = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for i in range(clients):
                nursery.start_soon(client, i)
        wall = time.perf_counter() - began
        stats = server.model_statistics("mlp")[0]
    batch = stats.inference_count / max(stats.execution_count, 1)
    return [
        f"{kind.value} ({platform})",
        str(clients),
        f"{requests / wall:,.0f}",
        f"{statistics.median(latencies) * 1e6:,.0f}",
        f"{batch:.1f}",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--allow-cpu", action="store_true", help="run on the CPU without a GPU")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for the smoke test")
    args = parser.parse_args(argv)
    print(f"jax {jax.__version__}; devices: {jax.devices()}")
    try:
        gpus = jax.devices("gpu")
    except RuntimeError as exc:
        gpus = []
        print(f"no GPU visible to JAX ({exc})")
    if not gpus and not args.allow_cpu:
        print("nothing measured: run on a machine with an NVIDIA GPU and orchestrion[cuda]")
        return 2
    device = gpus[0] if gpus else jax.devices("cpu")[0]
    kind = InstanceKind.KIND_GPU if gpus else InstanceKind.KIND_CPU
    batches = BATCHES[:4] if args.quick else BATCHES
    seconds = 0.05 if args.quick else 0.5
    print(f"\n1. plain JAX on {device}: MLP {' → '.join(map(str, SIZES))}")
    print(table(("batch", "µs per call", "rows/s"), plain_jax(device, batches, seconds)))
    clients, requests, max_batch = (8, 64, 8) if args.quick else (256, 20_000, 512)
    print(
        f"\n2. served by orchestrion ({kind.value}, dynamic batching, max_batch_size {max_batch})"
    )
    row = trio.run(served, kind, clients, requests, max_batch)
    print(table(("instance", "clients", "req/s", "p50 µs", "mean batch"), [row]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
