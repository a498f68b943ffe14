"""Ensembles run as trio actors: results, shapes, pruning, concurrency, errors, cancellation."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import trio
import trio.testing

import orchestrion
import orchestrion.protocols
from orchestrion.testing import StepRecorder, ensemble, model, step, tensor

X = np.arange(16, dtype=np.float32).reshape(1, 16)
ROW = (1, 16)


def seed_pipeline(max_inflight_requests: int = 0) -> list[orchestrion.Model]:
    """The seed shape: preprocess, then classify and segment in parallel."""
    return [
        model("pre", lambda X: {"Y": X * 2 + 1}, [tensor("X", dims=ROW)], [tensor("Y", dims=ROW)]),
        model(
            "sum", lambda X: {"S": X.sum(axis=1)}, [tensor("X", dims=ROW)], [tensor("S", dims=(1,))]
        ),
        model(
            "center",
            lambda X: {"C": X - X.mean()},
            [tensor("X", dims=ROW)],
            [tensor("C", dims=ROW)],
        ),
        ensemble(
            "pipeline",
            [tensor("IN", dims=ROW)],
            [tensor("SUM", dims=(1,)), tensor("CENTERED", dims=ROW)],
            [
                step("pre", {"X": "IN"}, {"Y": "mid"}),
                step("sum", {"X": "mid"}, {"S": "SUM"}),
                step("center", {"X": "mid"}, {"C": "CENTERED"}),
            ],
            max_inflight_requests=max_inflight_requests,
        ),
    ]


def executions(server: orchestrion.AsyncServer, name: str) -> int:
    return server.model_statistics(name)[0].execution_count


async def test_fan_out_pipeline_matches_numpy() -> None:
    """The seed pipeline's outputs equal the same computation in numpy."""
    async with orchestrion.open_server(models=seed_pipeline()) as server:
        response = await server.infer("pipeline", {"IN": X}, request_id="r1")
    mid = X * 2 + 1
    np.testing.assert_allclose(response.outputs["SUM"], mid.sum(axis=1))
    np.testing.assert_allclose(response.outputs["CENTERED"], mid - mid.mean())
    assert response.request_id == "r1"
    assert response.model_name == "pipeline"
    assert response.model_version == 1


async def test_chain_and_fan_in() -> None:
    """A chain feeding two branches that join again computes the right value."""
    models = [
        model("a", lambda X: {"Y": X + 1}, [tensor("X")], [tensor("Y")]),
        model("b", lambda X: {"Y": X * 3}, [tensor("X")], [tensor("Y")]),
        model("c", lambda X: {"Y": X - 2}, [tensor("X")], [tensor("Y")]),
        model("join", lambda L, R: {"Y": L * R}, [tensor("L"), tensor("R")], [tensor("Y")]),
        ensemble(
            "diamond",
            [tensor("IN")],
            [tensor("OUT")],
            [
                step("a", {"X": "IN"}, {"Y": "t1"}),
                step("b", {"X": "t1"}, {"Y": "left"}),
                step("c", {"X": "t1"}, {"Y": "right"}),
                step("join", {"L": "left", "R": "right"}, {"Y": "OUT"}),
            ],
        ),
    ]
    x = np.linspace(-1, 1, 16, dtype=np.float32)
    async with orchestrion.open_server(models=models) as server:
        out = (await server.infer("diamond", {"IN": x})).outputs["OUT"]
    np.testing.assert_allclose(out, ((x + 1) * 3) * ((x + 1) - 2), rtol=1e-6)


NUMERIC = ["BOOL", "UINT8", "UINT16", "UINT32", "INT8", "INT16", "INT32", "FP16", "FP32", "BF16"]
WIDE = ["UINT64", "INT64", "FP64"]


