"""Models and ensembles built in one line, and checks of a server's state at rest.

`model`, `triton_model`, `ensemble` and `step` fill in a `ModelConfig` with short defaults
(FP32 tensors of 16 elements, one CPU instance); `cached`, `with_fusion` and `decoupled`
change one setting of a definition. `assert_idle`, `fused` and `settled` look inside a
running `AsyncServer` (its private state: they follow the runtime's internals, for the
project's own tests).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import trio

from orchestrion import AsyncServer, Model
from orchestrion.actors import SWITCH_WINDOW, EnsembleRunner, Fusion, ListedFusion
from orchestrion.protocols import (
    DataType,
    EnsembleScheduling,
    EnsembleStep,
    InferRequest,
    InstanceGroup,
    InstanceKind,
    ModelConfig,
    ModelTransactionPolicy,
    Observer,
    ResponseCache,
    TensorConfig,
)

from ._inside import inside


def tensor(name: str, dtype: str = "FP32", dims: Sequence[int] = (16,), **kw: Any) -> TensorConfig:
    """A TensorConfig with short defaults."""
    return TensorConfig(name=name, data_type=DataType[dtype], dims=tuple(dims), **kw)


def model(
    name: str,
    execute: Callable[..., Any],
    inputs: Sequence[TensorConfig],
    outputs: Sequence[TensorConfig],
    *,
    jit: bool = True,
    version: int = 1,
    max_batch_size: int = 0,
    count: int = 1,
    initialize: Callable[[ModelConfig], Any] | None = None,
    parameters: Mapping[str, str] | None = None,
) -> Model:
    """A Python model definition.

    Plain synchronous models default to running inline: a model in a worker thread is not a
    blocked task for ``wait_all_tasks_blocked``, and these tests want determinism. The thread
    path has tests of its own (tests/backends/test_inline_and_threaded_execution.py).
    """
    if parameters is None and not jit and not inspect.iscoroutinefunction(execute):
        parameters = {"execution": "inline"}
    config = ModelConfig(
        name=name,
        max_batch_size=max_batch_size,
        input=tuple(inputs),
        output=tuple(outputs),
        instance_group=(InstanceGroup(count=count, kind=InstanceKind.KIND_CPU),),
        parameters=dict(parameters or {}),
    )
    return Model(config=config, execute=execute, initialize=initialize, jit=jit, version=version)


def triton_model(
    name: str,
    cls: type,
    inputs: Sequence[TensorConfig],
    outputs: Sequence[TensorConfig],
    **config: Any,
) -> Model:
    """A Triton python-backend model (``TritonPythonModel``-style class) defined in Python;
    ``config``: further `ModelConfig` fields (``max_batch_size``, ``dynamic_batching``...)."""
    made = ModelConfig(
        name=name, backend="python", input=tuple(inputs), output=tuple(outputs), **config
    )
    return Model(config=made, triton_model=cls)


def step(
    model_name: str, inputs: Mapping[str, str], outputs: Mapping[str, str], version: int = -1
) -> EnsembleStep:
    """An ensemble step: ``inputs`` maps model inputs to tensors, ``outputs`` model outputs to
    tensors."""
    return EnsembleStep(
        model_name=model_name,
        model_version=version,
        input_map=dict(inputs),
        output_map=dict(outputs),
    )


def ensemble(
    name: str,
    inputs: Sequence[TensorConfig],
    outputs: Sequence[TensorConfig],
    steps: Sequence[EnsembleStep],
    *,
    max_inflight_requests: int = 0,
    max_batch_size: int = 0,
    parameters: Mapping[str, str] | None = None,
) -> Model:
    """An ensemble definition; ``parameters``: its control flow (docs/guide.md, "Control
    flow") and other parameters."""
    return Model(
        config=ModelConfig(
            name=name,
            platform="ensemble",
            max_batch_size=max_batch_size,
            input=tuple(inputs),
            output=tuple(outputs),
            ensemble_scheduling=EnsembleScheduling(
                step=tuple(steps), max_inflight_requests=max_inflight_requests
            ),
            parameters=dict(parameters or {}),
        )
    )


class StepRecorder(Observer):
    """Records composing requests and the peak number of in-flight requests per step."""

    def __init__(self) -> None:
        """Nothing recorded yet."""
        self.requests: list[tuple[str, int, Any]] = []
        self.in_flight: dict[tuple[str, int], int] = {}
        self.peak: dict[tuple[str, int], int] = {}
        self.finished: list[tuple[str, int, BaseException | None]] = []

    def step_started(
        self, ensemble: str, step: int, model_name: str, request: InferRequest
    ) -> None:
        """Record the request and the step's new in-flight count."""
        key = (ensemble, step)
        self.requests.append((ensemble, step, request))
        self.in_flight[key] = self.in_flight.get(key, 0) + 1
        self.peak[key] = max(self.peak.get(key, 0), self.in_flight[key])

    def step_finished(
        self,
        ensemble: str,
        step: int,
        model_name: str,
        request: InferRequest,
        error: BaseException | None,
    ) -> None:
        """Record the outcome; the step has one request fewer in flight."""
        self.in_flight[(ensemble, step)] -= 1
        self.finished.append((ensemble, step, error))


def gated(name: str, gate: trio.Event, count: int = 8) -> Model:
    """An async identity model that waits for ``gate`` (never blocks the event loop)."""

    async def execute(X: Any) -> dict[str, Any]:
        await gate.wait()
        return {"Y": X}

    return model(name, execute, [tensor("X")], [tensor("Y")], jit=False, count=count)


def double(name: str = "double", *, jit: bool = True) -> Model:
    """``Y = X * 2``."""
    return model(name, lambda X: {"Y": X * 2}, [tensor("X")], [tensor("Y")], jit=jit)


def plus_one(name: str) -> Model:
    """``Y = X + 1``, plain Python (so it runs inline)."""
    return model(name, lambda X: {"Y": X + 1}, [tensor("X")], [tensor("Y")], jit=False)


def decoupled(name: str, execute: Callable[..., Any], dims: Sequence[int] = (1,)) -> Model:
    """A decoupled plain-Python model X -> Y (FP32 of ``dims``): ``execute`` is a generator or
    an async generator, each item it yields one response."""
    m = model(name, execute, [tensor("X", dims=dims)], [tensor("Y", dims=dims)], jit=False)
    policy = ModelTransactionPolicy(decoupled=True)
    return attrs.evolve(m, config=attrs.evolve(m.config, model_transaction_policy=policy))


def chain(name: str, first: str, second: str, **kw: Any) -> Model:
    """An ensemble running ``first`` then ``second`` (both X -> Y)."""
    return ensemble(
        name,
        [tensor("IN")],
        [tensor("OUT")],
        [step(first, {"X": "IN"}, {"Y": "mid"}), step(second, {"X": "mid"}, {"Y": "OUT"})],
        **kw,
    )


async def outcome(server: AsyncServer, into: list[Any], *args: Any, **kw: Any) -> None:
    """Run one request and record its response or its error."""
    try:
        into.append(await server.infer(*args, **kw))
    except Exception as exc:
        into.append(exc)


def assert_idle(server: AsyncServer, *ensembles: str) -> None:
    """Every counter is back at rest: steps, slots, pending counts, model queues, busy flags."""
    for name in ensembles:
        for step_stats in server.step_statistics(name):
            assert (step_stats.queued, step_stats.in_flight) == (0, 0), step_stats
        for s in inside(server).steps(name):
            if s.slots is not None:  # the actor holds one slot while it waits to receive
                assert s.slots.value >= s.capacity - 1, (name, s.plan.index, s.slots.value)
    for stats in server.model_statistics():
        assert stats.pending_request_count == 0, stats
    for name, _, runner in inside(server).loaded():
        if not isinstance(runner, EnsembleRunner):
            assert runner.queued == 0, name
            assert not any(i.busy for i in runner.instances), name


def cached(definition: Model, enable: bool = True) -> Model:
    """``definition`` with ``response_cache { enable: ... }``."""
    config = attrs.evolve(definition.config, response_cache=ResponseCache(enable=enable))
    return attrs.evolve(definition, config=config)


def with_fusion(definition: Model, mode: str) -> Model:
    """``definition`` (an ensemble) with ``parameters { fusion: mode }`` (on, xla, off)."""
    config = attrs.evolve(definition.config, parameters={"fusion": mode})
    return attrs.evolve(definition, config=config)


def fused(server: AsyncServer, name: str = "pipe") -> bool:
    """Whether the ensemble ``name`` has run a request fused (mode "xla": has compiled one)."""
    fusion = _fusion_of(server, name)
    if isinstance(fusion, ListedFusion):
        return fusion.announced
    return fusion is not None and (fusion._announced or bool(fusion._ready))


async def settled(server: AsyncServer, name: str = "pipe") -> bool:
    """`fused`, once the compilations started in the background are done (at most 30 s): a
    request for a new signature takes the scheduler's path while its fused call compiles."""
    with trio.fail_after(30):
        # A worker thread compiles: there is no event to wait on.
        while isinstance(f := _fusion_of(server, name), Fusion) and f._compiling:  # noqa: ASYNC110
            await trio.sleep(0.01)
    return fused(server, name)


async def infer_until_fused(
    server: AsyncServer, name: str, inputs: Mapping[str, Any], windows: int = 25
) -> bool:
    """Ask ``name`` with ``inputs`` until it has run fused (`settled`), at most ``windows``
    windows of executions; whether it did. Its steps run inline, and so fuse, once a window
    of their executions proves short: on a busy machine that can take more than one."""
    for _ in range(windows * SWITCH_WINDOW):
        await server.infer(name, dict(inputs))
        if await settled(server, name):
            return True
    return False


async def infer_until_inline(
    server: AsyncServer, name: str, inputs: Mapping[str, Any], model: str, windows: int = 25
) -> bool:
    """Ask ``name`` with ``inputs`` until every instance of ``model`` (``name`` itself or a
    step of it) runs inline on the event loop, at most ``windows`` windows of executions;
    whether they do. An instance starts in a worker thread when its warm-up was slow (a
    busy machine) and comes back inline once a window of its executions proves short."""
    for _ in range(windows * SWITCH_WINDOW):
        await server.infer(name, dict(inputs))
        if all(instance.inline for instance in inside(server).instances(model)):
            return True
    return False


def _fusion_of(server: AsyncServer, name: str) -> Fusion | ListedFusion | None:
    return inside(server).fusion(name)
