"""ONNX models through ONNX Runtime: every Triton data type through an identity graph,
dynamic batching on the graph's batch dimension, the session parameters Triton names, GPU
instances where there is no CUDA, and models defined in Python with the graph's bytes."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import trio

import orchestrion
from orchestrion.protocols import (
    DataType,
    DynamicBatching,
    InferenceError,
    InstanceGroup,
    InstanceKind,
    ModelConfig,
    ModelLoadError,
)
from orchestrion.testing import inside, tensor
from support import onnx_graphs

VALUES: dict[DataType, np.ndarray[Any, Any]] = {
    DataType.BOOL: np.array([[True, False, True]]),
    DataType.UINT8: np.array([[0, 7, 255]], np.uint8),
    DataType.UINT16: np.array([[0, 7, 65535]], np.uint16),
    DataType.UINT32: np.array([[0, 7, 2**32 - 1]], np.uint32),
    DataType.UINT64: np.array([[0, 2**53 + 1, 2**64 - 1]], np.uint64),
    DataType.INT8: np.array([[-128, 0, 127]], np.int8),
    DataType.INT16: np.array([[-(2**15), 0, 2**15 - 1]], np.int16),
    DataType.INT32: np.array([[-(2**31), 0, 2**31 - 1]], np.int32),
    DataType.INT64: np.array([[-(2**63), 2**53 + 1, 2**63 - 1]], np.int64),
    DataType.FP16: np.array([[0.1, -65504, np.inf]], np.float16),
    DataType.FP32: np.array([[1 + 2**-23, np.nan, -0.0]], np.float32),
    DataType.FP64: np.array([[1 + 2**-52, 1e300, -1e-300]], np.float64),
    DataType.BF16: np.array([[1.5, -2.0, 3e38]], ml_dtypes.bfloat16),
    DataType.BYTES: np.array([[b"", "é ü".encode(), b"nul\x00inside"]], dtype=object),
}


def _name(data_type: DataType) -> str:
    return f"identity_{data_type.value.lower()}"


async def test_every_triton_type_round_trips_exactly(tmp_path: Path) -> None:
    """An identity graph per type, auto-completed from the graph (no config): each ONNX type
    maps to Triton's, and every value comes back bit for bit (NaN, -0.0, the 64-bit
    extremes, BF16, strings with non-ASCII text and NUL bytes)."""
    for data_type in VALUES:
        graph = onnx_graphs.identity([("IN", "OUT", data_type, ("batch", 3))])
        onnx_graphs.model_folder(tmp_path, _name(data_type), graph)
    async with orchestrion.open_server(model_repository=tmp_path) as server:
        outputs = {}
        for data_type, sent in VALUES.items():
            config = server.model_config(_name(data_type))
            assert [(t.name, t.data_type, t.dims) for t in config.input] == [
                ("IN", data_type, (3,))
            ]
            outputs[data_type] = (await server.infer(_name(data_type), {"IN": sent})).outputs
    for data_type, sent in VALUES.items():
        got = outputs[data_type]["OUT"]
        assert got.dtype == sent.dtype, data_type
        assert got.shape == sent.shape
        if data_type is DataType.BYTES:
            assert got.tolist() == sent.tolist()
        else:
            assert got.tobytes() == sent.tobytes(), data_type


async def test_strings_in_and_bf16_out_are_refused_at_load(tmp_path: Path) -> None:
    """A graph that takes strings and gives BF16 cannot run through ONNX Runtime's Python
    API: the load says so, naming both tensors."""
    graph = onnx_graphs.identity(
        [("TEXT", "SAME", DataType.BYTES, (1,)), ("HALF", "OUT", DataType.BF16, (1,))]
    )
    onnx_graphs.model_folder(tmp_path, "mixed", graph)
    with pytest.raises(
        orchestrion.ConfigError, match=r"takes strings \(TEXT\) and gives BF16 \(OUT\)"
    ):
        async with orchestrion.open_server(model_repository=tmp_path):
            pass


async def test_bytes_that_are_not_utf8_fail_the_request_naming_the_input(tmp_path: Path) -> None:
    """ONNX Runtime's Python API carries strings as text: bytes that are not UTF-8 fail that
    request with a message naming the input, and the model serves on."""
    graph = onnx_graphs.identity([("TEXT", "SAME", DataType.BYTES, ("batch", 1))])
    onnx_graphs.model_folder(tmp_path, "text", graph)
    async with orchestrion.open_server(model_repository=tmp_path) as server:
        with pytest.raises(InferenceError, match="input 'TEXT' holds bytes that are not UTF-8"):
            await server.infer("text", {"TEXT": np.array([[b"\xff\xfe"]], dtype=object)})
        ok = await server.infer("text", {"TEXT": np.array([[b"fine"]], dtype=object)})
    assert ok.outputs["SAME"].tolist() == [[b"fine"]]


async def test_concurrent_requests_run_as_one_batch(tmp_path: Path) -> None:
    """Dynamic batching on the graph's batch dimension: eight concurrent requests of batch 1
    and 2 join (executions fewer than requests) and each gets its own rows back."""
    config = """
