"""Fusion against the scheduler's path (``parameters={"fusion": "off"}``): each test runs
both and compares what a client sees. Written by a reviewer to find differences; each
difference found (input dims of composing models, last-bit numerics of whole-graph
compilation, unloads, reloads and timeouts during a compilation, steps whose input never
arrives, statistics of requests past their deadline) was fixed, and its test stays.

Every pipeline is built afresh per server (new function objects): JAX caches traces per
function, and a trace cached by an earlier server would hide the compile-time effects some of
these tests depend on.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import attrs
import jax.numpy as jnp
import numpy as np
import pytest
import trio

import orchestrion
from orchestrion import InferenceError, InferenceTimeoutError, StepRefusedError
from orchestrion.actors._instances import SWITCH_WINDOW
from orchestrion.protocols import DynamicBatching
from orchestrion.testing import (
    cached,
    chain,
    double,
    ensemble,
    fused,
    model,
    settled,
    step,
    tensor,
    with_fusion,
)

MODES = ("on", "off")
INLINE = {"execution": "inline"}


def _counts(server: orchestrion.AsyncServer) -> dict[tuple[str, int], tuple[int, ...]]:
    return {
        (s.name, s.version): (
            s.inference_count,
            s.execution_count,
            s.inference_stats.success.count,
            s.inference_stats.fail.count,
        )
        for s in server.model_statistics()
    }


def _variable_pair(
    fusion: str, *, slow_first: bool = False, slow_second: bool = False
) -> list[orchestrion.Model]:
    """a (Y = 2X) then b (S = -X), all dims [-1]. A slow step sleeps 0.4 s whenever JAX
    traces it for 20 elements: a compilation for that shape that takes long."""

    def a(X: Any) -> dict[str, Any]:
        if slow_first and X.shape[0] == 20:
            time.sleep(0.4)
        return {"Y": X * 2}

    def b(X: Any) -> dict[str, Any]:
        if slow_second and X.shape[0] == 20:
            time.sleep(0.4)
        return {"S": -X}

    var = (-1,)
    pipe = ensemble(
        "pipe",
        [tensor("IN", dims=var)],
        [tensor("OUT", dims=var)],
        [step("a", {"X": "IN"}, {"Y": "mid"}), step("b", {"X": "mid"}, {"S": "OUT"})],
    )
    return [
        model("a", a, [tensor("X", dims=var)], [tensor("Y", dims=var)]),
        model("b", b, [tensor("X", dims=var)], [tensor("S", dims=var)]),
        with_fusion(pipe, fusion),
    ]


async def _warm(server: orchestrion.AsyncServer, fusion: str) -> None:
    """Requests of 16 elements until the instances run inline (at least two windows of
    executions: the instances start in a thread, the first call compiles) and, with fusion,
    fused. A busy machine may make every call of a window slow: at most 25 windows."""
    for calls in range(1, 25 * SWITCH_WINDOW + 1):
        await server.infer("pipe", {"IN": np.ones(16, np.float32)})
        if calls >= 2 * SWITCH_WINDOW and (fusion == "off" or await settled(server)):
            break
    assert await settled(server) is (fusion == "on")


# -- differences found in review, now the same ---------------------------------------------


@pytest.mark.parametrize("fusion", MODES)
async def test_a_composing_models_input_dims_are_enforced(fusion: str) -> None:
    """The ensemble's input IN is [-1], classify's X is [16] (a valid wiring). A request of
    18 elements is refused at classify ("input 'X' has shape [18], expected [16]") on both
    paths (fused, classify has never compiled that shape: the scheduler runs it)."""
    classify = model(
        "classify",
        lambda X: {"C": jnp.stack([X[:8].sum(), X[8:].sum()])},
        [tensor("X", dims=(16,))],
        [tensor("C", dims=(2,))],
    )
    pipe = ensemble(
        "pipe",
        [tensor("IN", dims=(-1,))],
        [tensor("OUT", dims=(2,))],
        [step("classify", {"X": "IN"}, {"C": "OUT"})],
    )
    async with orchestrion.open_server(models=[classify, with_fusion(pipe, fusion)]) as server:
        await server.infer("pipe", {"IN": np.ones(16, np.float32)})
        with pytest.raises(InferenceError, match=r"input 'X' has shape \[18\], expected \[16\]"):
            await server.infer("pipe", {"IN": np.ones(18, np.float32)})


def _times_three(X: Any) -> dict[str, Any]:
    return {"Y": X * 3}


def _times_five(X: Any) -> dict[str, Any]:
    return {"Y": X * 5}


def _square(X: Any) -> dict[str, Any]:
    return {"Y": X * X}


def _minus_one(X: Any) -> dict[str, Any]:
    return {"Y": X - 1}


@pytest.mark.parametrize(
    ("dtype", "first", "second", "x"),
    [
        ("FP16", _times_three, _times_five, np.arange(16) / 7 + 1.1),
        ("FP32", _times_three, _times_five, np.arange(16) / 7 + 1.1),
        ("FP32", _square, _minus_one, 1 + np.arange(16) * 1e-4),
    ],
    ids=["fp16-excess-precision", "fp32-reassociation", "fp32-fma"],
)
async def test_fused_numerics_match_the_scheduler_bit_for_bit(
    dtype: str, first: Callable[..., Any], second: Callable[..., Any], x: np.ndarray
) -> None:
    """Two steps, the intermediate declared FP16/FP32. The scheduler rounds the intermediate
    to its declared type between the steps; so does the default fusion, which calls each
    step's own executable (a whole-graph compilation, "xla", would keep FP16 in excess
    precision, turn x*3*5 into x*15 and x*x-1 into an FMA). The same bits."""
    outputs = {}
    for fusion in MODES:
        # Fresh functions per server (JAX caches traces per function object). Inline by
        # configuration: on a loaded machine the warm-up's timing could put a step in a
        # thread, and fusion (which this compares) only fuses inline steps.
        inline = {"execution": "inline"}
        a = model(
            "a",
            lambda X, f=first: f(X),
            [tensor("X", dtype)],
            [tensor("Y", dtype)],
            parameters=inline,
        )
        b = model(
            "b",
            lambda X, f=second: f(X),
            [tensor("X", dtype)],
            [tensor("Y", dtype)],
            parameters=inline,
        )
        pipe = with_fusion(
            ensemble(
                "pipe",
                [tensor("IN", dtype)],
                [tensor("OUT", dtype)],
                [step("a", {"X": "IN"}, {"Y": "mid"}), step("b", {"X": "mid"}, {"Y": "OUT"})],
            ),
            fusion,
        )
        async with orchestrion.open_server(models=[a, b, pipe]) as server:
            value = x.astype(tensor("IN", dtype).data_type.numpy_dtype)
            await server.infer("pipe", {"IN": value})  # compiles (fused: in the background)
            assert await settled(server) is (fusion == "on")
            response = await server.infer("pipe", {"IN": value})
            outputs[fusion] = response.outputs["OUT"]
    np.testing.assert_array_equal(outputs["on"], outputs["off"])


@pytest.mark.parametrize("fusion", MODES)
async def test_unloading_the_ensemble_waits_for_a_request_being_compiled(fusion: str) -> None:
    """A request for a new shape (20) whose compilation takes 0.4 s; the ensemble is
    unloaded meanwhile. The scheduler counts the run as active: unload waits and the request
    is answered ("running requests finish first"), fused or not."""
    async with orchestrion.open_server(models=_variable_pair(fusion, slow_second=True)) as server:
        await _warm(server, fusion)
        got: list[Any] = []

        async def request() -> None:
            try:
                got.append(await server.infer("pipe", {"IN": np.ones(20, np.float32)}))
            except Exception as exc:
                got.append(exc)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(request)
            await trio.sleep(0.1)  # inside the 0.4 s compilation
            await server.unload_model("pipe")
            answered_before_unload_returned = bool(got)
        assert len(got) == 1
        assert not isinstance(got[0], Exception), got[0]
        np.testing.assert_allclose(got[0].outputs["OUT"], -2 * np.ones(20))
        assert answered_before_unload_returned


@pytest.mark.parametrize("fusion", MODES)
async def test_a_model_reloaded_during_a_compile_is_not_run_afterwards(fusion: str) -> None:
    """A request for a new shape (20) compiles for 0.4 s (step a); meanwhile b is reloaded
    as S = 10X, and the reload completes. The scheduler resolves b when its step runs: the
    answer comes from the new b (20), fused or not."""
    models = _variable_pair(fusion, slow_first=True)
    async with orchestrion.open_server(models=models) as server:
        await _warm(server, fusion)
        got: list[Any] = []

        async def request() -> None:
            got.append(await server.infer("pipe", {"IN": np.ones(20, np.float32)}))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(request)
            await trio.sleep(0.1)  # inside the 0.4 s compilation of a
            var = (-1,)
            new_b = model(
                "b", lambda X: {"S": X * 10}, [tensor("X", dims=var)], [tensor("S", dims=var)]
            )
            await server.load_model(new_b)
            assert not got  # the reload finished first
    np.testing.assert_allclose(got[0].outputs["OUT"], np.full(20, 20, np.float32))


@pytest.mark.parametrize("fusion", MODES)
async def test_a_timeout_fires_while_a_new_shape_compiles(fusion: str) -> None:
    """timeout=0.1 on a request for a new shape whose compilation takes 0.4 s. The
    scheduler compiles in the step's worker thread while the client waits in a cancellable
    wait: InferenceTimeoutError after ~0.1 s ("waits ... are cancelled at once"), fused or
    not (a new shape never makes a request wait for a fused compilation)."""
    async with orchestrion.open_server(models=_variable_pair(fusion, slow_first=True)) as server:
        await _warm(server, fusion)
        started = trio.current_time()
        with pytest.raises(InferenceTimeoutError):
            await server.infer("pipe", {"IN": np.ones(20, np.float32)}, timeout=0.1)
        assert trio.current_time() - started < 0.35


def _leaves_out_z(X: Any) -> dict[str, Any]:
    return {"Y": X * 2}  # Z is declared but left out (allowed: the next step runs without it)


def _optional_b(A: Any, B: Any = None) -> dict[str, Any]:
    return {"O": A if B is None else A + B}


def _left_out_pipe(fusion: str, *, optional: bool) -> list[orchestrion.Model]:
    """a declares Y and Z but returns only Y; b takes Y and Z (``optional`` or not) and
    returns O = Y (+ Z). Both run inline: fusion only fuses inline steps."""
    inline = {"execution": "inline"}
    a = model(
        "a",
        lambda X: _leaves_out_z(X),
        [tensor("X")],
        [tensor("Y"), tensor("Z")],
        parameters=inline,
    )
    b = model(
        "b",
        lambda A, B=None: _optional_b(A, B),
        [tensor("A"), tensor("B", optional=optional)],
        [tensor("O")],
        parameters=inline,
    )
    pipe = ensemble(
        "pipe",
        [tensor("IN")],
        [tensor("OUT")],
        [
            step("a", {"X": "IN"}, {"Y": "y", "Z": "z"}),
            step("b", {"A": "y", "B": "z"}, {"O": "OUT"}),
        ],
    )
    return [a, b, with_fusion(pipe, fusion)]


async def test_a_step_whose_optional_input_was_left_out_runs_without_it() -> None:
    """As in Triton, b runs without the Z that a left out (OUT = Y), fused (in each mode,
    once its signature is ready) or not, and both count every request."""
    seen = {}
    for fusion in (*MODES, "xla"):
        async with orchestrion.open_server(models=_left_out_pipe(fusion, optional=True)) as server:
            outs = []
            for _ in range(10):  # bounded: a new signature compiles in the background
                response = await server.infer("pipe", {"IN": np.ones(16, np.float32)})
                outs.append(response.outputs["OUT"].tolist())
                if len(outs) >= 3 and (fusion == "off" or await settled(server)):
                    break
            counts = [server.model_statistics(m)[0].inference_count for m in "ab"]
            seen[fusion] = (outs, counts, fused(server))
    off_outs, off_counts, off_fused = seen["off"]
    assert off_outs == [[2.0] * 16] * 3
    assert off_counts == [3, 3]
    assert not off_fused
    for fusion in ("on", "xla"):
        outs, counts, was_fused = seen[fusion]
        assert was_fused, fusion
        assert outs == [[2.0] * 16] * len(outs)
        assert counts == [len(outs)] * 2


@pytest.mark.parametrize("fusion", [*MODES, "xla"])
async def test_a_step_whose_required_input_was_left_out_is_refused(fusion: str) -> None:
    """b requires the Z that a left out: the scheduler's error, fused or not, naming the
    missing input and the step that left it out; b counts a refused request, not a run."""
    async with orchestrion.open_server(models=_left_out_pipe(fusion, optional=False)) as server:
        for _ in range(3):
            with pytest.raises(InferenceError) as refused:
                await server.infer("pipe", {"IN": np.ones(16, np.float32)})
            await settled(server)
        assert isinstance(refused.value, StepRefusedError)
        message = str(refused.value)
        assert message.startswith("in ensemble 'pipe', step[1]: model 'b'")
        assert "missing required input 'B'" in message
        assert "(tensor 'z': step[0]'s model 'a' left its output 'Z' out)" in message
        b = server.model_statistics("b")[0]
        assert (b.inference_count, b.inference_stats.fail.count) == (0, 3)
        assert not fused(server)


def _batching_chain(fusion: str) -> list[orchestrion.Model]:
    """a (2X) then b (X+1), max_batch_size 8, dynamic batching without queue delay."""
    batching = DynamicBatching()
    models = []
    for name, fn in (("a", lambda X: {"Y": X * 2}), ("b", lambda X: {"Y": X + 1})):
        m = model(name, fn, [tensor("X")], [tensor("Y")], max_batch_size=8)
        config = attrs.evolve(m.config, dynamic_batching=batching)
        models.append(attrs.evolve(m, config=config))
    return [*models, with_fusion(chain("pipe", "a", "b", max_batch_size=8), fusion)]


@pytest.mark.parametrize("fusion", MODES)
async def test_a_gathered_request_past_its_deadline_is_not_counted_by_its_steps(
    fusion: str,
) -> None:
    """Batching steps, a request whose deadline has passed. The scheduler queues it for a's
    batcher, the client's wait is cancelled at once and no step runs: a and b count
    nothing; the gathering fused call drops it before it joins a batch."""
    async with orchestrion.open_server(models=_batching_chain(fusion)) as server:
        x = np.ones((2, 16), np.float32)
        for _ in range(3):
            await server.infer("pipe", {"IN": x})
        assert await settled(server) is (fusion == "on")
        before = _counts(server)
        with pytest.raises(InferenceTimeoutError):
            await server.infer("pipe", {"IN": x}, timeout=1e-9)
        await trio.sleep(0.05)
        after = _counts(server)
    assert after[("a", 1)] == before[("a", 1)]
    assert after[("b", 1)] == before[("b", 1)]


@pytest.mark.parametrize("fusion", MODES)
async def test_statistics_show_a_request_that_is_being_compiled(fusion: str) -> None:
    """While a request for a new shape compiles (0.4 s in step a), the scheduler shows it:
    a's pending_request_count is 1 and step 0 has one request in flight, fused or not."""
    async with orchestrion.open_server(models=_variable_pair(fusion, slow_first=True)) as server:
        await _warm(server, fusion)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.infer, "pipe", {"IN": np.ones(20, np.float32)})
            await trio.sleep(0.15)
            pending = server.model_statistics("a")[0].pending_request_count
            in_flight = server.step_statistics("pipe")[0].in_flight
        assert (pending, in_flight) == (1, 1)


