"""The ONNX backend: an ONNX graph (``<version>/model.onnx``) run by ONNX Runtime.

How this works: each instance of ``instance_group`` is one ``InferenceSession``, made at load
with the session options the config's ``parameters`` name as Triton's onnxruntime backend
names them (``intra_op_thread_count``, ``inter_op_thread_count``, ``execution_mode``,
``enable_mem_arena``, ``enable_mem_pattern``, ``session.use_device_allocator_for_initializers``,
``memory.enable_memory_arena_shrinkage``) and the graph optimization level of ``optimization
{ graph { level } }``. The config is checked against the graph (``_onnx_config.py``) before
the model reports ready. ``KIND_GPU`` instances run on ONNX Runtime's CUDA execution provider
(a load error where there is none, as Triton fails a GPU instance without a GPU); ``KIND_AUTO``
uses it where present; ``KIND_CPU`` never does.

One execution is one ``InferenceSession.run``, which releases the GIL while it computes: the
runtime runs it in a worker thread (so instances compute in parallel) unless the warm-up
measured it short enough to run inline, like any other model. A batching model's requests
arrive joined on the batch dimension, any size up to ``max_batch_size`` (ONNX Runtime needs
no padding). BYTES tensors are strings to ONNX Runtime's Python API, which carries them as
UTF-8 text: inputs are decoded (bytes that are not UTF-8 fail the request), outputs encoded.
BF16 tensors, which numpy cannot hand to ONNX Runtime, cross as ``OrtValue``\\ s of their
bits (so a graph that takes strings cannot give BF16: an ``OrtValue`` cannot hold strings).
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections.abc import Hashable, Mapping
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np

from ..protocols import (
    ONNX_BACKEND,
    ONNX_PLATFORM,
    ConfigError,
    DataType,
    InferRequest,
    InstanceGroup,
    InstanceKind,
    ModelConfig,
    ModelLoadError,
    OnnxGraph,
    Tensors,
    apply_reshape,
    model_facing,
)
from ._base import Backend, Capabilities, LoadedInstance
from ._function import on_host
from ._onnx_config import (
    Graph,
    GraphTensor,
    complete_config,
    config_problems,
    graph_level,
    graph_problems,
    parameter_problems,
    parse_bool,
)

if TYPE_CHECKING:
    from ..protocols import Model

_log = logging.getLogger("orchestrion")

_BF16 = 16
"""ONNX's element type number of bfloat16 (``onnx.TensorProto.BFLOAT16``)."""
_CUDA = "CUDAExecutionProvider"
_CPU = "CPUExecutionProvider"
_RUN_ENTRIES = ("memory.enable_memory_arena_shrinkage",)
_SESSION_ENTRIES = ("session.use_device_allocator_for_initializers",)


def onnxruntime() -> ModuleType:
    """ONNX Runtime, imported on first use (an optional dependency).

    Raises:
        ModelLoadError: it is not installed.
    """
    try:
        import onnxruntime
    except ImportError as exc:
        raise ModelLoadError(
            "ONNX models run through ONNX Runtime, which is not installed: pip install "
            "'orchestrion[onnx]' (or onnxruntime-gpu, for KIND_GPU instances)"
        ) from exc
    module: ModuleType = onnxruntime
    return module


def open_session(ort: ModuleType, graph: Path | bytes, options: Any, providers: list[Any]) -> Any:
    """An ``InferenceSession`` of ``graph`` (a file: its external data is found beside it).

    Raises:
        ModelLoadError: ONNX Runtime cannot load the graph (a missing or corrupt file, an
            operator it does not know, ...); its own message kept.
    """
    source = str(graph) if isinstance(graph, Path) else "the ONNX model given as bytes"
    try:
        return ort.InferenceSession(
            graph if isinstance(graph, bytes) else str(graph),
            sess_options=options,
            providers=providers,
        )
    except Exception as exc:  # ONNX Runtime's own exception types, one per status code
        raise ModelLoadError(f"{source}: ONNX Runtime cannot load it: {exc}") from exc


def read_graph(session: Any) -> Graph:
    """The inputs, outputs and overridable initializers of a session's graph."""
    return Graph(
        inputs=tuple(GraphTensor.of(node) for node in session.get_inputs()),
        outputs=tuple(GraphTensor.of(node) for node in session.get_outputs()),
        initializers=tuple(GraphTensor.of(n) for n in session.get_overridable_initializers()),
    )