def _sample(dtype: str) -> np.ndarray:
    np_dtype = orchestrion.DataType[dtype].numpy_dtype
    if dtype == "BYTES":
        return np.array([b"a", b"\x00\xff", "\u00e9".encode(), b""], dtype=object)
    if dtype == "BOOL":
        return np.array([True, False, True, True])
    return np.array([0, 1, 2, 3], dtype=np_dtype)


@pytest.mark.parametrize(
    ("dtype", "jit"),
    [(d, True) for d in [*NUMERIC, *WIDE]] + [(d, False) for d in [*NUMERIC, *WIDE, "BYTES"]],
)
async def test_every_data_type_flows_through_an_ensemble(dtype: str, jit: bool) -> None:
    """Every Triton data type passes through a two-step ensemble unchanged (jitted where JAX can)."""
    t_in, t_out = tensor("X", dtype, dims=(4,)), tensor("Y", dtype, dims=(4,))

    def identity(X):
        return {"Y": X}

    models = [
        model("first", identity, [t_in], [t_out], jit=jit),
        model("second", identity, [t_in], [t_out], jit=jit),
        ensemble(
            "both",
            [tensor("IN", dtype, dims=(4,))],
            [tensor("OUT", dtype, dims=(4,))],
            [step("first", {"X": "IN"}, {"Y": "mid"}), step("second", {"X": "mid"}, {"Y": "OUT"})],
        ),
    ]
    sample = _sample(dtype)
    async with orchestrion.open_server(models=models) as server:
        out = (await server.infer("both", {"IN": sample})).outputs["OUT"]
    assert out.dtype == orchestrion.DataType[dtype].numpy_dtype
    assert list(out) == list(sample)


async def test_bf16_values_survive_jit() -> None:
    """BF16 arithmetic in a jitted model returns bfloat16 arrays with the right values."""
    t = [tensor("X", "BF16", dims=(3,))], [tensor("Y", "BF16", dims=(3,))]
    models = [model("double", lambda X: {"Y": X * 2}, *t)]
    x = np.array([1.5, -2.0, 0.25], dtype=ml_dtypes.bfloat16)
    async with orchestrion.open_server(models=models) as server:
        y = (await server.infer("double", {"X": x})).outputs["Y"]
    assert y.dtype == ml_dtypes.bfloat16
    assert y.astype(np.float32).tolist() == [3.0, -4.0, 0.5]


async def test_pruning_skips_unrequested_branch() -> None:
    """Asking for one output runs only the steps leading to it."""
    async with orchestrion.open_server(models=seed_pipeline()) as server:
        response = await server.infer("pipeline", {"IN": X}, outputs=["SUM"])
        assert set(response.outputs) == {"SUM"}
        assert executions(server, "pre") == 1
        assert executions(server, "sum") == 1
        assert executions(server, "center") == 0


def _sleeper(
    name: str, seconds: float, log: list[tuple[str, float]] | None = None
) -> orchestrion.Model:
    async def execute(X):
        if log is not None:
            log.append((name, trio.current_time()))
        await trio.sleep(seconds)
        return {"Y": X}

    return model(name, execute, [tensor("X")], [tensor("Y")], jit=False, count=64)


def _two_branches(max_inflight_requests: int = 0) -> list[orchestrion.Model]:
    return [
        _sleeper("left", 1.0),
        _sleeper("right", 1.0),
        ensemble(
            "branches",
            [tensor("IN")],
            [tensor("L"), tensor("R")],
            [step("left", {"X": "IN"}, {"Y": "L"}), step("right", {"X": "IN"}, {"Y": "R"})],
            max_inflight_requests=max_inflight_requests,
        ),
    ]