# -- properties that hold -------------------------------------------------------------------


async def test_batches_params_a_shared_model_and_response_metadata_match() -> None:
    """max_batch_size 8, batches of 3, 5 and 1; the same model (with initialize params) in
    two steps, its first output also an ensemble output. Outputs, dtypes, flags, response
    metadata (version, request_id, sequence parameters) and every count agree."""
    results = {}
    for fusion in MODES:
        a = model(
            "a",
            lambda p, X: {"Y": X * p["w"] + p["b"]},
            [tensor("X")],
            [tensor("Y")],
            max_batch_size=8,
            initialize=lambda c: {"w": np.float32(2), "b": np.arange(16, dtype=np.float32)},
        )
        pipe = ensemble(
            "pipe",
            [tensor("IN")],
            [tensor("OUT"), tensor("MID")],
            [step("a", {"X": "IN"}, {"Y": "MID"}), step("a", {"X": "MID"}, {"Y": "OUT"})],
            max_batch_size=8,
        )
        async with orchestrion.open_server(models=[a, with_fusion(pipe, fusion)]) as server:
            responses = []
            for n in (3, 3, 5, 5, 1):
                x = np.arange(n * 16, dtype=np.float32).reshape(n, 16)
                responses.append(
                    await server.infer("pipe", {"IN": x}, request_id=f"r{n}", sequence_id=5)
                )
            assert await settled(server) is (fusion == "on")
            results[fusion] = (
                [
                    (
                        r.model_name,
                        r.model_version,
                        r.request_id,
                        dict(r.parameters),
                        {k: (v.tolist(), v.dtype, v.flags.writeable) for k, v in r.outputs.items()},
                    )
                    for r in responses
                ],
                _counts(server),
            )
    assert results["on"] == results["off"]
    assert results["on"][1][("a", 1)] == (34, 10, 10, 0)


