"""`orchestrion.aio`: the server from asyncio code. Requests are awaited on the caller's own
loop (the loop keeps running other tasks meanwhile), errors arrive as themselves, a cancelled
task cancels its request, streams stop when their reader stops, and leaving the block stops
the server's thread. Each test runs its own ``asyncio.run`` (pytest runs tests under trio)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio

import orchestrion
import orchestrion.aio
from orchestrion.testing import decoupled, model, tensor

REPOSITORY = Path(__file__).resolve().parent / "triton_models"
X = np.arange(16, dtype=np.float32)


def _run(main: Callable[[], Awaitable[Any]]) -> Any:
    """``asyncio.run(main())``, bounded: a hang fails the test instead of the suite."""

    async def bounded() -> Any:
        async with asyncio.timeout(60):
            return await main()

    return asyncio.run(bounded())


def test_infer_answers_on_the_callers_loop_without_blocking_it() -> None:
    """infer is awaited on asyncio's loop; a ticker task keeps ticking while a slow model
    runs, and no thread is left behind after the block."""
    before = threading.active_count()

    async def slow(X: Any) -> dict[str, Any]:
        await trio.sleep(0.3)
        return {"Y": X * 2}

    async def main() -> tuple[list[float], Any]:
        ticks: list[float] = []

        async def ticker() -> None:
            while True:
                ticks.append(time.monotonic())
                await asyncio.sleep(0.01)

        definition = model("slow", slow, [tensor("X")], [tensor("Y")], jit=False)
        async with orchestrion.aio.open_server(models=[definition]) as server:
            task = asyncio.create_task(ticker())
            response = await server.infer("slow", {"X": X})
            task.cancel()
        return ticks, response

    ticks, response = _run(main)
    assert response.outputs["Y"].tolist() == (X * 2).tolist()
    assert len(ticks) >= 10  # the loop ran other tasks while the request was in flight
    assert threading.active_count() <= before + 1  # trio's idle worker cache at most


def test_errors_arrive_as_themselves() -> None:
    """An unknown model, bad inputs and a failing model raise orchestrion's own errors."""

    def broken(X: Any) -> dict[str, Any]:
        raise RuntimeError("no")

    async def main() -> list[type[BaseException]]:
        seen: list[type[BaseException]] = []
        definitions = [model("broken", broken, [tensor("X")], [tensor("Y")], jit=False)]
        async with orchestrion.aio.open_server(models=definitions) as server:
            for call in (
                server.infer("nope", {"X": X}),
                server.infer("broken", {"X": X.astype(np.int32)}),
                server.infer("broken", {"X": X}),
            ):
                try:
                    await call
                except orchestrion.OrchestrionError as exc:
                    seen.append(type(exc))
        return seen

    assert _run(main) == [
        orchestrion.ModelNotFoundError,
        orchestrion.InvalidRequestError,
        orchestrion.InferenceError,
    ]


def test_cancelling_the_task_cancels_the_request() -> None:
    """asyncio.wait_for around a request of a model that waits: the model's trio code is
    cancelled (it sees trio.Cancelled), and the server answers the next request."""
    cancelled = threading.Event()

    async def waits(X: Any) -> dict[str, Any]:
        try:
            await trio.sleep(30)
        except trio.Cancelled:
            cancelled.set()
            raise
        return {"Y": X}

    async def main() -> Any:
        definitions = [
            model("waits", waits, [tensor("X")], [tensor("Y")], jit=False),
            model("fast", lambda X: {"Y": X + 1}, [tensor("X")], [tensor("Y")]),
        ]
        async with orchestrion.aio.open_server(models=definitions) as server:
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(server.infer("waits", {"X": X}), 0.2)
            await asyncio.to_thread(cancelled.wait, 10)
            stats = await server.model_statistics("waits")
            return stats[0].pending_request_count, await server.infer("fast", {"X": X})

    pending, response = _run(main)
    assert cancelled.is_set()
    assert pending == 0
    assert response.outputs["Y"].tolist() == (X + 1).tolist()


def test_a_stream_stops_when_its_reader_stops() -> None:
    """stream_infer yields a decoupled model's responses; leaving after two stops the
    model's generator (it sees GeneratorExit) with nothing buffered."""
    produced: list[int] = []
    closed = threading.Event()

    def count(X: Any) -> Any:
        try:
            for i in range(1000):
                produced.append(i)
                yield {"Y": np.array([i], np.float32)}
        finally:
            closed.set()

    async def main() -> list[float]:
        got: list[float] = []
        async with orchestrion.aio.open_server(models=[decoupled("count", count)]) as server:
            responses = server.stream_infer("count", {"X": np.ones(1, np.float32)})
            async with contextlib.aclosing(responses):
                async for response in responses:
                    got.append(float(response.outputs["Y"][0]))
                    if len(got) == 2:
                        break
            await asyncio.to_thread(closed.wait, 10)
        return got

    assert _run(main) == [0.0, 1.0]
    assert closed.is_set()
    assert len(produced) <= 3


def test_python_backend_models_and_metadata_through_the_asyncio_api() -> None:
    """A repository of Triton python models, and the metadata calls, from asyncio."""

    async def main() -> tuple[Any, list[str], bool]:
        async with orchestrion.aio.open_server(
            model_repository=REPOSITORY, load_models=["add_sub"]
        ) as server:
            a = np.ones(4, np.float32)
            out = await server.infer("add_sub", {"INPUT0": a, "INPUT1": a})
            return out, await server.model_names(), await server.is_model_ready("add_sub")

    out, names, ready = _run(main)
    assert out.outputs["OUTPUT0"].tolist() == [2, 2, 2, 2]
    assert names == ["add_sub"]
    assert ready


def test_a_load_error_leaves_open_server_as_itself() -> None:
    """A broken repository: the ConfigError from the server's thread is raised in asyncio,
    and the thread is gone."""

    async def main() -> None:
        async with orchestrion.aio.open_server(model_repository="/nonexistent/repository"):
            pass

    with pytest.raises(orchestrion.ConfigError, match="does not exist"):
        _run(main)


def test_outside_asyncio_open_server_says_what_to_use() -> None:
    """Called from trio, orchestrion.aio.open_server points to orchestrion.open_server."""

    async def main() -> None:
        async with orchestrion.aio.open_server():
            pass

    with pytest.raises(RuntimeError, match="in trio use orchestrion.open_server"):
        trio.run(main)
