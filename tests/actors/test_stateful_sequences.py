"""Stateful models (sequence_batching): per-sequence state, start and end flags, idle
release, errors, ensembles, and the model.py contract."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest
import trio
import trio.testing

import orchestrion
from orchestrion.protocols import (
    ConfigError,
    InferenceError,
    InvalidRequestError,
    SequenceBatching,
)
from orchestrion.testing import ensemble, model, step, tensor

X = np.ones(2, np.float32)


def accumulate(state: Any, X: Any) -> tuple[dict[str, Any], Any]:
    total = state + X
    return {"Y": total}, total


def stateful(
    name: str = "acc", execute: Any = accumulate, jit: bool = False, idle_us: int = 0
) -> orchestrion.Model:
    m = model(name, execute, [tensor("X", dims=(2,))], [tensor("Y", dims=(2,))], jit=jit)
    config = attrs.evolve(
        m.config, sequence_batching=SequenceBatching(max_sequence_idle_microseconds=idle_us)
    )
    return attrs.evolve(m, config=config, initial_state=lambda c: np.zeros(2, np.float32))


@pytest.mark.parametrize("jit", [False, True])
async def test_a_sequence_carries_its_state(jit: bool) -> None:
    """start / - / end: the state accumulates, and responses carry the sequence flags."""
    async with orchestrion.open_server(models=[stateful(jit=jit)]) as server:
        first = await server.infer("acc", {"X": X}, sequence_id=7, sequence_start=True)
        middle = await server.infer("acc", {"X": 2 * X}, sequence_id=7)
        last = await server.infer("acc", {"X": 3 * X}, sequence_id=7, sequence_end=True)
        with pytest.raises(InvalidRequestError, match="sequence 7 is not active"):
            await server.infer("acc", {"X": X}, sequence_id=7)  # ended: released
    assert [r.outputs["Y"].tolist() for r in (first, middle, last)] == [[1, 1], [3, 3], [6, 6]]
    assert first.parameters == {"sequence_id": 7, "sequence_start": True, "sequence_end": False}
    assert last.parameters == {"sequence_id": 7, "sequence_start": False, "sequence_end": True}


async def test_interleaved_sequences_keep_separate_state() -> None:
    """Two sequences (an int and a string correlation id) interleaved never mix."""
    async with orchestrion.open_server(models=[stateful()]) as server:
        await server.infer("acc", {"X": X}, sequence_id=1, sequence_start=True)
        await server.infer("acc", {"X": 10 * X}, sequence_id="b", sequence_start=True)
        one = await server.infer("acc", {"X": X}, sequence_id=1)
        two = await server.infer("acc", {"X": 10 * X}, sequence_id="b")
        restarted = await server.infer("acc", {"X": X}, sequence_id=1, sequence_start=True)
    assert one.outputs["Y"].tolist() == [2, 2]
    assert two.outputs["Y"].tolist() == [20, 20]
    assert restarted.outputs["Y"].tolist() == [1, 1]  # a new start begins afresh


async def test_concurrent_requests_of_one_sequence_run_in_order() -> None:
    """Requests of one sequence sent at once run one at a time, in arrival order."""
    seen: list[float] = []

    async def slow(state: Any, X: Any) -> tuple[dict[str, Any], Any]:
        await trio.sleep(0.01 * (5 - float(X[0])))  # later requests would finish first
        seen.append(float(X[0]))
        return {"Y": state + X}, state + X

    m = stateful(execute=slow)
    m = attrs.evolve(
        m,
        config=attrs.evolve(
            m.config, instance_group=(attrs.evolve(m.config.instance_group[0], count=4),)
        ),
    )
    async with orchestrion.open_server(models=[m]) as server:
        await server.infer("acc", {"X": 0 * X}, sequence_id=3, sequence_start=True)
        async with trio.open_nursery() as nursery:
            for value in (1, 2, 3, 4):
                nursery.start_soon(
                    functools.partial(server.infer, sequence_id=3), "acc", {"X": value * X}
                )
                await trio.testing.wait_all_tasks_blocked()
        end = await server.infer("acc", {"X": 0 * X}, sequence_id=3, sequence_end=True)
    assert seen == [0.0, 1.0, 2.0, 3.0, 4.0, 0.0]
    assert end.outputs["Y"].tolist() == [10, 10]


async def test_missing_or_unknown_sequence_ids_are_clear_errors() -> None:
    """No correlation id, or one never started: the caller's error, naming the model."""
    async with orchestrion.open_server(models=[stateful()]) as server:
        with pytest.raises(InvalidRequestError, match="model 'acc' is stateful.*sequence_id"):
            await server.infer("acc", {"X": X})
        with pytest.raises(InvalidRequestError, match="sequence 42 is not active"):
            await server.infer("acc", {"X": X}, sequence_id=42)
        stats = server.model_statistics("acc")[0]
    assert stats.failures_by_reason == {"REJECTED": 2}