async def test_pinned_version_dtypes_nan_and_metrics_match() -> None:
    """A step pinned to version 1 while version 2 is loaded; outputs BOOL, FP16, INT8,
    UINT16 from an input holding a NaN. The same values and dtypes, version 1 counts the
    requests, and the Prometheus counters agree."""
    results = {}
    for fusion in MODES:
        outs = [
            tensor("B", "BOOL"),
            tensor("H", "FP16"),
            tensor("I", "INT8"),
            tensor("U", "UINT16"),
        ]

        def mixed(X: Any) -> dict[str, Any]:
            return {
                "B": X > 0,
                "H": X.astype(jnp.float16),
                "I": X.astype(jnp.int8),
                "U": jnp.abs(X * 100).astype(jnp.uint16),
            }

        v1 = model("m", mixed, [tensor("X")], outs, version=1)
        v2 = model("m", lambda X: {"B": X < 0}, [tensor("X")], outs, version=2)
        pipe = ensemble(
            "pipe",
            [tensor("IN")],
            outs,
            [step("m", {"X": "IN"}, {n: n for n in "BHIU"}, version=1)],
        )
        async with orchestrion.open_server(models=[v1, v2, with_fusion(pipe, fusion)]) as server:
            x = np.linspace(-2, 2, 16).astype(np.float32)
            x[3] = np.nan
            for _ in range(3):
                response = await server.infer("pipe", {"IN": x})
            assert await settled(server) is (fusion == "on")
            metrics = sorted(
                line
                for line in server.metrics_text().splitlines()
                if line.startswith(("nv_inference_count", "nv_inference_exec_count"))
                or line.startswith(("nv_inference_request_success", "nv_inference_request_fail"))
            )
            results[fusion] = (
                {k: (v.dtype, v.tolist()) for k, v in sorted(response.outputs.items())},
                _counts(server),
                metrics,
            )
    assert repr(results["on"]) == repr(results["off"])  # repr: NaN compares unequal
    assert results["on"][1][("m", 1)] == (3, 3, 3, 0)
    assert results["on"][1][("m", 2)] == (0, 0, 0, 0)