async def test_independent_branches_run_concurrently(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Two branches that each sleep 1 s finish together in 1 s, not 2 s."""
    async with orchestrion.open_server(models=_two_branches()) as server:
        start = trio.current_time()
        await server.infer("branches", {"IN": np.zeros(16, np.float32)})
        assert trio.current_time() - start == pytest.approx(1.0)


async def test_error_in_a_branch_gives_exactly_one_error() -> None:
    """A failing branch yields one error naming ensemble and model; the next request succeeds."""

    def explode(X):
        if X[0] < 0:
            raise ValueError("negative input is not allowed")
        return {"Y": X}

    recorder = StepRecorder()
    models = [
        model("ok", lambda X: {"Y": X + 1}, [tensor("X")], [tensor("Y")]),
        model("fragile", explode, [tensor("X")], [tensor("Y")], jit=False),
        ensemble(
            "guarded",
            [tensor("IN")],
            [tensor("A"), tensor("B")],
            [step("ok", {"X": "IN"}, {"Y": "A"}), step("fragile", {"X": "IN"}, {"Y": "B"})],
        ),
    ]
    async with orchestrion.open_server(models=models, observers=[recorder]) as server:
        with pytest.raises(orchestrion.InferenceError) as info:
            await server.infer("guarded", {"IN": -np.ones(16, np.float32)})
        message = str(info.value)
        assert message.startswith("in ensemble 'guarded', ")
        assert "model 'fragile'" in message
        assert "negative input is not allowed" in message
        assert info.value.model_name == "fragile"
        assert isinstance(info.value.__cause__, orchestrion.InferenceError)
        good = await server.infer("guarded", {"IN": np.ones(16, np.float32)})
        assert good.outputs["B"].tolist() == [1.0] * 16
        stats = server.model_statistics("guarded")[0].inference_stats
        assert (stats.success.count, stats.fail.count) == (1, 1)
        assert server.model_statistics("fragile")[0].inference_stats.fail.count == 1


async def test_failure_stops_downstream_steps() -> None:
    """After the first error no further step starts for that request."""

    def fail(X):
        raise RuntimeError("boom")

    models = [
        model("first", fail, [tensor("X")], [tensor("Y")], jit=False),
        model("second", lambda X: {"Y": X}, [tensor("X")], [tensor("Y")]),
        ensemble(
            "chain",
            [tensor("IN")],
            [tensor("OUT")],
            [step("first", {"X": "IN"}, {"Y": "mid"}), step("second", {"X": "mid"}, {"Y": "OUT"})],
        ),
    ]
    async with orchestrion.open_server(models=models) as server:
        with pytest.raises(orchestrion.InferenceError, match="boom"):
            await server.infer("chain", {"IN": np.zeros(16, np.float32)})
        assert executions(server, "second") == 0


def _gated(name: str, gate: trio.Event, started: list[int]) -> orchestrion.Model:
    async def execute(X):
        started.append(1)
        await gate.wait()
        return {"Y": X}

    return model(name, execute, [tensor("X")], [tensor("Y")], jit=False, count=8)


async def test_cancelled_request_releases_every_slot() -> None:
    """Cancelling a client cancels its in-flight step and frees slots; later requests pass."""
    gate = trio.Event()
    started: list[int] = []
    models = [
        _gated("slow", gate, started),
        model("after", lambda X: {"Y": X * 2}, [tensor("X")], [tensor("Y")]),
        ensemble(
            "cancellable",
            [tensor("IN")],
            [tensor("OUT")],
            [step("slow", {"X": "IN"}, {"Y": "mid"}), step("after", {"X": "mid"}, {"Y": "OUT"})],
            max_inflight_requests=2,
        ),
    ]
    x = np.ones(16, np.float32)
    async with orchestrion.open_server(models=models) as server:
        async with trio.open_nursery() as nursery:
            for _ in range(5):  # 2 in flight at step 0, 2 queued, 1 blocked at the entrance
                nursery.start_soon(server.infer, "cancellable", {"IN": x})
            await trio.testing.wait_all_tasks_blocked()
            steps = server.step_statistics("cancellable")
            assert steps[0].in_flight == 2
            assert steps[0].queued == 2
            nursery.cancel_scope.cancel()
        await trio.testing.wait_all_tasks_blocked()
        for s in server.step_statistics("cancellable"):
            assert (s.in_flight, s.queued) == (0, 0)
        assert server.model_statistics("slow")[0].pending_request_count == 0
        assert server.model_statistics("cancellable")[0].pending_request_count == 0
        assert len(started) == 2  # the queued ones never ran
        gate.set()
        out = await server.infer("cancellable", {"IN": x})
        assert out.outputs["OUT"].tolist() == [2.0] * 16
        assert executions(server, "after") == 1


async def test_timeout_cancels_the_work(autojump_clock: trio.testing.MockClock) -> None:
    """A request past its timeout gets InferenceTimeoutError and leaves nothing running."""
    models = [
        _sleeper("slow", 10.0),
        ensemble(
            "timed", [tensor("IN")], [tensor("OUT")], [step("slow", {"X": "IN"}, {"Y": "OUT"})]
        ),
    ]
    async with orchestrion.open_server(models=models) as server:
        start = trio.current_time()
        with pytest.raises(orchestrion.InferenceTimeoutError, match="timed out after 1.5 s"):
            await server.infer("timed", {"IN": np.zeros(16, np.float32)}, timeout=1.5)
        assert trio.current_time() - start == pytest.approx(1.5)
        await trio.testing.wait_all_tasks_blocked()
        assert server.step_statistics("timed")[0].in_flight == 0
        stats = server.model_statistics("slow")[0]
        assert stats.pending_request_count == 0
        assert stats.inference_stats.fail.count == 1


@pytest.mark.parametrize(("limit", "expected_peak"), [(4, 4), (0, 40)])
async def test_max_inflight_requests_bounds_each_step(
    autojump_clock: trio.testing.MockClock, limit: int, expected_peak: int
) -> None:
    """With max_inflight_requests N a step never has more than N requests in flight; 0 is unbounded."""
    recorder = StepRecorder()
    async with orchestrion.open_server(models=_two_branches(limit), observers=[recorder]) as server:
        x = np.zeros(16, np.float32)
        async with trio.open_nursery() as nursery:
            for _ in range(40):
                nursery.start_soon(server.infer, "branches", {"IN": x})
        assert recorder.peak[("branches", 0)] == expected_peak
        assert recorder.peak[("branches", 1)] == expected_peak
        assert len(recorder.finished) == 80
        assert all(error is None for *_, error in recorder.finished)


async def test_backpressure_blocks_the_producer() -> None:
    """A full downstream channel blocks the upstream step, which then holds its own slot."""
    gate = trio.Event()
    started: list[int] = []
    models = [
        model("fast", lambda X: {"Y": X}, [tensor("X")], [tensor("Y")]),
        _gated("slow", gate, started),
        ensemble(
            "pressure",
            [tensor("IN")],
            [tensor("OUT")],
            [step("fast", {"X": "IN"}, {"Y": "mid"}), step("slow", {"X": "mid"}, {"Y": "OUT"})],
            max_inflight_requests=1,
        ),
    ]
    async with orchestrion.open_server(models=models) as server:
        x = np.zeros(16, np.float32)
        async with trio.open_nursery() as nursery:
            for _ in range(6):
                nursery.start_soon(server.infer, "pressure", {"IN": x})
            await trio.testing.wait_all_tasks_blocked()
            fast, slow = server.step_statistics("pressure")
            # slow: 1 running + 1 queued; fast: 1 finished but blocked handing over, 1 queued.
            assert (slow.in_flight, slow.queued) == (1, 1)
            assert fast.queued == 1
            assert executions(server, "fast") == 3
            assert fast.blocked_ns > 0
            gate.set()
        assert executions(server, "slow") == 6


async def test_nested_ensembles() -> None:
    """An ensemble can be a step of another ensemble."""
    models = seed_pipeline()
    models.append(
        model("scale", lambda X: {"Y": X * 10}, [tensor("X", dims=(1,))], [tensor("Y", dims=(1,))])
    )
    models.append(
        ensemble(
            "outer",
            [tensor("RAW", dims=ROW)],
            [tensor("SCALED", dims=(1,))],
            [
                step("pipeline", {"IN": "RAW"}, {"SUM": "s"}),
                step("scale", {"X": "s"}, {"Y": "SCALED"}),
            ],
        )
    )
    async with orchestrion.open_server(models=models) as server:
        out = (await server.infer("outer", {"RAW": X})).outputs["SCALED"]
        np.testing.assert_allclose(out, (X * 2 + 1).sum(axis=1) * 10)
        # The inner ensemble was asked only for SUM: its 'center' branch was pruned.
        assert executions(server, "center") == 0


@pytest.mark.parametrize(("version", "expected"), [(-1, 2.0), (0, 2.0), (1, 1.0), (2, 2.0)])
async def test_step_model_version_resolution(version: int, expected: float) -> None:
    """-1 and 0 mean the latest version; a number picks that version."""
    models = [
        model("m", lambda X: {"Y": X * 0 + 1}, [tensor("X")], [tensor("Y")], version=1),
        model("m", lambda X: {"Y": X * 0 + 2}, [tensor("X")], [tensor("Y")], version=2),
        ensemble(
            "e", [tensor("IN")], [tensor("OUT")], [step("m", {"X": "IN"}, {"Y": "OUT"}, version)]
        ),
    ]
    async with orchestrion.open_server(models=models) as server:
        out = (await server.infer("e", {"IN": np.zeros(16, np.float32)})).outputs["OUT"]
        assert out[0] == expected
        assert server.model_versions("m") == [1, 2]


async def test_metadata_is_forwarded_to_every_composing_request() -> None:
    """Request id, parameters, priority, timeout and sequence flags reach each step unchanged."""
    recorder = StepRecorder()
    async with orchestrion.open_server(models=seed_pipeline(), observers=[recorder]) as server:
        await server.infer(
            "pipeline",
            {"IN": X},
            request_id="abc",
            parameters={"tenant": "t1", "n": 3},
            priority=2,
            timeout=30.0,
            sequence_id=42,
            sequence_start=True,
            sequence_end=False,
        )
    assert len(recorder.requests) == 3
    for _, _, request in recorder.requests:
        assert request.request_id == "abc"
        assert request.parameters == {"tenant": "t1", "n": 3}
        assert request.priority == 2
        assert request.timeout == 30.0
        assert (request.sequence_id, request.sequence_start, request.sequence_end) == (
            42,
            True,
            False,
        )


async def test_omitted_output_is_left_out_also_when_requested() -> None:
    """A model that omits an output: the response leaves it out, also for a client that
    named it (Triton's ensemble_partial_add_sub)."""
    models = [
        model(
            "partial",
            lambda X: {"A": X},
            [tensor("X")],
            [tensor("A"), tensor("B")],
            jit=False,
        ),
        ensemble(
            "e",
            [tensor("IN")],
            [tensor("OA"), tensor("OB")],
            [step("partial", {"X": "IN"}, {"A": "OA", "B": "OB"})],
        ),
    ]
    async with orchestrion.open_server(models=models) as server:
        x = np.zeros(16, np.float32)
        response = await server.infer("e", {"IN": x})
        assert set(response.outputs) == {"OA"}
        response = await server.infer("e", {"IN": x}, outputs=["OA", "OB"])
        assert set(response.outputs) == {"OA"}
        assert (await server.infer("e", {"IN": x}, outputs=["OB"])).outputs == {}


async def test_many_concurrent_requests_each_get_their_own_answer() -> None:
    """Under concurrency every request gets exactly its own result."""
    results: dict[int, np.ndarray] = {}
    async with orchestrion.open_server(models=seed_pipeline(max_inflight_requests=3)) as server:

        async def client(i: int) -> None:
            x = np.full(ROW, i, dtype=np.float32)
            results[i] = (await server.infer("pipeline", {"IN": x}, request_id=str(i))).outputs[
                "SUM"
            ]

        async with trio.open_nursery() as nursery:
            for i in range(200):
                nursery.start_soon(client, i)
        for s in server.step_statistics("pipeline"):
            assert (s.in_flight, s.queued) == (0, 0)
        assert server.model_statistics("pipeline")[0].inference_stats.success.count == 200
    assert sorted(results) == list(range(200))
    for i, value in results.items():
        assert math.isclose(float(value[0]), 16 * (2 * i + 1))


async def test_leaving_the_server_lets_running_requests_finish(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Leaving open_server normally waits for requests in flight, which still succeed."""
    gate = trio.Event()
    started: list[int] = []
    models = [
        _gated("slow", gate, started),
        model("after", lambda X: {"Y": X + 1}, [tensor("X")], [tensor("Y")]),
        ensemble(
            "e",
            [tensor("IN")],
            [tensor("OUT")],
            [step("slow", {"X": "IN"}, {"Y": "mid"}), step("after", {"X": "mid"}, {"Y": "OUT"})],
        ),
    ]
    results: list[float] = []
    late: list[BaseException] = []
    async with trio.open_nursery() as outer, orchestrion.open_server(models=models) as server:

        async def client() -> None:
            response = await server.infer("e", {"IN": np.zeros(16, np.float32)})
            results.append(float(response.outputs["OUT"][0]))

        async def open_the_gate_later() -> None:
            await trio.sleep(1)
            try:  # the server is draining: new requests are refused
                await server.infer("e", {"IN": np.zeros(16, np.float32)})
            except orchestrion.ServerClosedError as exc:
                late.append(exc)
            gate.set()

        outer.start_soon(client)
        await trio.testing.wait_all_tasks_blocked()
        assert started == [1]
        outer.start_soon(open_the_gate_later)
    assert results == [1.0]
    assert len(late) == 1


async def test_ensemble_inputs_and_outputs_take_their_reshape() -> None:
    """An ensemble input's reshape is what its steps see; an output is returned in its dims."""
    models = [
        model("grid", lambda X: {"Y": X.T}, [tensor("X", dims=(2, 2))], [tensor("Y", dims=(2, 2))]),
        ensemble(
            "flat",
            [tensor("IN", dims=(4,), reshape=orchestrion.protocols.Reshape(shape=(2, 2)))],
            [tensor("OUT", dims=(4,), reshape=orchestrion.protocols.Reshape(shape=(2, 2)))],
            [step("grid", {"X": "IN"}, {"Y": "OUT"})],
        ),
    ]
    async with orchestrion.open_server(models=models) as server:
        out = await server.infer("flat", {"IN": np.array([1, 2, 3, 4], np.float32)})
    assert out.outputs["OUT"].tolist() == [1.0, 3.0, 2.0, 4.0]


async def test_batch_of_one_is_added_or_removed_where_only_one_side_batches() -> None:
    """A non-batching ensemble feeds a batching model (batch of 1 added) and gets [16] back."""
    models = [
        model(
            "batched",
            lambda X: {"Y": X + 1},
            [tensor("X", dims=(16,))],
            [tensor("Y", dims=(16,))],
            max_batch_size=8,
        ),
        model(
            "plain", lambda X: {"Y": X * 2}, [tensor("X", dims=(16,))], [tensor("Y", dims=(16,))]
        ),
        ensemble(
            "mixed",
            [tensor("IN", dims=(16,))],
            [tensor("OUT", dims=(16,)), tensor("MID", dims=(16,))],
            [
                step("batched", {"X": "IN"}, {"Y": "MID"}),
                step("plain", {"X": "MID"}, {"Y": "OUT"}),
            ],
        ),
    ]
    async with orchestrion.open_server(models=models) as server:
        out = await server.infer("mixed", {"IN": np.zeros(16, np.float32)})
    assert out.outputs["MID"].shape == (16,)
    assert out.outputs["OUT"].tolist() == [2.0] * 16