async def test_a_failure_keeps_the_state() -> None:
    """A request whose execute raises fails alone; the sequence goes on from its state."""

    def fragile(state: Any, X: Any) -> tuple[dict[str, Any], Any]:
        if X[0] < 0:
            raise RuntimeError("negative")
        return {"Y": state + X}, state + X

    async with orchestrion.open_server(models=[stateful(execute=fragile)]) as server:
        await server.infer("acc", {"X": X}, sequence_id=5, sequence_start=True)
        with pytest.raises(InferenceError, match="negative"):
            await server.infer("acc", {"X": -X}, sequence_id=5)
        after = await server.infer("acc", {"X": X}, sequence_id=5)
    assert after.outputs["Y"].tolist() == [2, 2]


async def test_idle_sequences_are_released(autojump_clock: trio.testing.MockClock) -> None:
    """A sequence idle past max_sequence_idle_microseconds is released."""
    async with orchestrion.open_server(models=[stateful(idle_us=500_000)]) as server:
        await server.infer("acc", {"X": X}, sequence_id=9, sequence_start=True)
        await trio.sleep(0.3)
        kept = await server.infer("acc", {"X": X}, sequence_id=9)  # still active
        await trio.sleep(2)
        with pytest.raises(InvalidRequestError, match="released after 0.5 s idle|not active"):
            await server.infer("acc", {"X": X}, sequence_id=9)
    assert kept.outputs["Y"].tolist() == [2, 2]


async def test_a_stateful_model_inside_an_ensemble() -> None:
    """The ensemble forwards the correlation id; without one the error names the model."""
    models = [
        stateful(),
        model(
            "double",
            lambda X: {"Y": X * 2},
            [tensor("X", dims=(2,))],
            [tensor("Y", dims=(2,))],
            jit=False,
        ),
        ensemble(
            "pipe",
            [tensor("IN", dims=(2,))],
            [tensor("OUT", dims=(2,))],
            [step("double", {"X": "IN"}, {"Y": "mid"}), step("acc", {"X": "mid"}, {"Y": "OUT"})],
        ),
    ]
    async with orchestrion.open_server(models=models) as server:
        first = await server.infer("pipe", {"IN": X}, sequence_id=11, sequence_start=True)
        second = await server.infer("pipe", {"IN": X}, sequence_id=11, sequence_end=True)
        with pytest.raises(InferenceError, match="model 'acc' is stateful"):
            await server.infer("pipe", {"IN": X})
    assert first.outputs["OUT"].tolist() == [2, 2]
    assert second.outputs["OUT"].tolist() == [4, 4]


def test_contract_errors() -> None:
    """A stateful execute must take `state`; initial_state without sequence_batching is wrong."""
    from orchestrion.backends import check_model

    no_state = stateful(execute=lambda X: ({"Y": X}, None))
    assert any("receives its sequence's state" in e for e in check_model(no_state))
    plain = model("p", lambda X: {"Y": X}, [tensor("X")], [tensor("Y")], jit=False)
    stray = attrs.evolve(plain, initial_state=lambda c: 0)
    assert any("initial_state is for stateful models" in e for e in check_model(stray))


async def test_a_bad_result_shape_is_an_error() -> None:
    """execute returning only outputs (no new state) fails the request clearly."""
    m = stateful(execute=lambda state, X: {"Y": X})
    async with orchestrion.open_server(models=[m]) as server:
        with pytest.raises(InferenceError, match=r"must return \(outputs, new_state\)"):
            await server.infer("acc", {"X": X}, sequence_id=1, sequence_start=True)


REPOSITORY_MODEL = """
import numpy as np

JIT = False


def initial_state(config):
    return np.zeros(2, np.float32)


def execute(state, X):
    total = state + X
    return {"Y": total}, total
"""
REPOSITORY_CONFIG = """
name: "counter"
input [ { name: "X", data_type: TYPE_FP32, dims: [ 2 ] } ]
output [ { name: "Y", data_type: TYPE_FP32, dims: [ 2 ] } ]
sequence_batching { max_sequence_idle_microseconds: 5000000 }
"""


async def test_a_stateful_model_from_a_repository(tmp_path: Path) -> None:
    """model.py's initial_state is read from the repository."""
    folder = tmp_path / "counter" / "1"
    folder.mkdir(parents=True)
    (folder.parent / "config.pbtxt").write_text(REPOSITORY_CONFIG)
    (folder / "model.py").write_text(REPOSITORY_MODEL)
    async with orchestrion.open_server(model_repository=tmp_path) as server:
        await server.infer("counter", {"X": X}, sequence_id=1, sequence_start=True)
        response = await server.infer("counter", {"X": X}, sequence_id=1)
    assert response.outputs["Y"].tolist() == [2, 2]


async def test_sequence_and_dynamic_batching_exclude_each_other() -> None:
    """Both in one config is refused at load."""
    from orchestrion.protocols import DynamicBatching

    m = stateful()
    m = attrs.evolve(
        m,
        config=attrs.evolve(m.config, max_batch_size=4, dynamic_batching=DynamicBatching()),
    )
    with pytest.raises(ConfigError, match="exclude each other"):
        async with orchestrion.open_server(models=[m]):
            pass