def complete_onnx_config(
    config: ModelConfig, model_file: Path, config_source: str, *, complete: bool = True
) -> ModelConfig:
    """A repository model's config, completed from the graph in ``model_file`` as Triton
    does (unless ``complete`` is False: Triton's ``--disable-auto-complete-config``) and
    checked against it (runs in a worker thread: it opens the graph).

    Raises:
        ModelLoadError: ONNX Runtime is missing or cannot load the file.
        ConfigError: the config disagrees with the graph (both named), or cannot be
            completed from it.
    """
    ort = onnxruntime()
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # only read
    graph = read_graph(open_session(ort, model_file, options, [_CPU]))
    if complete:
        completed = complete_config(config, graph, config_source)
    else:
        completed = attrs.evolve(config, platform=ONNX_PLATFORM, backend=ONNX_BACKEND)
    where = f"{config_source} (model '{config.name}')"
    problems = graph_problems(graph, f"{model_file} (model '{config.name}')")
    problems += config_problems(model_facing(completed), graph, config_source, str(model_file))
    if problems:
        raise ConfigError(list(dict.fromkeys(problems)))
    _log.debug("%s: completed from %s: %s", where, model_file, completed)
    return completed


def session_options(ort: ModuleType, config: ModelConfig) -> tuple[Any, Any]:
    """The session options and run options the config's parameters and graph level ask for
    (checked by `onnx_problems` at load)."""
    parameters = config.parameters
    options = ort.SessionOptions()
    levels = ort.GraphOptimizationLevel
    options.graph_optimization_level = {
        -1: levels.ORT_ENABLE_BASIC,
        1: levels.ORT_ENABLE_EXTENDED,
        2: levels.ORT_DISABLE_ALL,
    }.get(graph_level(config), levels.ORT_ENABLE_ALL)  # type: ignore[call-overload]
    parallel = parameters.get("execution_mode", "0").strip() == "1"
    modes = ort.ExecutionMode
    options.execution_mode = modes.ORT_PARALLEL if parallel else modes.ORT_SEQUENTIAL
    # 0 (or nothing) leaves ONNX Runtime's default, one thread per core, as Triton does.
    intra = int(parameters.get("intra_op_thread_count", "0"))
    if intra > 0:
        options.intra_op_num_threads = intra
    inter = int(parameters.get("inter_op_thread_count", "0"))
    if inter > 0:
        options.inter_op_num_threads = inter
    if "enable_mem_arena" in parameters:
        options.enable_cpu_mem_arena = parse_bool(parameters["enable_mem_arena"])
    if "enable_mem_pattern" in parameters:
        options.enable_mem_pattern = parse_bool(parameters["enable_mem_pattern"])
    for key in _SESSION_ENTRIES:
        if key in parameters:
            options.add_session_config_entry(key, parameters[key])
    run_options = ort.RunOptions()
    for key in _RUN_ENTRIES:
        if key in parameters:
            run_options.add_run_config_entry(key, parameters[key])
    return options, run_options


def placements(config: ModelConfig) -> list[tuple[InstanceKind, int]]:
    """Each instance's kind and GPU (the group's ``gpus`` in turn; GPU 0 when it lists none)."""
    found = []
    for group in config.instance_group or (InstanceGroup(),):
        for index in range(group.count):
            gpu = group.gpus[index % len(group.gpus)] if group.gpus else 0
            found.append((group.kind, gpu))
    return found


def providers(ort: ModuleType, kind: InstanceKind, gpu: int, where: str) -> list[Any]:
    """The execution providers of an instance of ``kind``.

    Raises:
        ModelLoadError: ``KIND_GPU`` where ONNX Runtime has no CUDA execution provider.
    """
    available = ort.get_available_providers()
    cuda = [(_CUDA, {"device_id": gpu}), _CPU]
    if kind is InstanceKind.KIND_GPU:
        if _CUDA not in available:
            raise ModelLoadError(
                f"{where}: instance_group kind KIND_GPU, but this ONNX Runtime has no CUDA "
                f"execution provider (it has {', '.join(available)}): install onnxruntime-gpu "
                "on a machine with a GPU, or use KIND_CPU"
            )
        return cuda
    if kind is InstanceKind.KIND_CPU or _CUDA not in available:
        return [_CPU]
    return cuda  # KIND_AUTO: the GPU where there is one, as in Triton