async def test_cache_nesting_limits_and_threads_match() -> None:
    """A cached fused ensemble (hits and misses), a fused ensemble nested in another, an
    ensemble with max_inflight_requests=1 under 20 concurrent requests, and a chain whose
    second model runs in a worker thread (not fused): the same answers and counts."""
    results = {}
    for fusion in MODES:
        threaded = model(
            "t",
            lambda X: {"Y": X * 2},
            [tensor("X")],
            [tensor("Y")],
            parameters={"execution": "thread"},
        )
        models = [
            double("d1"),
            double("d2"),
            threaded,
            with_fusion(cached(chain("cached", "d1", "d2")), fusion),
            with_fusion(chain("inner", "d1", "d2"), fusion),
            ensemble(
                "outer",
                [tensor("IN")],
                [tensor("OUT")],
                [
                    step("inner", {"IN": "IN"}, {"OUT": "mid"}),
                    step("d2", {"X": "mid"}, {"Y": "OUT"}),
                ],
            ),
            with_fusion(chain("limited", "d1", "d2", max_inflight_requests=1), fusion),
            with_fusion(chain("mixed", "d1", "t"), fusion),
        ]
        async with orchestrion.open_server(
            models=models, cache_config=["local,size=1048576"]
        ) as server:
            answers: dict[tuple[str, int], float] = {}

            async def one(
                name: str, i: int, answers: dict[tuple[str, int], float] = answers
            ) -> None:
                x = np.full(16, i % 4, np.float32)
                response = await server.infer(name, {"IN": x})
                answers[(name, i)] = float(response.outputs["OUT"][0])

            async with trio.open_nursery() as nursery:
                for i in range(20):
                    for name in ("outer", "limited", "mixed"):
                        nursery.start_soon(one, name, i)
            for i in range(6):
                await one("cached", i)
            assert fused(server, "inner") is (fusion == "on")
            assert fused(server, "limited") is (fusion == "on")
            assert not fused(server, "mixed")
            cache = server.model_statistics("cached")[0].inference_stats
            results[fusion] = (
                answers,
                (cache.cache_hit.count, cache.cache_miss.count),
                {k: v[0] for k, v in _counts(server).items()},
            )
    assert results["on"] == results["off"]
    assert results["on"][1] == (2, 4)
    factor = {"outer": 8, "limited": 4, "mixed": 4, "cached": 4}
    assert all(v == (i % 4) * factor[n] for (n, i), v in results["on"][0].items())


