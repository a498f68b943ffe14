"""Property: any valid ensemble computes what evaluating its graph by hand computes.

Hypothesis draws random DAGs of small models (chains, fan-out, fan-in, jitted or plain,
synchronous or async), a random ``max_inflight_requests``, a random subset of requested outputs
and several concurrent requests; every answer must equal a direct evaluation of the graph,
pruned steps must not run, and every step must be idle afterwards.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import trio
import trio.lowlevel
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import orchestrion
from orchestrion.testing import ensemble, model, step, tensor

DIMS = (4,)


def _make_model(index: int, two_inputs: bool, kind: str) -> orchestrion.Model:
    c = float(index + 1)

    def compute(A: Any, B: Any = None) -> dict[str, Any]:
        base = A * c if B is None else A * c + B
        return {"P": base, "Q": A - c}

    inputs = [tensor("A", dims=DIMS)] + ([tensor("B", dims=DIMS)] if two_inputs else [])
    outputs = [tensor("P", dims=DIMS), tensor("Q", dims=DIMS)]
    if kind == "async":

        async def execute(A: Any, B: Any = None) -> dict[str, Any]:
            await trio.lowlevel.checkpoint()
            return compute(A, B)

        return model(f"m{index}", execute, inputs, outputs, jit=False, count=2)
    if two_inputs:
        return model(f"m{index}", lambda A, B: compute(A, B), inputs, outputs, jit=kind == "jit")
    return model(f"m{index}", lambda A: compute(A), inputs, outputs, jit=kind == "jit")


@st.composite
def graphs(draw: st.DrawFn) -> dict[str, Any]:
    """A random valid ensemble: steps with their wiring, and a reference evaluator."""
    n_steps = draw(st.integers(1, 5))
    available = ["IN"]
    steps = []
    for i in range(n_steps):
        a = draw(st.sampled_from(available))
        two = draw(st.booleans()) and len(available) > 1
        b = draw(st.sampled_from([t for t in available if t != a])) if two else None
        kind = draw(st.sampled_from(["jit", "plain", "async"]))
        outs = {"P": f"p{i}"}
        if draw(st.booleans()):
            outs["Q"] = f"q{i}"
        steps.append({"index": i, "a": a, "b": b, "kind": kind, "outs": outs})
        available.extend(outs.values())
    consumed = {s["a"] for s in steps} | {s["b"] for s in steps if s["b"]}
    produced = [t for s in steps for t in s["outs"].values()]
    outputs = [t for t in produced if t not in consumed]
    requested = draw(st.none() | st.sets(st.sampled_from(outputs), min_size=1))
    return {
        "steps": steps,
        "outputs": outputs,
        "requested": requested,
        "limit": draw(st.sampled_from([0, 1, 2, 5])),
        "clients": draw(st.integers(1, 6)),
    }


def _evaluate(graph: dict[str, Any], x: np.ndarray) -> dict[str, np.ndarray]:
    values = {"IN": x}
    for s in graph["steps"]:
        c = float(s["index"] + 1)
        a = values[s["a"]]
        p = a * c + values[s["b"]] if s["b"] else a * c
        results = {"P": p, "Q": a - c}
        for output, tensor_name in s["outs"].items():
            values[tensor_name] = results[output]
    return values


def _needed(graph: dict[str, Any], requested: set[str]) -> set[int]:
    producer = {t: s["index"] for s in graph["steps"] for t in s["outs"].values()}
    needed: set[int] = set()
    todo = [producer[t] for t in requested]
    while todo:
        i = todo.pop()
        if i in needed:
            continue
        needed.add(i)
        s = graph["steps"][i]
        todo.extend(producer[t] for t in (s["a"], s["b"]) if t in producer)
    return needed


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graph=graphs())
def test_random_ensembles_match_direct_evaluation(graph: dict[str, Any]) -> None:
    """Random DAG ensembles answer exactly what evaluating the graph directly gives."""
    models = [_make_model(s["index"], s["b"] is not None, s["kind"]) for s in graph["steps"]]
    wiring = [
        step(
            f"m{s['index']}",
            {"A": s["a"], **({"B": s["b"]} if s["b"] else {})},
            s["outs"],
        )
        for s in graph["steps"]
    ]
    models.append(
        ensemble(
            "random",
            [tensor("IN", dims=DIMS)],
            [tensor(t, dims=DIMS) for t in graph["outputs"]],
            wiring,
            max_inflight_requests=graph["limit"],
        )
    )
    requested = graph["requested"]
    expected_keys = set(requested) if requested else set(graph["outputs"])

    async def main() -> None:
        async with orchestrion.open_server(models=models) as server:
            answers: dict[int, Any] = {}

            async def client(i: int) -> None:
                x = np.arange(4, dtype=np.float32) + i
                response = await server.infer(
                    "random",
                    {"IN": x},
                    outputs=sorted(requested) if requested else None,
                    request_id=str(i),
                )
                answers[i] = (x, response)

            async with trio.open_nursery() as nursery:
                for i in range(graph["clients"]):
                    nursery.start_soon(client, i)
            await trio.testing.wait_all_tasks_blocked()
            for i, (x, response) in answers.items():
                assert response.request_id == str(i)
                assert set(response.outputs) == expected_keys
                reference = _evaluate(graph, x)
                for name, value in response.outputs.items():
                    np.testing.assert_allclose(value, reference[name], rtol=1e-6)
            needed = _needed(graph, expected_keys)
            for s in graph["steps"]:
                runs = server.model_statistics(f"m{s['index']}")[0].inference_stats.success.count
                assert runs == (graph["clients"] if s["index"] in needed else 0)
            for s in server.step_statistics("random"):
                assert (s.in_flight, s.queued) == (0, 0)

    trio.run(main)
