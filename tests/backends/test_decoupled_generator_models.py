"""Decoupled models: zero, one or many responses per request through `stream_infer`, errors
mid-stream, the caller stopping early, backpressure on the generator, and the contract."""

from __future__ import annotations

import contextlib
from typing import Any

import attrs
import pytest
import trio
import trio.testing

import orchestrion
from orchestrion.backends import check_model
from orchestrion.protocols import (
    InferenceError,
    InvalidRequestError,
)
from orchestrion.testing import decoupled, model, tensor
from support.decoupled import arepeat, repeat, single


async def drain_into(
    server: orchestrion.AsyncServer, name: str, v: float, got: list[float]
) -> None:
    async with contextlib.aclosing(server.stream_infer(name, {"X": single(v)})) as responses:
        async for response in responses:
            got.append(float(response.outputs["Y"][0]))


async def collect(server: orchestrion.AsyncServer, name: str, v: float) -> list[float]:
    async with contextlib.aclosing(server.stream_infer(name, {"X": single(v)})) as responses:
        return [float(r.outputs["Y"][0]) async for r in responses]


@pytest.mark.parametrize("execute", [repeat, arepeat], ids=["generator", "async generator"])
@pytest.mark.parametrize("count", [0, 1, 4])
async def test_zero_one_and_many_responses(execute: Any, count: int) -> None:
    """Each yield is one response, in order; zero yields is an empty stream."""
    async with orchestrion.open_server(models=[decoupled("rep", execute)]) as server:
        got = await collect(server, "rep", count)
        stats = server.model_statistics("rep")[0]
    assert got == [count * i for i in range(count)]
    assert stats.inference_stats.success.count == 1
    assert stats.execution_count == 1


async def test_plain_infer_on_a_decoupled_model_is_a_clear_error() -> None:
    """infer on a decoupled model says to use stream_infer, and counts as REJECTED."""
    async with orchestrion.open_server(models=[decoupled("rep", repeat)]) as server:
        with pytest.raises(InvalidRequestError, match="decoupled.*call stream_infer"):
            await server.infer("rep", {"X": single(2)})
        stats = server.model_statistics("rep")[0]
    assert stats.failures_by_reason == {"REJECTED": 1}


async def test_a_model_that_is_not_decoupled_streams_one_response() -> None:
    """stream_infer on an ordinary model gives its single response."""
    m = model(
        "double",
        lambda X: {"Y": X * 2},
        [tensor("X", dims=(1,))],
        [tensor("Y", dims=(1,))],
        jit=False,
    )
    async with orchestrion.open_server(models=[m]) as server:
        assert await collect(server, "double", 3) == [6.0]


async def test_an_error_mid_stream_ends_it_with_exactly_one_error() -> None:
    """Responses before the failure arrive, then one InferenceError; the model keeps serving."""

    def fails_after_two(X: Any) -> Any:
        yield {"Y": X}
        yield {"Y": X * 2}
        raise RuntimeError("broke mid-stream")

    got: list[float] = []
    async with orchestrion.open_server(models=[decoupled("f", fails_after_two)]) as server:
        with pytest.raises(InferenceError, match="broke mid-stream"):
            await drain_into(server, "f", 1, got)
        again: list[float] = []
        with pytest.raises(InferenceError):
            await drain_into(server, "f", 5, again)
        stats = server.model_statistics("f")[0]
    assert got == [1.0, 2.0]
    assert again == [5.0, 10.0]
    assert stats.failures_by_reason == {"BACKEND": 2}


async def test_a_bad_response_is_an_error() -> None:
    """A yielded response that does not match the config fails the stream clearly."""

    def bad(X: Any) -> Any:
        yield {"Y": X}
        yield {"WRONG": X}

    async with orchestrion.open_server(models=[decoupled("bad", bad)]) as server:
        with pytest.raises(InferenceError, match="bad result"):
            await collect(server, "bad", 1)


async def test_the_generator_runs_at_most_one_response_ahead() -> None:
    """Backpressure: the model's generator waits for the caller to take each response."""
    produced: list[int] = []

    async def counting(X: Any) -> Any:
        for i in range(100):
            produced.append(i)
            yield {"Y": X * i}

    async with orchestrion.open_server(models=[decoupled("many", counting)]) as server:
        async with contextlib.aclosing(server.stream_infer("many", {"X": single(1)})) as stream:
            taken = 0
            async for _ in stream:
                taken += 1
                await trio.testing.wait_all_tasks_blocked()
                assert len(produced) <= taken + 1
                if taken == 5:
                    break
        await trio.testing.wait_all_tasks_blocked()
        assert len(produced) <= 7  # stopping early stopped the generator
        assert await collect(server, "many", 0) == [0.0] * 100  # the instance is free again


async def test_leaving_early_frees_the_instance_for_a_blocking_generator() -> None:
    """A synchronous generator whose caller left stops at its next response."""
    async with orchestrion.open_server(models=[decoupled("rep", repeat)]) as server:
        async with contextlib.aclosing(server.stream_infer("rep", {"X": single(50)})) as stream:
            async for _ in stream:
                break
        assert await collect(server, "rep", 2) == [0.0, 2.0]


def test_blocking_server_iterates_responses() -> None:
    """Server.stream_infer is a plain iterator of responses."""
    with orchestrion.Server(models=[decoupled("rep", repeat)]) as server:
        got = [float(r.outputs["Y"][0]) for r in server.stream_infer("rep", {"X": single(3)})]
        first = next(iter(server.stream_infer("rep", {"X": single(4)})))
    assert got == [0.0, 3.0, 6.0]
    assert float(first.outputs["Y"][0]) == 0.0


def test_contract() -> None:
    """A decoupled execute must be an unjitted generator, and a generator needs decoupled."""
    not_generator = decoupled("a", lambda X: {"Y": X})
    assert any("yield each response" in e for e in check_model(not_generator))
    undeclared = model("b", repeat, [tensor("X", dims=(1,))], [tensor("Y", dims=(1,))], jit=False)
    assert any("decoupled: true" in e for e in check_model(undeclared))
    plain = decoupled("c", repeat)
    jitted = attrs.evolve(plain, code=attrs.evolve(plain.code, jit=True))
    assert any("cannot compile a generator" in e for e in check_model(jitted))