platform: "onnxruntime_onnx"
max_batch_size: 16
dynamic_batching { max_queue_delay_microseconds: 200000 }
"""
    onnx_graphs.model_folder(tmp_path, "add", onnx_graphs.add(), config)
    results: dict[int, Any] = {}
    async with orchestrion.open_server(model_repository=tmp_path) as server:

        async def one(index: int) -> None:
            rows = 1 + index % 2
            a = np.full((rows, 4), index, np.float32)
            results[index] = (a, await server.infer("add", {"A": a, "B": np.ones_like(a)}))

        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                for index in range(8):
                    nursery.start_soon(one, index)
        (stats,) = server.model_statistics("add")
    for a, response in results.values():
        np.testing.assert_array_equal(response.outputs["SUM"], a + 1)
        np.testing.assert_array_equal(response.outputs["DIFF"], a - 1)
    assert stats.inference_stats.success.count == 8
    assert stats.execution_count < 8
    assert stats.inference_count == 12  # rows, not requests


def _python_model(graph: bytes, **config: Any) -> orchestrion.Model:
    made = ModelConfig(
        name="sum",
        platform="onnxruntime_onnx",
        input=(tensor("A", dims=(4,)), tensor("B", dims=(4,))),
        output=(tensor("SUM", dims=(4,)),),
        **config,
    )
    return orchestrion.Model(config=made, onnx=graph)


async def test_a_model_defined_in_python_takes_the_graph_as_bytes() -> None:
    """``Model(onnx=bytes)`` with a config of a subset of the graph's outputs serves, with
    batching on ``max_batch_size`` and the dynamic batcher from the config."""
    model = _python_model(onnx_graphs.add(), max_batch_size=8, dynamic_batching=DynamicBatching())
    async with orchestrion.open_server(models=[model]) as server:
        a = np.arange(8, dtype=np.float32).reshape(2, 4)
        response = await server.infer("sum", {"A": a, "B": a})
    assert set(response.outputs) == {"SUM"}
    np.testing.assert_array_equal(response.outputs["SUM"], a * 2)


async def test_a_python_config_that_disagrees_with_the_graph_fails_the_load() -> None:
    """The graph is checked when the model loads: a fixed batch-less config against a graph
    with a batch dimension names the tensor and both shapes."""
    model = _python_model(onnx_graphs.add(dims=(3, 4)))
    with pytest.raises(ModelLoadError, match=r"input 'A': shape \[3, 4\] in the graph, \[4\]"):
        async with orchestrion.open_server(models=[model]):
            pass


async def test_an_onnx_config_without_its_graph_is_refused() -> None:
    """``platform: onnxruntime_onnx`` with an ``execute`` and no graph says what is missing."""
    config = ModelConfig(
        name="m", platform="onnxruntime_onnx", input=(tensor("X"),), output=(tensor("Y"),)
    )
    with pytest.raises(orchestrion.ConfigError, match=r"runs an ONNX graph: give it"):
        async with orchestrion.open_server(models=[orchestrion.Model(config=config)]):
            pass


def _sessions(server: orchestrion.AsyncServer, name: str) -> list[Any]:
    runner = inside(server).runner(name)  # the runtime's own view of its instances
    return [instance.loaded.params for instance in runner.instances]  # type: ignore[union-attr]


async def test_triton_session_parameters_reach_every_instance(tmp_path: Path) -> None:
    """Triton's parameter names set each instance's session: thread counts, parallel
    execution, the memory arena; two instances are two sessions."""
    config = """
