"""Decoupled steps inside ensembles: one response per iteration, chains, fan-out, nesting,
errors mid-stream, leaving early, and backpressure bounded by max_inflight_requests."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import trio
import trio.testing

import orchestrion
from orchestrion.protocols import InferenceError, InvalidRequestError
from orchestrion.testing import assert_idle, decoupled, ensemble, model, step, tensor
from support.decoupled import single

ONE = (1,)


def repeat(X: Any) -> Any:
    """Value v: v responses, each v."""
    for _ in range(int(X[0])):
        yield {"Y": X}


def plain(name: str, fn: Any) -> orchestrion.Model:
    return model(name, fn, [tensor("X", dims=ONE)], [tensor("Y", dims=ONE)], jit=False)


async def collect(
    server: orchestrion.AsyncServer, name: str, v: float, out: str = "OUT"
) -> list[Any]:
    async with contextlib.aclosing(server.stream_infer(name, {"IN": single(v)})) as responses:
        return [
            {k: float(a[0]) for k, a in r.outputs.items()}
            if out == "*"
            else float(r.outputs[out][0])
            async for r in responses
        ]


def chain_of(first: str, second: str, limit: int = 0) -> orchestrion.Model:
    return ensemble(
        "pipe",
        [tensor("IN", dims=ONE)],
        [tensor("OUT", dims=ONE)],
        [step(first, {"X": "IN"}, {"Y": "mid"}), step(second, {"X": "mid"}, {"Y": "OUT"})],
        max_inflight_requests=limit,
    )


async def test_producer_then_consumer() -> None:
    """Each response of the decoupled step runs the next step once and is streamed."""
    models = [
        decoupled("rep", repeat),
        plain("inc", lambda X: {"Y": X + 1}),
        chain_of("rep", "inc"),
    ]
    async with orchestrion.open_server(models=models) as server:
        assert await collect(server, "pipe", 3) == [4.0, 4.0, 4.0]
        assert await collect(server, "pipe", 0) == []
        with pytest.raises(InvalidRequestError, match="'pipe' is decoupled.*stream_infer"):
            await server.infer("pipe", {"IN": single(3)})
        inc = server.model_statistics("inc")[0]
        pipe = server.model_statistics("pipe")[0]
    assert inc.execution_count == 3
    assert pipe.inference_stats.success.count == 2


async def test_fan_out_after_a_producer() -> None:
    """Two consumers of one producer run once per iteration; each response has both."""
    models = [
        decoupled("rep", repeat),
        plain("inc", lambda X: {"Y": X + 1}),
        plain("neg", lambda X: {"Y": -X}),
        ensemble(
            "fan",
            [tensor("IN", dims=ONE)],
            [tensor("P", dims=ONE), tensor("N", dims=ONE)],
            [
                step("rep", {"X": "IN"}, {"Y": "mid"}),
                step("inc", {"X": "mid"}, {"Y": "P"}),
                step("neg", {"X": "mid"}, {"Y": "N"}),
            ],
        ),
    ]
    async with orchestrion.open_server(models=models) as server:
        got = await collect(server, "fan", 2, out="*")
    assert got == [{"P": 3.0, "N": -2.0}, {"P": 3.0, "N": -2.0}]


async def test_nested_decoupled_steps() -> None:
    """rep after rep: value v gives v iterations of v responses each (v * v in all)."""
    models = [
        decoupled("rep", repeat),
        ensemble(
            "nested",
            [tensor("IN", dims=ONE)],
            [tensor("OUT", dims=ONE)],
            [step("rep", {"X": "IN"}, {"Y": "a"}), step("rep", {"X": "a"}, {"Y": "OUT"})],
        ),
    ]
    async with orchestrion.open_server(models=models) as server:
        assert await collect(server, "nested", 3) == [3.0] * 9


async def test_an_error_mid_stream_comes_once_after_earlier_iterations() -> None:
    """The consumer fails on the third iteration: two responses, then one prefixed error."""
    seen: list[float] = []

    def fragile(X: Any) -> dict[str, Any]:
        seen.append(float(X[0]))
        if len(seen) == 3:
            raise RuntimeError("third time")
        return {"Y": X}

    def count_up(X: Any) -> Any:
        for i in range(int(X[0])):
            yield {"Y": X * 0 + i}

    models = [decoupled("up", count_up), plain("fragile", fragile), chain_of("up", "fragile")]
    got: list[float] = []
    async with orchestrion.open_server(models=models) as server:
        with pytest.raises(InferenceError, match=r"in ensemble 'pipe', step\[1\]: .*third time"):
            await drain_into(server, got)
        assert await collect(server, "pipe", 2) == [0.0, 1.0]  # still serving
    assert got == [0.0, 1.0]


async def drain_into(server: orchestrion.AsyncServer, got: list[float]) -> None:
    async with contextlib.aclosing(server.stream_infer("pipe", {"IN": single(5)})) as responses:
        async for response in responses:
            got.append(float(response.outputs["OUT"][0]))


async def test_a_slow_consumer_suspends_the_producer() -> None:
    """Backpressure: the producer never runs more than one iteration ahead of its consumer,
    and leaving early stops it; nothing leaks for the next requests."""
    produced: list[int] = []

    async def fast(X: Any) -> Any:
        for i in range(1000):
            produced.append(i)
            yield {"Y": X * 0 + i}

    async def slow(X: Any) -> dict[str, Any]:
        await trio.sleep(0.001)
        return {"Y": X}

    models = [
        decoupled("fast", fast),
        model("slow", slow, [tensor("X", dims=ONE)], [tensor("Y", dims=ONE)], jit=False),
        chain_of("fast", "slow", limit=1),
    ]
    async with orchestrion.open_server(models=models) as server:
        async with contextlib.aclosing(server.stream_infer("pipe", {"IN": single(1)})) as stream:
            taken = 0
            async for _ in stream:
                taken += 1
                assert len(produced) <= taken + 1
                if taken == 20:
                    break
        await trio.testing.wait_all_tasks_blocked()
        assert len(produced) <= 21
        for _ in range(16):  # sequential requests: no slot leaks
            produced.clear()
            async with contextlib.aclosing(server.stream_infer("pipe", {"IN": single(1)})) as s:
                async for _ in s:
                    break
        assert_idle(server, "pipe")


@pytest.mark.parametrize("limit", [1, 4, 0])
async def test_concurrent_streams_respect_max_inflight_requests(limit: int) -> None:
    """16 concurrent streams each get every response, and no step ever has more than
    max_inflight_requests requests in flight (without a limit, it does)."""
    in_flight = 0
    peak = 0

    async def tracked(X: Any) -> dict[str, Any]:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        # Long enough that, without a limit, the 16 streams' first requests overlap even on a
        # loaded machine (a stall only makes more of them overlap).
        await trio.sleep(0.02)
        in_flight -= 1
        return {"Y": X + 1}

    models = [
        decoupled("rep", repeat),
        model(
            "tracked", tracked, [tensor("X", dims=ONE)], [tensor("Y", dims=ONE)], jit=False, count=8
        ),
        chain_of("rep", "tracked", limit=limit),
    ]
    results: dict[int, list[float]] = {}

    async def one(server: orchestrion.AsyncServer, i: int) -> None:
        results[i] = await collect(server, "pipe", 1 + i % 5)

    async with orchestrion.open_server(models=models) as server:
        async with trio.open_nursery() as nursery:
            for i in range(16):
                nursery.start_soon(one, server, i)
        assert_idle(server, "pipe")
    for i in range(16):
        v = 1 + i % 5
        assert results[i] == [v + 1.0] * v
    if limit:
        assert peak <= limit
    else:
        assert peak > 4  # unbounded: the 8 instances overlap the 16 streams


async def test_constants_and_step_parameters_in_a_streaming_ensemble() -> None:
    """A streaming ensemble takes constants and step parameters (not conditions, joins,
    loops or maps): each iteration's step gets the constant and the step's parameters."""
    seen: list[dict[str, Any]] = []

    def scale(X: Any, W: Any, request: orchestrion.InferRequest) -> dict[str, Any]:
        seen.append(dict(request.parameters))
        return {"Y": X * W}

    models = [
        decoupled("rep", repeat),
        model(
            "scale",
            scale,
            [tensor("X", dims=ONE), tensor("W", dims=ONE)],
            [tensor("Y", dims=ONE)],
            jit=False,
        ),
        ensemble(
            "pipe",
            [tensor("IN", dims=ONE)],
            [tensor("OUT", dims=ONE)],
            [
                step("rep", {"X": "IN"}, {"Y": "mid"}),
                step("scale", {"X": "mid", "W": "w"}, {"Y": "OUT"}),
            ],
            parameters={
                "constant.w": '{"data_type": "TYPE_FP32", "dims": [1], "value": [10]}',
                "step[1].parameters": '{"mode": "stream"}',
            },
        ),
    ]
    async with orchestrion.open_server(models=models) as server:
        assert await collect(server, "pipe", 2) == [20.0, 20.0]
    assert seen == [{"mode": "stream"}, {"mode": "stream"}]
