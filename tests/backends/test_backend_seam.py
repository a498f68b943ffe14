"""The backend seam on its own: what each backend loads, runs and declares, without a server.

These drive `orchestrion.backends` the way the runner does (load in a thread's place, build
the arguments, execute, stream), so a new backend can be held to the same contract."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import attrs
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import trio
import trio.lowlevel

from orchestrion.actors._instances import Instance, Instances, starts_inline
from orchestrion.actors._watchdog import LoopHolder, describe_holder, loop_holder
from orchestrion.backends import backend_for, forget_code, import_code_file
from orchestrion.backends._jax import JaxBackend, padded_sizes
from orchestrion.backends._python import PythonBackend
from orchestrion.protocols import (
    DynamicBatching,
    InferenceError,
    InferRequest,
    ModelLoadError,
    ModelTransactionPolicy,
    RequestOptions,
    SequenceBatching,
    TensorChecker,
)
from orchestrion.testing import model, tensor

ONE = (1,)


def _request(**inputs: Any) -> InferRequest:
    return InferRequest(model_name="m", inputs=inputs)


def test_a_jitted_model_is_compiled_and_timed_at_load_for_its_declared_shapes() -> None:
    m = model("m", lambda X: {"Y": X * 2}, [tensor("X", dims=(4,))], [tensor("Y", dims=(4,))])
    backend = backend_for(m)
    assert isinstance(backend, JaxBackend)
    assert backend.capabilities.compiles
    assert backend.capabilities.traceable
    assert not backend.variable_shapes
    (loaded,) = backend.load()
    x = np.arange(4, dtype=np.float32)
    assert backend.signature({"X": x}) in loaded.compiled  # compiled before the first request
    assert loaded.typical_ns is not None
    assert loaded.typical_ns > 0
    outputs, state = backend.execute(loaded, backend.arguments(_request(X=x), None, loaded))
    # Left on its device for the next jitted step, and computed by the time execute returns.
    assert isinstance(outputs["Y"], jax.Array)
    assert outputs["Y"].is_ready()
    np.testing.assert_array_equal(jax.device_get(outputs["Y"]), x * 2)
    assert state is None


def test_a_batching_jitted_model_compiles_every_size_it_pads_to() -> None:
    m = model(
        "m",
        lambda X: {"Y": X + 1},
        [tensor("X", dims=(2,))],
        [tensor("Y", dims=(2,))],
        max_batch_size=8,
    )
    m = attrs.evolve(
        m,
        config=attrs.evolve(m.config, dynamic_batching=DynamicBatching(preferred_batch_size=(3,))),
    )
    backend = backend_for(m)
    assert backend.capabilities.batching
    assert backend.variable_shapes
    assert backend.padded_sizes == padded_sizes(m.config) == (1, 2, 3, 4, 8)
    (loaded,) = backend.load()
    for size in backend.padded_sizes:
        assert backend.signature({"X": np.zeros((size, 2), np.float32)}) in loaded.compiled
    assert backend.signature({"X": np.zeros((5, 2), np.float32)}) not in loaded.compiled


def test_variable_shapes_compile_on_first_use_only() -> None:
    m = model("m", lambda X: {"Y": X}, [tensor("X", dims=(-1,))], [tensor("Y", dims=(-1,))])
    backend = backend_for(m)
    (loaded,) = backend.load()
    assert loaded.compiled == set()
    assert loaded.typical_ns is None
    # Unmeasured: it starts in a worker thread (the runner's policy).
    assert not starts_inline(Instance(loaded, False).mode, loaded)


def test_initialize_params_are_passed_first_and_a_failure_names_the_file() -> None:
    m = model(
        "m",
        lambda params, X: {"Y": X * params},
        [tensor("X", dims=ONE)],
        [tensor("Y", dims=ONE)],
        initialize=lambda config: jnp.float32(3.0),
    )
    backend = backend_for(m)
    (loaded,) = backend.load()
    x = np.ones(1, np.float32)
    outputs, _ = backend.execute(loaded, backend.arguments(_request(X=x), None, loaded))
    assert outputs["Y"].tolist() == [3.0]

    def broken(config: Any) -> Any:
        raise RuntimeError("no weights")

    failing = attrs.evolve(
        m, code=attrs.evolve(m.code, initialize=broken), source="/models/m/1/model.py"
    )
    with pytest.raises(
        ModelLoadError, match=r"/models/m/1/model.py .* initialize failed: RuntimeError: no weights"
    ):
        backend_for(failing).load()


def test_plain_python_gets_read_only_views_and_may_take_the_request() -> None:
    seen: list[Any] = []

    def execute(X: Any, request: Any) -> dict[str, Any]:
        seen.append((X.flags.writeable, request.request_id))
        return {"Y": X + 1}

    m = model("m", execute, [tensor("X", dims=ONE)], [tensor("Y", dims=ONE)], jit=False)
    backend = backend_for(m)
    assert isinstance(backend, PythonBackend)
    capabilities = backend.capabilities
    assert capabilities.takes_request
    assert not capabilities.compiles
    assert not capabilities.traceable
    assert not capabilities.batching
    (loaded,) = backend.load()
    x = np.zeros(1, np.float32)
    request = attrs.evolve(_request(X=x), options=RequestOptions(request_id="r-1"))
    outputs, _ = backend.execute(loaded, backend.arguments(request, None, loaded))
    assert seen == [(False, "r-1")]
    assert x.flags.writeable  # the caller's own array is untouched
    assert outputs["Y"].tolist() == [1.0]


async def test_an_async_model_is_awaited_on_the_event_loop() -> None:
    threads: list[int] = []

    async def execute(X: Any) -> dict[str, Any]:
        await trio.lowlevel.checkpoint()
        threads.append(threading.get_ident())
        return {"Y": X}

    m = model("m", execute, [tensor("X", dims=ONE)], [tensor("Y", dims=ONE)], jit=False)
    backend = backend_for(m)
    assert backend.capabilities.is_async
    (loaded,) = backend.load()
    args = backend.arguments(_request(X=np.ones(1, np.float32)), None, loaded)
    outputs, _ = await backend.execute_async(loaded, args)
    assert threads == [threading.get_ident()]
    assert outputs["Y"].tolist() == [1.0]


def test_a_stateful_models_new_state_is_its_own_copy() -> None:
    def execute(state: Any, X: Any) -> Any:
        total = state + X
        return {"Y": total}, total  # the same array as output and as state

    m = model("m", execute, [tensor("X", dims=ONE)], [tensor("Y", dims=ONE)], jit=False)
    m = attrs.evolve(
        m,
        config=attrs.evolve(m.config, sequence_batching=SequenceBatching()),
        code=attrs.evolve(m.code, initial_state=lambda config: np.zeros(1, np.float32)),
    )
    backend = backend_for(m)
    assert backend.capabilities.stateful
    (loaded,) = backend.load()
    args = backend.arguments(_request(X=np.ones(1, np.float32)), backend.initial_state(), loaded)
    outputs, state = backend.execute(loaded, args)
    assert state.tolist() == [1.0]
    assert outputs["Y"] is not state
    outputs["Y"][0] = 99  # the client's answer changing does not change the sequence
    assert state.tolist() == [1.0]


def test_a_decoupled_models_stream_yields_its_responses() -> None:
    def execute(X: Any) -> Any:
        for i in range(int(X[0])):
            yield {"Y": np.array([i], np.int32)}

    m = model(
        "m", execute, [tensor("X", "INT32", dims=ONE)], [tensor("Y", "INT32", dims=ONE)], jit=False
    )
    policy = ModelTransactionPolicy(decoupled=True)
    m = attrs.evolve(m, config=attrs.evolve(m.config, model_transaction_policy=policy))
    backend = backend_for(m)
    assert backend.capabilities.streaming
    assert not backend.capabilities.batching
    (loaded,) = backend.load()
    args = backend.arguments(_request(X=np.array([3], np.int32)), None, loaded)
    stream = backend.open_stream(loaded, args)
    assert [int(r["Y"][0]) for r in stream] == [0, 1, 2]  # type: ignore[union-attr]


def test_a_model_error_is_named_and_the_watchdog_sees_who_holds_the_loop() -> None:
    def execute(X: Any) -> dict[str, Any]:
        holder = loop_holder()
        assert holder.runs is not None
        raise ValueError(
            describe_holder(None, holder.runs) + "|" + holder.runs.holds_loop_as("x.py:1")
        )

    m = model("m", execute, [tensor("X", dims=ONE)], [tensor("Y", dims=ONE)], jit=False)
    backend = backend_for(m)
    pool = Instances(backend, "m", 1, TensorChecker(m.config))
    pool.load()
    (instance,) = pool.all
    with pytest.raises(
        InferenceError, match=r"model 'm' \(version 1\) failed: ValueError: "
    ) as info:
        pool.run_inline(instance, _request(X=np.ones(1, np.float32)), None)
    assert "model 'm' (version 1) running inline, at x.py:1" in str(info.value)
    assert 'string_value: "thread"' in str(info.value)  # what to do about it
    assert loop_holder().runs is None  # cleared once it returned
    assert isinstance(loop_holder(), LoopHolder)


def test_importing_a_code_file_names_it_and_leaves_no_module_behind(tmp_path: Path) -> None:
    """A code file is a module under a package of its own while its model is loaded, and
    leaves nothing in sys.modules once forgotten (or when its import fails)."""
    import sys

    good = tmp_path / "good.py"
    good.write_text("VALUE = 42\n")
    module = import_code_file(good, "good_v1")
    assert module.VALUE == 42
    package = module.__name__.rpartition(".")[0]
    assert module.__name__.startswith("_orchestrion_models.m")
    assert sys.modules[module.__name__] is module
    forget_code(module)
    assert [n for n in sys.modules if n.startswith(package)] == []
    bad = tmp_path / "bad.py"
    bad.write_text("raise ImportError('no tokenizer here')\n")
    with pytest.raises(
        ModelLoadError, match=r"bad.py: import failed: ImportError: no tokenizer here"
    ):
        import_code_file(bad, "bad_v1")
    assert [n for n in sys.modules if n.startswith("_orchestrion_models.") and "bad_v1" in n] == []