platform: "onnxruntime_onnx"
max_batch_size: 4
instance_group { count: 2 kind: KIND_CPU }
optimization { graph { level: 2 } }
parameters { key: "intra_op_thread_count" value: { string_value: "1" } }
parameters { key: "inter_op_thread_count" value: { string_value: "2" } }
parameters { key: "execution_mode" value: { string_value: "1" } }
parameters { key: "enable_mem_arena" value: { string_value: "false" } }
"""
    onnx_graphs.model_folder(tmp_path, "add", onnx_graphs.add(), config)
    async with orchestrion.open_server(model_repository=tmp_path) as server:
        sessions = _sessions(server, "add")
        a = np.ones((1, 4), np.float32)
        response = await server.infer("add", {"A": a, "B": a})
    assert len(sessions) == 2
    assert sessions[0] is not sessions[1]
    for session in sessions:
        options = session.get_session_options()
        assert options.intra_op_num_threads == 1
        assert options.inter_op_num_threads == 2
        assert str(options.execution_mode).endswith("ORT_PARALLEL")
        assert str(options.graph_optimization_level).endswith("ORT_DISABLE_ALL")
        assert options.enable_cpu_mem_arena is False
    np.testing.assert_array_equal(response.outputs["SUM"], a * 2)


@pytest.mark.parametrize(
    ("parameter", "value", "message"),
    [
        ("intra_op_thread_count", "two", "parameter 'intra_op_thread_count' must be a count"),
        ("execution_mode", "2", "parameter 'execution_mode' must be 0 (sequential) or 1"),
        ("enable_mem_pattern", "maybe", "parameter 'enable_mem_pattern': 'maybe' is not a"),
    ],
)
async def test_a_parameter_onnx_runtime_cannot_take_is_a_load_error(
    parameter: str, value: str, message: str
) -> None:
    """A session parameter with a value ONNX Runtime cannot use fails the load, named."""
    model = _python_model(onnx_graphs.add(dims=(4,)), parameters={parameter: value})
    with pytest.raises(orchestrion.ConfigError, match=re.escape(message)):
        async with orchestrion.open_server(models=[model]):
            pass


async def test_execution_accelerators_are_refused_not_ignored() -> None:
    """TensorRT or OpenVINO in ``optimization`` would be silently slower here: refused."""
    accelerators = {"execution_accelerators": {"gpu_execution_accelerator": [{"name": "tensorrt"}]}}
    model = _python_model(onnx_graphs.add(dims=(4,)), optimization=accelerators)
    with pytest.raises(orchestrion.ConfigError, match="execution_accelerators .* not supported"):
        async with orchestrion.open_server(models=[model]):
            pass


async def test_gpu_instances_without_cuda_are_a_clear_load_error() -> None:
    """``KIND_GPU`` where ONNX Runtime has no CUDA execution provider fails the load (as
    Triton fails a GPU instance without a GPU) and says what to install."""
    model = _python_model(
        onnx_graphs.add(dims=(4,)),
        instance_group=(InstanceGroup(kind=InstanceKind.KIND_GPU),),
    )
    with pytest.raises(ModelLoadError, match="KIND_GPU, but this ONNX Runtime has no CUDA"):
        async with orchestrion.open_server(models=[model]):
            pass


async def test_auto_instances_run_on_the_cpu_without_cuda() -> None:
    """``KIND_AUTO`` (no instance_group) falls back to the CPU where there is no CUDA."""
    async with orchestrion.open_server(
        models=[_python_model(onnx_graphs.add(dims=(4,)))]
    ) as server:
        (instance,) = inside(server).instances("sum")  # type: ignore[union-attr]
        a = np.ones(4, np.float32)
        response = await server.infer("sum", {"A": a, "B": a})
    assert instance.device == "cpu"
    np.testing.assert_array_equal(response.outputs["SUM"], a * 2)
