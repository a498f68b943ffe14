"""The vs_triton ensemble without any network: what the pipeline itself costs in orchestrion.

    .venv/bin/python bench/vs_triton/inprocess.py [--requests 3000]

Runs bench/vs_triton/orchestrion_models through the embedding API at concurrency 1 to 64,
as it is (dynamic batching on every step) and with ``dynamic_batching`` removed from the
configs (a copy in a temporary folder), plus a one-step ``x * 2 + 1`` model with and without
dynamic batching. Prints requests/s and CPU µs per request (process time, all threads).
"""

from __future__ import annotations

import argparse
import re
import runpy
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import trio

import orchestrion
from orchestrion import DataType, Model, ModelConfig, TensorConfig
from orchestrion.protocols import DynamicBatching

MODELS = Path(__file__).resolve().parent / "orchestrion_models"
# bench/_common.py's text tables, run from its file (bench/ is no package, and this script's
# folder is bench/vs_triton): nothing is added to sys.path.
table = runpy.run_path(str(Path(__file__).resolve().parent.parent / "_common.py"))["table"]


def _one_step(name: str, batching: bool) -> Model:
    tensor = (TensorConfig(name="X", data_type=DataType.FP32, dims=(16,)),)
    return Model(
        config=ModelConfig(
            name=name,
            max_batch_size=8,
            input=tensor,
            output=(TensorConfig(name="Y", data_type=DataType.FP32, dims=(16,)),),
            dynamic_batching=DynamicBatching() if batching else None,
        ),
        execute=lambda X: {"Y": X * 2 + 1},
    )


async def _measure(
    server: orchestrion.AsyncServer, model: str, name: str, requests: int, concurrency: int
) -> list[str]:
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal((1, 16)).astype(np.float32) for _ in range(requests)]
    for x in inputs[:200]:  # warm up
        await server.infer(model, {name: x})
    todo = iter(inputs)

    async def client() -> None:
        for x in todo:
            await server.infer(model, {name: x})

    wall, cpu = time.perf_counter(), time.process_time()
    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(client)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return [f"{requests / wall:,.0f}", f"{cpu / requests * 1e6:.0f}"]


async def main(requests: int) -> None:
    """Measure and print the table."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        plain = Path(tmp) / "models"
        shutil.copytree(MODELS, plain)
        for config in plain.glob("*/config.pbtxt"):
            text = re.sub(r"dynamic_batching\s*\{[^}]*\}", "", config.read_text())
            config.write_text(text)
        for label, repository in (("dynamic batching", MODELS), ("no batching", plain)):
            async with orchestrion.open_server(repository) as server:
                for concurrency in (1, 4, 8, 16, 64):
                    cells = await _measure(server, "ensemble", "INPUT", requests, concurrency)
                    rows.append([f"ensemble, {label}", str(concurrency), *cells])
    models = [_one_step("direct", False), _one_step("batched", True)]
    async with orchestrion.open_server(models=models) as server:
        for model in ("direct", "batched"):
            cells = await _measure(server, model, "X", requests, 1)
            rows.append([f"one step x*2+1, {model}", "1", *cells])
    print(table(["pipeline", "concurrency", "req/s", "CPU µs/request"], rows))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=3000)
    trio.run(main, parser.parse_args().requests)