@pytest.mark.parametrize("batching", [False, True])
async def test_a_step_output_over_max_batch_size_fails_as_without_fusion(batching: bool) -> None:
    """A step that returns twice the rows it got (more than max_batch_size 4): the same error
    with and without fusion (the fused check refuses outputs whose rows differ)."""
    errors = {}
    for fusion in MODES:
        a = model(
            "a",
            lambda X: {"Y": jnp.concatenate([X, X])},
            [tensor("X")],
            [tensor("Y")],
            max_batch_size=4,
        )
        if batching:
            config = attrs.evolve(a.config, dynamic_batching=DynamicBatching())
            a = attrs.evolve(a, config=config)
        pipe = ensemble(
            "pipe",
            [tensor("IN")],
            [tensor("OUT")],
            [step("a", {"X": "IN"}, {"Y": "OUT"})],
            max_batch_size=4,
        )
        async with orchestrion.open_server(models=[a, with_fusion(pipe, fusion)]) as server:
            with pytest.raises(InferenceError) as caught:
                await server.infer("pipe", {"IN": np.ones((3, 16), np.float32)})
            errors[fusion] = str(caught.value)
    assert errors["on"] == errors["off"]
    assert "has batch size" in errors["on"]


async def test_an_expired_unbatched_request_counts_the_same() -> None:
    """Without batching, a request whose deadline has passed: both paths run the steps
    inline (uninterruptible), count them, and report a timeout."""
    counts = {}
    for fusion in MODES:
        # Inline by configuration: on a loaded machine the warm-up's timing could put a step
        # in a thread, where the unfused path sees the deadline before the step runs.
        steps = [
            model(name, lambda X: {"Y": X * 2}, [tensor("X")], [tensor("Y")], parameters=INLINE)
            for name in ("d1", "d2")
        ]
        pipe = with_fusion(chain("pipe", "d1", "d2"), fusion)
        async with orchestrion.open_server(models=[*steps, pipe]) as server:
            await server.infer("pipe", {"IN": np.ones(16, np.float32)})
            with pytest.raises(InferenceTimeoutError):
                await server.infer("pipe", {"IN": np.ones(16, np.float32)}, timeout=1e-9)
            assert await settled(server) is (fusion == "on")
            counts[fusion] = _counts(server)
    assert counts["on"] == counts["off"]


def test_the_blocking_server_runs_fused() -> None:
    """orchestrion.Server (the blocking wrapper): the same answers and counts."""
    counts = {}
    for fusion in MODES:
        pipe = with_fusion(chain("pipe", "d1", "d2"), fusion)
        with orchestrion.Server(models=[double("d1"), double("d2"), pipe]) as server:
            for i in range(5):
                response = server.infer("pipe", {"IN": np.full(16, i, np.float32)})
                np.testing.assert_array_equal(response.outputs["OUT"], np.full(16, 4 * i))
            counts[fusion] = {(s.name, s.inference_count) for s in server.model_statistics()}
    assert counts["on"] == counts["off"]
