"""Triton's sequence batcher (`orchestrion.actors._sequence_batcher`) with real ONNX Runtime
models: control inputs as the model sees them, Direct slots (a sequence keeps its row, empty
rows not ready), Oldest batches (oldest requests, compact rows), the backlog, implicit state
(initial state from zeros or a file, the state kept after a failure and shown only when
listed), idle release, Triton's refusals, a caller that leaves, an unload with requests
queued, and a python model's controls."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
import trio.testing

import orchestrion
from orchestrion import Model
from orchestrion.protocols import InvalidRequestError, parse_model_config
from support.onnx_graphs import accumulator, slot_probe

PROBE_CONTROLS = """
  control_input [
    { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] },
    { name: "END" control [ { kind: CONTROL_SEQUENCE_END int32_false_true: [ 0, 1 ] } ] },
    { name: "READY" control [ { kind: CONTROL_SEQUENCE_READY int32_false_true: [ 0, 1 ] } ] },
    { name: "CORRID" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_INT64 } ] }
  ]
"""
PROBE_OUTPUTS = "".join(
    f'{{ name: "{n}" data_type: {t} dims: [ 1 ] }},'
    for n, t in [
        ("OUTPUT", "TYPE_INT32"),
        ("ROW", "TYPE_INT32"),
        ("SEEN_READY", "TYPE_INT32"),
        ("SEEN_START", "TYPE_INT32"),
        ("SEEN_END", "TYPE_INT32"),
        ("SEEN_CORRID", "TYPE_INT64"),
    ]
).rstrip(",")


def _probe(name: str, strategy: str, *, batch: int = 4, instances: int = 1) -> Model:
    text = f"""
    name: "{name}"
    platform: "onnxruntime_onnx"
    max_batch_size: {batch}
    input [ {{ name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
    output [ {PROBE_OUTPUTS} ]
    instance_group [ {{ count: {instances} kind: KIND_CPU }} ]
    sequence_batching {{
      max_sequence_idle_microseconds: 60000000
      {strategy}
      {PROBE_CONTROLS}
    }}
    """
    return Model(config=parse_model_config(textwrap.dedent(text), source=name), onnx=slot_probe())


def _accumulator(name: str, initial: str = "", outputs: str = "", **states: bytes) -> Model:
    text = f"""
    name: "{name}"
    platform: "onnxruntime_onnx"
    max_batch_size: 4
    input [ {{ name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
    output [ {{ name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] }},
             {{ name: "ROW_READY" data_type: TYPE_INT32 dims: [ 1 ] }} {outputs} ]
    sequence_batching {{
      max_sequence_idle_microseconds: 60000000
      control_input [ {{ name: "READY" control [ {{ kind: CONTROL_SEQUENCE_READY
                                                   int32_false_true: [ 0, 1 ] }} ] }} ]
      state [ {{ input_name: "INPUT_STATE" output_name: "OUTPUT_STATE" data_type: TYPE_INT32
                 dims: [ 1 ] {initial} }} ]
    }}
    """
    config = parse_model_config(textwrap.dedent(text), source=name)
    return Model(config=config, onnx=accumulator(), initial_states=states)


def _x(value: int) -> dict[str, np.ndarray[Any, Any]]:
    return {"INPUT": np.full((1, 1), value, np.int32)}


def _row(response: Any) -> dict[str, int]:
    return {name: int(array[0, 0]) for name, array in response.outputs.items()}


async def _sequence(
    server: Any, model: str, key: int | str, values: list[int], into: dict[Any, list[Any]]
) -> None:
    """Send ``values`` as one sequence, each request after the last's answer."""
    into[key] = []
    for index, value in enumerate(values):
        response = await server.infer(
            model,
            _x(value),
            sequence_id=key,
            sequence_start=index == 0,
            sequence_end=index == len(values) - 1,
        )
        into[key].append(_row(response))


async def test_the_model_sees_each_requests_controls() -> None:
    """START on the first request, END on the last, READY on every one, CORRID the id; the
    response carries the sequence's parameters, and no control tensor."""
    async with orchestrion.open_server(models=[_probe("probe", "direct { }")]) as server:
        rows: dict[Any, list[Any]] = {}
        await _sequence(server, "probe", 1234, [5, 6, 7], rows)
        alone = await server.infer(
            "probe", _x(9), sequence_id=77, sequence_start=True, sequence_end=True
        )
    assert [(r["SEEN_START"], r["SEEN_END"], r["SEEN_READY"]) for r in rows[1234]] == [
        (1, 0, 1),
        (0, 0, 1),
        (0, 1, 1),
    ]
    assert {r["SEEN_CORRID"] for r in rows[1234]} == {1234}
    assert [r["OUTPUT"] for r in rows[1234]] == [5, 6, 7]
    assert _row(alone)["SEEN_START"] == _row(alone)["SEEN_END"] == 1
    assert alone.parameters["sequence_id"] == 77
    assert "START" not in alone.outputs
    assert "READY" not in alone.outputs


async def test_direct_keeps_each_sequence_in_its_slot_with_empty_rows_not_ready() -> None:
    """Direct, 4 slots: three sequences started in turn take slots 0, 1, 2 and keep them;
    once the one in slot 1 has ended, a batch of the other two still has three rows, slot 1's
    a not-ready copy (the client never sees it), and each sequence at its own row."""
    strategy = "direct { max_queue_delay_microseconds: 300000 minimum_slot_utilization: 0.5 }"
    async with orchestrion.open_server(models=[_probe("probe", strategy)]) as server:
        first = {}
        for key in (10, 11, 12):  # one at a time: slots in order
            response = await server.infer("probe", _x(key), sequence_id=key, sequence_start=True)
            first[key] = _row(response)["ROW"]
        ended = await server.infer("probe", _x(0), sequence_id=11, sequence_end=True)
        rows: dict[int, dict[str, int]] = {}

        async def ask(key: int) -> None:
            response = await server.infer("probe", _x(key), sequence_id=key)
            rows[key] = _row(response)

        async with trio.open_nursery() as nursery:  # two of four slots ready: one batch
            nursery.start_soon(ask, 10)
            nursery.start_soon(ask, 12)
        stats = server.model_statistics("probe")[0]
    assert first == {10: 1, 11: 2, 12: 3}  # alone in its batch, yet at its own row
    assert _row(ended)["ROW"] == 2
    assert (rows[10]["ROW"], rows[12]["ROW"]) == (1, 3), rows
    assert rows[10]["OUTPUT"] == 10
    assert rows[12]["OUTPUT"] == 12
    assert stats.execution_count == 5
    assert stats.inference_count == 6


async def test_oldest_batches_the_oldest_requests_in_compact_rows() -> None:
    """Oldest, candidates of two instances: four sequences' requests, sent together, run in
    batches of the oldest ones, rows packed from 1, each sequence's answers in order."""
    strategy = "oldest { max_candidate_sequences: 2 max_queue_delay_microseconds: 200000 }"
    model = _probe("dyna", strategy, batch=2, instances=2)
    async with orchestrion.open_server(models=[model]) as server:
        rows: dict[Any, list[Any]] = {}
        async with trio.open_nursery() as nursery:
            for key in (1, 2, 3, 4):
                nursery.start_soon(
                    _sequence, server, "dyna", key, [key * 10 + i for i in range(4)], rows
                )
        stats = server.model_statistics("dyna")[0]
    for key in (1, 2, 3, 4):
        assert [r["OUTPUT"] for r in rows[key]] == [key * 10 + i for i in range(4)]
        assert {r["SEEN_CORRID"] for r in rows[key]} == {key}
    assert {r["ROW"] for key in rows for r in rows[key]} <= {1, 2}
    assert stats.inference_count == 16
    assert stats.execution_count < 16  # some batches of two


async def test_a_sequence_without_a_slot_waits_in_the_backlog() -> None:
    """One slot: a second sequence's first request waits until the first sequence ends,
    then runs; both sequences' answers are right."""
    async with orchestrion.open_server(models=[_probe("one", "direct { }", batch=1)]) as server:
        await server.infer("one", _x(1), sequence_id=1, sequence_start=True)
        waited: list[dict[str, int]] = []

        async def second() -> None:
            response = await server.infer("one", _x(2), sequence_id=2, sequence_start=True)
            waited.append(_row(response))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(second)
            await trio.sleep(0.3)
            assert waited == []  # no slot yet
            ended = await server.infer("one", _x(3), sequence_id=1, sequence_end=True)
        assert _row(ended)["OUTPUT"] == 3
        assert waited[0]["OUTPUT"] == 2
        assert waited[0]["SEEN_START"] == 1


async def test_implicit_state_carries_from_request_to_request() -> None:
    """A running sum kept by the batcher: from zeros (no initial_state), from zero_data, and
    from a data_file holding 100; each sequence's own; restarted by START; the state output
    is not in the response unless the config lists it."""
    zero = 'initial_state { data_type: TYPE_INT32 dims: [ 1 ] zero_data: true name: "zeros" }'
    from_file = 'initial_state { data_type: TYPE_INT32 dims: [ 1 ] data_file: "hundred" }'
    listed = ', { name: "OUTPUT_STATE" data_type: TYPE_INT32 dims: [ 1 ] }'
    models = [
        _accumulator("plain"),
        _accumulator("zeroed", zero),
        _accumulator("filed", from_file, listed, INPUT_STATE=np.int32(100).tobytes()),
    ]
    async with orchestrion.open_server(models=models) as server:
        sums: dict[Any, list[Any]] = {}
        async with trio.open_nursery() as nursery:
            for model in ("plain", "zeroed", "filed"):
                for key in (1, 2):
                    values = [key, key, key] if key == 1 else [5, 6]
                    nursery.start_soon(_sequence, server, model, f"{model}-{key}", values, sums)
        again = await server.infer("plain", _x(4), sequence_id="plain-x", sequence_start=True)
    for model, base in (("plain", 0), ("zeroed", 0), ("filed", 100)):
        assert [r["OUTPUT"] for r in sums[f"{model}-1"]] == [base + 1, base + 2, base + 3]
        assert [r["OUTPUT"] for r in sums[f"{model}-2"]] == [base + 5, base + 11]
    assert "OUTPUT_STATE" not in sums["plain-1"][0]
    assert [r["OUTPUT_STATE"] for r in sums["filed-1"]] == [101, 102, 103]
    assert _row(again)["OUTPUT"] == 4


async def test_triton_refusals_in_its_words() -> None:
    """No correlation id, a batch of two, a request of a sequence never started: Triton's
    messages; the model serves the next sequence."""
    async with orchestrion.open_server(models=[_probe("probe", "direct { }")]) as server:
        with pytest.raises(InvalidRequestError, match="must specify a non-zero or non-empty"):
            await server.infer("probe", _x(1))
        with pytest.raises(InvalidRequestError, match="must specify batch-size 1 due to"):
            await server.infer(
                "probe", {"INPUT": np.ones((2, 1), np.int32)}, sequence_id=5, sequence_start=True
            )
        with pytest.raises(
            InvalidRequestError, match="sequence 99 to model 'probe' must specify the START flag"
        ):
            await server.infer("probe", _x(1), sequence_id=99)
        ok = await server.infer("probe", _x(3), sequence_id=6, sequence_start=True)
    assert _row(ok)["OUTPUT"] == 3


async def test_an_idle_sequence_is_released_and_must_start_again() -> None:
    """max_sequence_idle_microseconds 100 ms: a sequence left idle loses its slot (the
    backlog's sequence gets it), and its next request must carry START."""
    text = f"""
    name: "idle" platform: "onnxruntime_onnx" max_batch_size: 1
    input [ {{ name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
    output [ {PROBE_OUTPUTS} ]
    sequence_batching {{ max_sequence_idle_microseconds: 100000 {PROBE_CONTROLS} }}
    """
    model = Model(config=parse_model_config(text, source="idle"), onnx=slot_probe())
    async with orchestrion.open_server(models=[model]) as server:
        await server.infer("idle", _x(1), sequence_id=1, sequence_start=True)
        with trio.fail_after(10):
            second = await server.infer("idle", _x(2), sequence_id=2, sequence_start=True)
        with pytest.raises(InvalidRequestError, match="must specify the START flag"):
            await server.infer("idle", _x(3), sequence_id=1)
    assert _row(second)["OUTPUT"] == 2


SLOW_SUM = """
import time

import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT").as_numpy()
            state = pb_utils.get_input_tensor_by_name(request, "INPUT_STATE").as_numpy()
            if x[0, 0] == 1:
                time.sleep(0.5)  # the first request runs long: the next waits behind it
            total = x + state
            out.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUTPUT", total), pb_utils.Tensor("OUTPUT_STATE", total)]
            ))
        return out
"""
SLOW_SUM_CONFIG = """
name: "slow_sum" backend: "python" max_batch_size: 1
input [ { name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
parameters { key: "execution" value: { string_value: "thread" } }
sequence_batching {
  state [ { input_name: "INPUT_STATE" output_name: "OUTPUT_STATE" data_type: TYPE_INT32
            dims: [ 1 ] } ]
}
"""


async def test_a_caller_that_leaves_is_skipped_and_its_sequence_goes_on(tmp_path: Path) -> None:
    """A request cancelled while it waits behind its sequence's running one never runs; the
    sequence's next request runs with the state the earlier ones left (a python model's
    implicit state, read and returned as tensors)."""
    (tmp_path / "slow_sum" / "1").mkdir(parents=True)
    (tmp_path / "slow_sum" / "1" / "model.py").write_text(SLOW_SUM)
    (tmp_path / "slow_sum" / "config.pbtxt").write_text(SLOW_SUM_CONFIG)
    async with orchestrion.open_server(model_repository=tmp_path) as server:
        first: list[Any] = []

        async def start() -> None:
            response = await server.infer("slow_sum", _x(1), sequence_id=1, sequence_start=True)
            first.append(response)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(start)
            await trio.sleep(0.1)  # the first request runs (0.5 s)
            with trio.move_on_after(0.1) as gone:
                await server.infer("slow_sum", _x(1000), sequence_id=1)
            assert gone.cancelled_caught
        last = await server.infer("slow_sum", _x(2), sequence_id=1, sequence_end=True)
        stats = server.model_statistics("slow_sum")[0]
    assert _row(first[0])["OUTPUT"] == 1
    assert _row(last) == {"OUTPUT": 3}  # 1 + 2: the 1000 never ran; the state output unseen
    assert stats.inference_count == 2


async def test_a_python_model_gets_the_controls_as_tensors(tmp_path: Path) -> None:
    """A Triton python model with sequence_batching reads START, END and CORRID with
    get_input_tensor_by_name, requests of two sequences batched into one list."""
    code = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT").as_numpy()
            start = pb_utils.get_input_tensor_by_name(request, "START").as_numpy()
            corrid = pb_utils.get_input_tensor_by_name(request, "CORRID").as_numpy()
            total = x + 1000 * start + corrid.astype(np.int32) * 0 + len(requests) * 100000
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT", total)]))
        return out
"""
    config = """
    name: "py" backend: "python" max_batch_size: 2
    input [ { name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
    output [ { name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
    sequence_batching {
      direct { max_queue_delay_microseconds: 2000000 minimum_slot_utilization: 1.0 }
      control_input [
        { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] },
        { name: "CORRID" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 } ] }
      ]
    }
    """
    (tmp_path / "py" / "1").mkdir(parents=True)
    (tmp_path / "py" / "1" / "model.py").write_text(code)
    (tmp_path / "py" / "config.pbtxt").write_text(config)
    async with orchestrion.open_server(model_repository=tmp_path) as server:
        results: dict[int, int] = {}

        async def ask(key: int) -> None:
            response = await server.infer("py", _x(key), sequence_id=key, sequence_start=True)
            results[key] = int(response.outputs["OUTPUT"][0, 0])

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask, 1)
            nursery.start_soon(ask, 2)
    assert results == {1: 201001, 2: 201002}


async def test_an_unload_lets_queued_requests_run() -> None:
    """Unloading the model while twelve one-request sequences wait (four slots, the rest in
    the backlog): each of them is answered, right; a request after the unload is refused."""
    async with orchestrion.open_server(models=[_accumulator("sum")]) as server:
        answers: list[int] = []

        async def ask(key: int) -> None:
            response = await server.infer(
                "sum", _x(key), sequence_id=key, sequence_start=True, sequence_end=True
            )
            answers.append(int(response.outputs["OUTPUT"][0, 0]))

        async with trio.open_nursery() as nursery:
            for key in range(1, 13):
                nursery.start_soon(ask, key)
            await trio.testing.wait_all_tasks_blocked()
            await server.unload_model("sum")
        with pytest.raises(orchestrion.ModelNotFoundError):
            await server.infer("sum", _x(1), sequence_id=1, sequence_start=True)
    assert sorted(answers) == list(range(1, 13))
