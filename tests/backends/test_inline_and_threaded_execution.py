"""Model instances: instance_group count, inline versus worker-thread execution."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import trio
import trio.testing

import orchestrion
from orchestrion.actors._instances import SWITCH_WINDOW
from orchestrion.testing import inside, model, tensor


def _sleepy(count: int) -> orchestrion.Model:
    async def execute(X):
        await trio.sleep(1)
        return {"Y": X}

    return model("sleepy", execute, [tensor("X")], [tensor("Y")], jit=False, count=count)


@pytest.mark.parametrize(("count", "elapsed"), [(1, 4.0), (2, 2.0), (4, 1.0)])
async def test_instance_count_sets_concurrency(
    autojump_clock: trio.testing.MockClock, count: int, elapsed: float
) -> None:
    """Four 1-second requests take 4 s on one instance, 2 s on two, 1 s on four."""
    async with orchestrion.open_server(models=[_sleepy(count)]) as server:
        start = trio.current_time()
        async with trio.open_nursery() as nursery:
            for _ in range(4):
                nursery.start_soon(server.infer, "sleepy", {"X": np.zeros(16, np.float32)})
        assert trio.current_time() - start == pytest.approx(elapsed)
        stats = server.model_statistics("sleepy")[0]
        assert stats.execution_count == 4
        assert stats.inference_stats.queue.count == 4


def _where(mode: str | None, seconds: float) -> tuple[orchestrion.Model, list[bool]]:
    on_main: list[bool] = []

    def execute(X):
        on_main.append(threading.current_thread() is threading.main_thread())
        time.sleep(seconds)
        return {"Y": X}

    parameters = {"execution": mode} if mode else {}  # {}: the default, "auto"
    return (
        model("m", execute, [tensor("X")], [tensor("Y")], jit=False, parameters=parameters),
        on_main,
    )


@pytest.mark.parametrize(("mode", "expected"), [("inline", True), ("thread", False)])
async def test_execution_mode_can_be_fixed(mode: str, expected: bool) -> None:
    """parameters.execution 'inline' runs on the event loop, 'thread' in a worker thread."""
    definition, on_main = _where(mode, 0.0)
    async with orchestrion.open_server(models=[definition]) as server:
        for _ in range(3):
            await server.infer("m", {"X": np.zeros(16, np.float32)})
    assert on_main == [expected] * 3


async def test_unmeasured_models_start_in_a_thread_and_fast_ones_come_inline() -> None:
    """A plain-Python model starts in a thread; three fast calls in a row bring it inline."""
    fast, fast_on_main = _where(None, 0.0)
    async with orchestrion.open_server(models=[fast]) as server:
        # A busy machine may make every call of a window slow (another thread holding the
        # GIL when the worker wants it back): keep calling until one window was fast, at
        # most 25 windows.
        for _ in range(25 * SWITCH_WINDOW):
            await server.infer("m", {"X": np.zeros(16, np.float32)})
            if fast_on_main[-1]:
                break
    assert fast_on_main[:3] == [False, False, False]
    assert fast_on_main[-1] is True


async def test_slow_models_move_to_a_thread_after_a_window_of_slow_calls() -> None:
    """An inline model taking milliseconds on every call leaves the event loop once a whole
    window of its calls was slow."""
    slow, slow_on_main = _where(None, 0.003)
    async with orchestrion.open_server(models=[slow]) as server:
        instance = inside(server).instances("m")[0]
        instance.inline, instance.window = True, 0  # as if it had been fast until now
        for _ in range(SWITCH_WINDOW + 3):
            await server.infer("m", {"X": np.zeros(16, np.float32)})
    assert slow_on_main == [True] * SWITCH_WINDOW + [False] * 3


async def test_a_fast_model_slowed_down_from_outside_stays_inline() -> None:
    """Calls of a fast model that are slow several times in a row, but not every time (a
    front end's thread holding the GIL, a garbage collection), keep it on the event loop.
    Under gRPC load this used to move the steps of fused ensembles into threads for good
    (three slow calls in a row were enough), and fusion with them."""
    on_main: list[bool] = []

    def execute(X):
        on_main.append(threading.current_thread() is threading.main_thread())
        if len(on_main) % SWITCH_WINDOW:  # slow, except once per window
            time.sleep(0.003)
        return {"Y": X}

    definition = model("m", execute, [tensor("X")], [tensor("Y")], jit=False)
    async with orchestrion.open_server(models=[definition]) as server:
        instance = inside(server).instances("m")[0]
        instance.inline, instance.window = True, 0
        for _ in range(3 * SWITCH_WINDOW):
            await server.infer("m", {"X": np.zeros(16, np.float32)})
    assert on_main == [True] * (3 * SWITCH_WINDOW)


async def test_a_slow_threaded_model_does_not_stall_other_requests() -> None:
    """While a threaded model computes, a fast model keeps answering on the event loop."""
    slow, _ = _where("thread", 0.5)
    fast = model("fast", lambda X: {"Y": X}, [tensor("X")], [tensor("Y")])
    async with orchestrion.open_server(models=[slow, fast]) as server:
        answered_during = 0
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.infer, "m", {"X": np.zeros(16, np.float32)})
            await trio.testing.wait_all_tasks_blocked()
            while server.model_statistics("m")[0].execution_count == 0:
                await server.infer("fast", {"X": np.zeros(16, np.float32)})
                answered_during += 1
        assert answered_during > 10


def test_bad_execution_mode_is_a_config_error() -> None:
    """An unknown parameters.execution value is reported at load."""
    definition, _ = _where("sometimes", 0.0)

    async def main() -> None:
        async with orchestrion.open_server(models=[definition]):
            pass

    with pytest.raises(orchestrion.ConfigError, match="parameter 'execution' must be one of"):
        trio.run(main)


async def test_compilation_for_new_shapes_happens_off_the_event_loop() -> None:
    """A first call with new input shapes (a JAX compilation) runs in a worker thread."""
    traced_on_main: list[bool] = []

    def execute(X):
        # Python code in a jitted function runs once per compilation, while tracing.
        traced_on_main.append(threading.current_thread() is threading.main_thread())
        return {"Y": X * 2}

    definition = model("any_length", execute, [tensor("X", dims=(-1,))], [tensor("Y", dims=(-1,))])
    async with orchestrion.open_server(models=[definition]) as server:
        assert traced_on_main == []  # -1 dims: nothing to compile at load
        for length in (3, 3, 5, 3, 5):
            out = await server.infer("any_length", {"X": np.ones(length, np.float32)})
            assert out.outputs["Y"].tolist() == [2.0] * length
    assert traced_on_main == [False, False]  # two shapes, each compiled once, in a thread


async def test_batched_models_compile_both_ends_of_the_batch_range_at_load() -> None:
    """Batch sizes 1 and max_batch_size are compiled before the model reports ready."""
    traces: list[tuple[int, ...]] = []

    def execute(X):
        traces.append(X.shape)
        return {"Y": X + 1}

    definition = model(
        "batched", execute, [tensor("X", dims=(4,))], [tensor("Y", dims=(4,))], max_batch_size=8
    )
    async with orchestrion.open_server(models=[definition]) as server:
        assert sorted(traces) == [(1, 4), (8, 4)]
        await server.infer("batched", {"X": np.zeros((8, 4), np.float32)})
        await server.infer("batched", {"X": np.zeros((1, 4), np.float32)})
        assert sorted(traces) == [(1, 4), (8, 4)]
