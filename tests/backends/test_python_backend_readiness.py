"""A python-backend model's own readiness check (``is_ready()``, python_backend's README), as
`AsyncServer.model_ready` (what the readiness endpoints answer) asks it: True, False, an
exception, an answer that is not a bool, ``async def``, an answer that comes late, and
concurrent askers sharing one call per instance."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import numpy as np
import pytest
import trio
import triton_python_backend_utils as pb_utils

import orchestrion
from orchestrion.backends import _triton_readiness
from orchestrion.protocols import InstanceGroup, InstanceKind
from orchestrion.testing import tensor, triton_model

X = [tensor("X", dims=(1,))]
Y = [tensor("Y", dims=(1,))]


def _echo(requests: list[Any]) -> list[Any]:
    return [
        pb_utils.InferenceResponse([pb_utils.Tensor("Y", r.inputs()[0].as_numpy())])
        for r in requests
    ]


def _with_readiness(answer: Any) -> type:
    class Checked:
        def is_ready(self) -> Any:
            if isinstance(answer, Exception):
                raise answer
            return answer

        def execute(self, requests: list[Any]) -> list[Any]:
            return _echo(requests)

    return Checked


@pytest.mark.parametrize(
    ("answer", "ready"),
    [
        (True, True),
        (False, False),
        (RuntimeError("no backend"), False),
        ("ready", False),
        (1, False),
    ],
    ids=["true", "false", "raises", "str", "int"],
)
async def test_is_ready_decides_model_readiness_and_the_model_serves_on(
    answer: Any, ready: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """Only a bool True is ready; whatever the answer, the model is loaded and answers
    requests (`is_model_ready`: loaded and serving)."""
    definition = triton_model("checked", _with_readiness(answer), X, Y)
    async with orchestrion.open_server(models=[definition]) as server:
        for _ in range(3):
            assert await server.model_ready("checked") is ready
        assert server.is_model_ready("checked")
        out = await server.infer("checked", {"X": np.ones(1, np.float32)})
        assert out.outputs["Y"].tolist() == [1.0]
    if isinstance(answer, Exception):
        assert "is_ready() raised: not ready: RuntimeError: no backend" in caplog.text
    elif not isinstance(answer, bool):
        assert "is_ready() must return a boolean value" in caplog.text


async def test_a_model_without_is_ready_is_ready_once_loaded() -> None:
    """No ``is_ready``: ready when loaded; an unknown model is not."""

    class Plain:
        def execute(self, requests: list[Any]) -> list[Any]:
            return _echo(requests)

    async with orchestrion.open_server(models=[triton_model("plain", Plain, X, Y)]) as server:
        assert await server.model_ready("plain")
        assert not await server.model_ready("nobody")


@pytest.mark.parametrize("execute_kind", ["sync", "async"])
async def test_an_async_is_ready_is_awaited(execute_kind: str) -> None:
    """``async def is_ready``: awaited on the model's asyncio loop (an ``async def
    execute``'s) or on a loop of its own."""
    loops: list[Any] = []

    class Awaiting:
        async def is_ready(self) -> bool:
            await asyncio.sleep(0.01)
            loops.append(asyncio.get_running_loop())
            return len(loops) < 2

    if execute_kind == "sync":
        Awaiting.execute = lambda self, requests: _echo(requests)  # type: ignore[attr-defined]
    else:

        async def execute(self: Any, requests: list[Any]) -> list[Any]:
            return _echo(requests)

        Awaiting.execute = execute  # type: ignore[attr-defined]
    async with orchestrion.open_server(models=[triton_model("aw", Awaiting, X, Y)]) as server:
        assert await server.model_ready("aw")
        assert not await server.model_ready("aw")
    assert len(loops) == 2
    if execute_kind == "async":
        assert loops[0] is loops[1]  # the model's own loop, both times


async def test_a_late_answer_is_not_ready_and_the_next_asker_gets_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An ``is_ready`` that outlasts the wait: not ready for that asker; the call runs on,
    and an asker that comes meanwhile waits for its answer instead of calling again."""
    monkeypatch.setattr(_triton_readiness, "READINESS_TIMEOUT", 0.3)
    calls: list[float] = []

    class Slow:
        def is_ready(self) -> bool:
            calls.append(time.monotonic())
            time.sleep(0.5)
            return True

        def execute(self, requests: list[Any]) -> list[Any]:
            return _echo(requests)

    async with orchestrion.open_server(models=[triton_model("slow", Slow, X, Y)]) as server:
        started = trio.current_time()
        assert not await server.model_ready("slow")  # gave up after 0.3 s
        assert 0.25 < trio.current_time() - started < 0.5
        assert await server.model_ready("slow")  # the same call's answer, at 0.5 s
        assert len(calls) == 1
        assert not await server.model_ready("slow")  # a new call, late again
        assert len(calls) == 2


async def test_concurrent_askers_share_one_call_per_instance() -> None:
    """Ten askers at once: one ``is_ready`` call on each of the two instances; all ten
    get its answer; the model answers requests meanwhile."""
    calls: list[int] = []
    lock = threading.Lock()
    release = threading.Event()

    class Counted:
        def is_ready(self) -> bool:
            with lock:
                calls.append(id(self))
            release.wait(5)
            return True

        def execute(self, requests: list[Any]) -> list[Any]:
            return _echo(requests)

    definition = triton_model(
        "counted",
        Counted,
        X,
        Y,
        instance_group=(InstanceGroup(count=2, kind=InstanceKind.KIND_CPU),),
    )
    answers: list[bool] = []
    async with orchestrion.open_server(models=[definition]) as server:

        async def ask() -> None:
            answers.append(await server.model_ready("counted"))

        async with trio.open_nursery() as nursery:
            for _ in range(10):
                nursery.start_soon(ask)
            await trio.sleep(0.2)
            out = await server.infer("counted", {"X": np.ones(1, np.float32)})
            assert out.outputs["Y"].tolist() == [1.0]
            release.set()
    assert answers == [True] * 10
    assert len(calls) == 2
    assert len(set(calls)) == 2  # one on each instance