def _texts(name: str, value: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """A BYTES input as the strings ONNX Runtime's Python API takes (UTF-8 text)."""
    try:
        items = [v.decode() if isinstance(v, bytes) else str(v) for v in value.reshape(-1)]
    except UnicodeDecodeError:
        raise ValueError(
            f"input '{name}' holds bytes that are not UTF-8 text, which ONNX Runtime's Python "
            "API cannot pass to a string tensor"
        ) from None
    return np.array(items, dtype=object).reshape(value.shape)


def _encoded(value: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """A string output as a BYTES tensor (UTF-8)."""
    items = [v.encode() if isinstance(v, str) else v for v in value.reshape(-1)]
    return np.array(items, dtype=object).reshape(value.shape)


def _from_ort_value(value: Any) -> np.ndarray[Any, Any]:
    """An output ``OrtValue`` as numpy; BF16 (which ``numpy()`` refuses) copied by its bits."""
    if value.data_type() != "tensor(bfloat16)":
        array: np.ndarray[Any, Any] = value.numpy()
        return array
    shape = tuple(value.shape())
    count = int(np.prod(shape, dtype=np.int64))
    bits = np.empty(count, np.uint16)
    if count:
        ctypes.memmove(bits.ctypes.data, value.data_ptr(), count * 2)
    return bits.view(DataType.BF16.numpy_dtype).reshape(shape)


class OnnxBackend(Backend):
    """An ONNX graph run by ONNX Runtime: one ``InferenceSession`` per instance."""

    def __init__(self, model: Model) -> None:
        code = model.code
        assert isinstance(code, OnnxGraph)
        self.model = model
        # What the graph sees: a sequence batcher's control and state tensors too.
        self.config = config = model_facing(model.config)
        self._graph: Path | bytes = code.graph
        stateful = config.stateful
        batched = config.dynamic_batching is not None or stateful
        self.capabilities = Capabilities(
            is_async=False,
            streaming=False,
            stateful=stateful,
            sequence_tensors=stateful,
            batching=batched and config.max_batch_size > 0,
            thread_safe=True,
            compiles=False,
            takes_request=False,
            traceable=False,
        )
        self._outputs = [t.name for t in config.output]
        self._ort_values = any(t.data_type is DataType.BF16 for t in config.output)
        """A BF16 output: every feed and output crosses as an ``OrtValue``."""
        self._text_outputs = {t.name for t in config.output if t.data_type is DataType.BYTES}
        self._scalar_inputs: set[str] = set()
        """Inputs the graph takes as scalars (the config's ``dims: [1]``)."""
        self._scalar_outputs: dict[str, tuple[int, ...]] = {}
        self._run_options: Any = None
        self._ort: ModuleType | None = None
        self._instances: list[LoadedInstance] = []

    @property
    def _where(self) -> str:
        return f"{self.model.source} (model '{self.model.name}')"

    def load(self) -> list[LoadedInstance]:
        """One session per instance, checked against the config and warmed up.

        Raises:
            ModelLoadError: ONNX Runtime is missing or cannot load the graph, the config
                disagrees with the graph, or a GPU instance has no CUDA execution provider.
        """
        self._ort = ort = onnxruntime()
        options, self._run_options = session_options(ort, self.config)
        instances = []
        for index, (kind, gpu) in enumerate(placements(self.config)):
            wanted = providers(ort, kind, gpu, self._where)
            session = open_session(ort, self._graph, options, wanted)
            used = session.get_providers()
            if kind is InstanceKind.KIND_GPU and _CUDA not in used:
                raise ModelLoadError(
                    f"{self._where}: instance_group kind KIND_GPU, but ONNX Runtime could not "
                    f"start its CUDA execution provider on GPU {gpu} (it runs on "
                    f"{', '.join(used)}): is there a GPU and a CUDA driver?"
                )
            if index == 0:
                self._check(read_graph(session))
            device = f"cuda:{gpu}" if used[0] == _CUDA else "cpu"
            instances.append(LoadedInstance(index=index, device=device, params=session))
        for instance in instances:
            self._warm_up(instance)
        self._instances = instances
        return instances

    def _check(self, graph: Graph) -> None:
        """Check the config against the graph and learn which tensors are scalars."""
        source = str(self._graph) if isinstance(self._graph, Path) else "<bytes>"
        problems = graph_problems(graph, self._where)
        problems += config_problems(self.config, graph, self.model.config_source, source)
        if problems:
            raise ModelLoadError("\n".join(dict.fromkeys(problems)))
        if self.config.max_batch_size == 0:
            scalars = {t.name for t in (*graph.inputs, *graph.initializers) if not t.dims}
            self._scalar_inputs = {t.name for t in self.config.input if t.name in scalars}
            self._scalar_outputs = {
                t.name: t.dims
                for g in graph.outputs
                for t in self.config.output
                if t.name == g.name and not g.dims
            }

    def _warm_up(self, instance: LoadedInstance) -> None:
        """Time a few runs on zeros (batch 1) when every input's shape is fixed, so that the
        runtime knows whether the model is short enough to run inline. A graph that fails
        on zeros still loads (Triton runs nothing at load); it starts in worker threads."""
        config = self.config
        lead = (1,) if config.max_batch_size > 0 else ()
        inputs: dict[str, Any] = {}
        for tensor in config.input:
            if tensor.optional:
                continue
            if -1 in tensor.dims:
                return  # shapes known only when requests arrive
            shape = lead + tensor.dims
            if tensor.data_type is DataType.BYTES:  # "0": a number too, for graphs that cast
                inputs[tensor.name] = np.full(shape, b"0", dtype=object)
            else:
                inputs[tensor.name] = np.zeros(shape, dtype=tensor.data_type.numpy_dtype)
        assert self._ort is not None
        serving, self._run_options = self._run_options, self._ort.RunOptions()
        self._run_options.log_severity_level = 4  # a failure on zeros is said once, below
        try:
            arguments = self.arguments(
                InferRequest(model_name=config.name, inputs=inputs), None, instance
            )
            self.execute(instance, arguments)  # the first run allocates
            timings = []
            for _ in range(5):
                start = time.perf_counter_ns()
                self.execute(instance, arguments)
                timings.append(time.perf_counter_ns() - start)
        except Exception as exc:
            _log.warning(
                "%s: a warm-up run on zeros failed, so executions start in worker threads: %s: %s",
                self._where,
                type(exc).__name__,
                exc,
            )
            return
        finally:
            self._run_options = serving
        instance.typical_ns = sorted(timings)[len(timings) // 2]

    def signature(self, inputs: Tensors) -> Hashable | None:
        """ONNX Runtime compiles nothing per shape."""
        return None

    def arguments(
        self, request: InferRequest, state: Any, instance: LoadedInstance
    ) -> Mapping[str, Any]:
        """The session's feeds: each input present, on the host, reshaped as the config
        says (a scalar of the graph as a scalar), strings as text, BF16 as ``OrtValue``."""
        config = self.config
        feeds: dict[str, Any] = {}
        for tensor in config.input:
            value = request.inputs.get(tensor.name)
            if value is None:
                continue
            if type(value) is not np.ndarray:
                value = on_host(value)  # a jitted step's output, still on its device
            value = apply_reshape(tensor, value, config.max_batch_size)
            if tensor.name in self._scalar_inputs:
                value = value.reshape(())
            if tensor.data_type is DataType.BYTES:
                value = _texts(tensor.name, value)
            elif self._ort_values or tensor.data_type is DataType.BF16:
                value = self._ort_value(value, tensor.data_type)
            feeds[tensor.name] = value
        return feeds

    def _ort_value(self, value: np.ndarray[Any, Any], data_type: DataType) -> Any:
        assert self._ort is not None
        make = self._ort.OrtValue
        if data_type is DataType.BF16:
            bits = np.ascontiguousarray(value).view(np.uint16)
            return make.ortvalue_from_numpy_with_onnx_type(bits, _BF16)
        return make.ortvalue_from_numpy(np.ascontiguousarray(value))

    def execute(
        self, instance: LoadedInstance, arguments: Mapping[str, Any]
    ) -> tuple[Mapping[str, Any], Any]:
        """One ``InferenceSession.run`` (the GIL released while it computes): the config's
        outputs, as numpy arrays of the config's types and shapes."""
        session = instance.params
        if self._ort_values:
            values = session.run_with_ort_values(self._outputs, arguments, self._run_options)
            raw = [_from_ort_value(v) for v in values]
        else:
            raw = session.run(self._outputs, arguments, self._run_options)
        outputs = {}
        for name, value in zip(self._outputs, raw, strict=True):
            if name in self._text_outputs:
                value = _encoded(value)
            if name in self._scalar_outputs:
                value = value.reshape(self._scalar_outputs[name])
            outputs[name] = value
        return outputs, None

    def close(self) -> None:
        """Drop the sessions (ONNX Runtime frees them, and their memory, with the object)."""
        for instance in self._instances:
            instance.params = None
        self._instances = []


def onnx_problems(model: Model, where: str, in_config: str) -> list[str]:
    """Why ``model``'s config cannot run on ONNX Runtime, from the config alone (empty: it
    can; the graph is checked against it when the model loads)."""
    config = model.config
    problems = []
    if config.decoupled:
        problems.append(f"{in_config}: an ONNX model cannot be decoupled")
    if config.max_batch_size > 0:
        optional = [t.name for t in config.input if t.optional]
        if optional:
            problems.append(
                f"{in_config}: optional inputs ({', '.join(optional)}) of an ONNX model that "
                "batches are not supported (as in Triton)"
            )
    if isinstance(config.optimization, Mapping) and config.optimization.get(
        "execution_accelerators"
    ):
        problems.append(
            f"{in_config}: optimization execution_accelerators (TensorRT, OpenVINO, CUDA "
            "options) are not supported: ONNX Runtime runs on its CPU or CUDA provider"
        )
    texts = [t.name for t in config.input if t.data_type is DataType.BYTES]
    bf16 = [t.name for t in config.output if t.data_type is DataType.BF16]
    if texts and bf16:
        problems.append(
            f"{in_config}: ONNX Runtime's Python API cannot run a graph that takes strings "
            f"({', '.join(texts)}) and gives BF16 ({', '.join(bf16)}): BF16 outputs come "
            "only as OrtValues, which cannot hold strings"
        )
    return problems + parameter_problems(config, in_config)
