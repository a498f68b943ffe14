"""What loading models on first use costs (``orchestrion serve --model-load-on-demand``):
the first request of a model that is not loaded (its load, then its answer) against a request
once it is, and a round of requests over many models with room for a few against the same
round with every model loaded.

Run: ``.venv/bin/python bench/on_demand.py [--models N] [--room K] [--rounds R]``.

The repository is written to a temporary folder: ``N`` plain Python models and ``N`` jitted
JAX models, ``Y = X + k`` on 16 floats. Everything runs in one process on one server, through
the same path the front ends take (`WireInfer` with an `OnDemand`), so the times are the load,
the unload and the request, without a network. Each figure is the median over the models and
``R`` rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import trio
from _common import table

from orchestrion import AsyncServer, open_server
from orchestrion.frontends._control import ModelControl, ModelControlMode
from orchestrion.frontends._on_demand import open_on_demand
from orchestrion.frontends._wire_infer import WireInfer
from orchestrion.protocols import WireRequest

_CONFIG = """name: "{name}"
max_batch_size: 0
input [ {{ name: "X" data_type: TYPE_FP32 dims: [ 16 ] }} ]
output [ {{ name: "Y" data_type: TYPE_FP32 dims: [ 16 ] }} ]
"""
_PLAIN = "JIT = False\n\n\ndef execute(X):\n    return {{'Y': X + {k}}}\n"
_JAX = "def execute(X):\n    return {{'Y': X + {k}}}\n"
KINDS = {"plain Python": ("py", _PLAIN), "jitted JAX": ("jax", _JAX)}


def _repository(root: Path, count: int) -> None:
    for prefix, code in KINDS.values():
        for k in range(count):
            folder = root / f"{prefix}{k}"
            (folder / "1").mkdir(parents=True)
            (folder / "config.pbtxt").write_text(_CONFIG.format(name=f"{prefix}{k}"))
            (folder / "1" / "model.py").write_text(code.format(k=k))


@contextlib.asynccontextmanager
async def _served(root: Path, room: int | None) -> AsyncIterator[tuple[AsyncServer, WireInfer]]:
    async with open_server(root, load_models=[]) as server:
        control = ModelControl(server, mode=ModelControlMode.EXPLICIT)
        async with open_on_demand(server, control, max_models=room) as on_demand:
            yield server, WireInfer(server, on_demand=on_demand)


async def _request(wire: WireInfer, name: str, k: int) -> float:
    x = np.arange(16, dtype=np.float32)
    started = time.perf_counter()
    async with wire.holding(name):  # as the front ends hold a request's model
        response = await wire.infer(WireRequest(model_name=name, inputs={"X": x}))
    seconds = time.perf_counter() - started
    assert response.outputs["Y"].tolist() == (x + k).tolist()
    return seconds


async def _first_and_warm(root: Path, prefix: str, count: int) -> tuple[float, float, float]:
    """Median first request, warm request and unload, over ``count`` models."""
    cold, warm, unload = [], [], []
    async with _served(root, 1) as (_, wire):
        assert wire.on_demand is not None
        for k in range(count):
            before = wire.on_demand.eviction_seconds
            cold.append(await _request(wire, f"{prefix}{k}", k))
            if k:
                unload.append(wire.on_demand.eviction_seconds - before)
            warm.append(min([await _request(wire, f"{prefix}{k}", k) for _ in range(20)]))
    return statistics.median(cold), statistics.median(warm), statistics.median(unload)


async def _round(root: Path, prefix: str, count: int, room: int | None) -> float:
    """Seconds for one request to each model in turn, the models loaded beforehand when
    there is room for all (``room`` None) and loaded on demand otherwise."""
    async with _served(root, room) as (_, wire):
        if room is None:
            for k in range(count):
                await _request(wire, f"{prefix}{k}", k)
        started = time.perf_counter()
        for k in range(count):
            await _request(wire, f"{prefix}{k}", k)
        return time.perf_counter() - started


async def main(models: int, room: int, rounds: int) -> None:
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        _repository(root, models)
        rows, cycles = [], []
        for kind, (prefix, _) in KINDS.items():
            firsts = [await _first_and_warm(root, prefix, models) for _ in range(rounds)]
            cold = statistics.median(f[0] for f in firsts)
            warm = statistics.median(f[1] for f in firsts)
            unload = statistics.median(f[2] for f in firsts)
            rows.append(
                [
                    kind,
                    f"{cold * 1e3:.1f}",
                    f"{warm * 1e6:.0f}",
                    f"{unload * 1e3:.1f}",
                    f"{cold / warm:.0f}x",
                ]
            )
            loaded = statistics.median(
                [await _round(root, prefix, models, None) for _ in range(rounds)]
            )
            cycling = statistics.median(
                [await _round(root, prefix, models, room) for _ in range(rounds)]
            )
            cycles.append(
                [
                    kind,
                    f"{models / loaded:.0f}",
                    f"{models / cycling:.1f}",
                    f"{cycling / loaded:.0f}x",
                ]
            )
    print(f"First request of a model not loaded (load + answer), {models} models, median\n")
    header = ["model kind", "first request ms", "warm request µs", "unload ms", "first ÷ warm"]
    print(table(header, rows))
    print(f"\nOne request to each of {models} models in turn: all loaded, or room for {room}\n")
    header = ["model kind", "all loaded req/s", f"room for {room} req/s", "slower by"]
    print(table(header, cycles))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", type=int, default=20)
    parser.add_argument("--room", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    arguments = parser.parse_args()
    trio.run(main, arguments.models, arguments.room, arguments.rounds)
