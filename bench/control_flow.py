"""What control flow costs: a skipped step, a map item and a loop iteration, declared in an
ensemble's parameters, against the same work written by hand in trio around the same server.

Run: ``.venv/bin/python bench/control_flow.py [--rounds R] [--requests N] [--items K]
[--iterations L]``.

Each construct is measured both ways on one server, in alternating rounds (the median of
``R`` rounds is reported, so both sides see the same machine load):

- **skipped step**: an ensemble of a gate and a step that its condition skips, against a
  client that calls the gate and does not call the step (``if``); per request.
- **(reference: the gate alone)**: the same ensemble without its skipped step (fusion off,
  so that it runs on the scheduler as the skipping one does), against the client's gate call:
  the skipped step's own cost is the difference between this row and the one above.
- **map item**: an ensemble whose second step is mapped over ``K`` items (a classifier that
  batches dynamically, 16 items in flight), against a client that sends the ``K`` item
  requests itself from a trio nursery, 16 at a time, and joins the answers; per item.
- **loop iteration**: an ensemble whose step runs ``L`` times (its condition always holds,
  the bound stops it), each output fed to the next, against a client that calls the model
  ``L`` times in a ``for`` loop; per iteration.

Every model is plain Python running inline and does almost nothing, so the times are the
runtime's own cost. The hand-written side pays a client request (``AsyncServer.infer``) per
model call; the declared side pays one for the ensemble and a step request per model call.
Answers are checked equal both ways.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import numpy as np
import trio
from _common import table

import orchestrion
from orchestrion.protocols import DynamicBatching
from orchestrion.testing import ensemble, model, step, tensor

ONE = (1,)
IN_FLIGHT = 16


def _models(items: int, iterations: int) -> list[orchestrion.Model]:
    gate = model(
        "gate",
        lambda X: {"OPEN": X > 0},
        [tensor("X", dims=ONE)],
        [tensor("OPEN", "BOOL", dims=ONE)],
        jit=False,
    )
    work = model(
        "work", lambda X: {"Y": X + 1}, [tensor("X", dims=ONE)], [tensor("Y", dims=ONE)], jit=False
    )
    spread = model(
        "spread",
        lambda X: {"ITEMS": np.repeat(X, items).reshape(items, 1)},
        [tensor("X", dims=ONE)],
        [tensor("ITEMS", dims=(-1, 1))],
        jit=False,
    )
    item = model(
        "item",
        lambda X: {"Y": X * 2},
        [tensor("X", dims=ONE)],
        [tensor("Y", dims=ONE)],
        jit=False,
        max_batch_size=IN_FLIGHT,
    )
    item = attrs.evolve(item, config=attrs.evolve(item.config, dynamic_batching=DynamicBatching()))
    again = model(
        "again",
        lambda X: {"Y": X + 1, "MORE": np.array([True])},
        [tensor("X", dims=ONE)],
        [tensor("Y", dims=ONE), tensor("MORE", "BOOL", dims=ONE)],
        jit=False,
    )
    skipping = ensemble(
        "skipping",
        [tensor("IN", dims=ONE)],
        [tensor("OUT", dims=ONE)],
        [step("gate", {"X": "IN"}, {"OPEN": "open"}), step("work", {"X": "IN"}, {"Y": "OUT"})],
        parameters={"step[1].when": "open"},
    )
    mapping = ensemble(
        "mapping",
        [tensor("IN", dims=ONE)],
        [tensor("OUT", dims=(-1, 1))],
        [
            step("spread", {"X": "IN"}, {"ITEMS": "items"}),
            step("item", {"X": "items"}, {"Y": "OUT"}),
        ],
        parameters={"step[1].map": "items", "step[1].max_items_in_flight": str(IN_FLIGHT)},
    )
    gate_only = ensemble(  # the reference: the skipping ensemble without its skipped step
        "gate_only",
        [tensor("IN", dims=ONE)],
        [tensor("OPEN", "BOOL", dims=ONE)],
        [step("gate", {"X": "IN"}, {"OPEN": "OPEN"})],
        parameters={"fusion": "off"},
    )
    looping = ensemble(
        "looping",
        [tensor("IN", dims=ONE)],
        [tensor("OUT", dims=ONE)],
        [step("again", {"X": "IN"}, {"Y": "OUT", "MORE": "more"})],
        parameters={
            "loop.repeat": json.dumps(
                {"steps": [0], "while": "more", "max_iterations": iterations, "next": {"OUT": "IN"}}
            )
        },
    )
    return [gate, work, spread, item, again, skipping, gate_only, mapping, looping]


def _pairs(
    server: orchestrion.AsyncServer, items: int, iterations: int
) -> list[tuple[str, int, Callable[[], Awaitable[Any]], Callable[[], Awaitable[Any]]]]:
    """(construct, units per request, declared, by hand) for each construct."""
    low = {"IN": np.array([-1.0], np.float32)}
    one = {"IN": np.array([1.0], np.float32)}

    async def skip_declared() -> Any:
        return (await server.infer("skipping", low)).outputs.get("OUT")

    async def skip_by_hand() -> Any:
        gate = await server.infer("gate", {"X": low["IN"]})
        if gate.outputs["OPEN"].all():
            return (await server.infer("work", {"X": low["IN"]})).outputs["Y"]
        return None

    async def gate_declared() -> Any:
        return (await server.infer("gate_only", low)).outputs["OPEN"]

    async def gate_by_hand() -> Any:
        return (await server.infer("gate", {"X": low["IN"]})).outputs["OPEN"]

    async def map_declared() -> Any:
        return (await server.infer("mapping", one)).outputs["OUT"]

    async def map_by_hand() -> Any:
        spread = (await server.infer("spread", {"X": one["IN"]})).outputs["ITEMS"]
        results: list[Any] = [None] * len(spread)
        limit = trio.Semaphore(IN_FLIGHT)

        async def send(index: int) -> None:
            try:
                answer = await server.infer("item", {"X": spread[index : index + 1]})
                results[index] = answer.outputs["Y"]
            finally:
                limit.release()

        async with trio.open_nursery() as nursery:
            for index in range(len(spread)):
                await limit.acquire()
                nursery.start_soon(send, index)
        return np.concatenate(results)

    async def loop_declared() -> Any:
        return (await server.infer("looping", one)).outputs["OUT"]

    async def loop_by_hand() -> Any:
        x = one["IN"]
        for _ in range(iterations):
            answer = await server.infer("again", {"X": x})
            x = answer.outputs["Y"]
            if not answer.outputs["MORE"].all():
                break
        return x

    return [
        ("skipped step", 1, skip_declared, skip_by_hand),
        ("(reference: the gate alone)", 1, gate_declared, gate_by_hand),
        ("map item", items, map_declared, map_by_hand),
        ("loop iteration", iterations, loop_declared, loop_by_hand),
    ]


async def _timed(call: Callable[[], Awaitable[Any]], requests: int) -> float:
    start = time.perf_counter()
    for _ in range(requests):
        await call()
    return time.perf_counter() - start


async def _measure(rounds: int, requests: int, items: int, iterations: int) -> list[list[str]]:
    rows = []
    async with orchestrion.open_server(models=_models(items, iterations)) as server:
        for name, units, declared, by_hand in _pairs(server, items, iterations):
            a, b = await declared(), await by_hand()
            assert (a is None and b is None) or np.array_equal(a, b), (name, a, b)
            for _ in range(20):  # warm both paths
                await declared()
                await by_hand()
            times: dict[str, list[float]] = {"declared": [], "by hand": []}
            for _ in range(rounds):
                times["declared"].append(await _timed(declared, requests))
                times["by hand"].append(await _timed(by_hand, requests))
            per = {k: statistics.median(v) / (requests * units) * 1e6 for k, v in times.items()}
            rows.append(
                [
                    name,
                    str(units),
                    f"{per['declared']:.1f}",
                    f"{per['by hand']:.1f}",
                    f"{per['declared'] / per['by hand']:.2f}",
                ]
            )
    return rows


def main() -> None:
    """Print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7, help="alternating rounds (median)")
    parser.add_argument("--requests", type=int, default=300, help="requests per round")
    parser.add_argument("--items", type=int, default=64, help="items per mapped request")
    parser.add_argument("--iterations", type=int, default=10, help="iterations per loop")
    args = parser.parse_args()
    rows = trio.run(_measure, args.rounds, args.requests, args.items, args.iterations)
    print(
        table(
            (
                "construct",
                "per request",
                "declared µs/unit",
                "hand-written trio µs/unit",
                "declared ÷ hand-written",
            ),
            rows,
        )
    )


if __name__ == "__main__":
    main()
