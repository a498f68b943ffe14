"""Fusion: an ensemble of short jitted models runs as one compiled call, and a client cannot
tell, except by the speed: the same outputs, errors and statistics as the scheduler's path,
which still takes everything fusion cannot do."""

from __future__ import annotations

import logging
from typing import Any

import attrs
import jax.numpy as jnp
import numpy as np
import pytest
import trio

import orchestrion
from orchestrion import InferenceError, InferenceTimeoutError
from orchestrion.protocols import DynamicBatching
from orchestrion.testing import (
    StepRecorder,
    ensemble,
    fused,
    infer_until_fused,
    inside,
    model,
    settled,
    step,
    tensor,
    with_fusion,
)

RNG = np.random.default_rng(7)


def _models(*, fusion: str = "on", segment: Any = None, dims: tuple[int, ...] = (16,)) -> list:
    """prepare (x*2+1), then classify (two sums) and segment (-x) on its result."""
    prepare = model(
        "prepare",
        lambda X: {"Y": X * 2 + 1},
        [tensor("X", dims=dims)],
        [tensor("Y", dims=dims)],
    )
    classify = model(
        "classify",
        lambda X: {"C": jnp.stack([X[:8].sum(), X[8:].sum()])},
        [tensor("X", dims=dims)],
        [tensor("C", dims=(2,))],
    )
    segment_model = model(
        "segment",
        segment or (lambda X: {"S": -X}),
        [tensor("X", dims=dims)],
        [tensor("S", dims=dims)],
    )
    pipe = ensemble(
        "pipe",
        [tensor("IN", dims=dims)],
        [tensor("CLASS", dims=(2,)), tensor("SEG", dims=dims)],
        [
            step("prepare", {"X": "IN"}, {"Y": "prepared"}),
            step("classify", {"X": "prepared"}, {"C": "CLASS"}),
            step("segment", {"X": "prepared"}, {"S": "SEG"}),
        ],
    )
    return [prepare, classify, segment_model, with_fusion(pipe, fusion)]


def _reference(x: np.ndarray) -> dict[str, np.ndarray]:
    prepared = x * 2 + 1
    return {"CLASS": np.stack([prepared[:8].sum(), prepared[8:].sum()]), "SEG": -prepared}


async def test_fused_answers_and_statistics_match_the_scheduler(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """30 random inputs through a fused and an unfused server: the same outputs (to the
    reference), the same counts for the ensemble and each composing model."""
    caplog.set_level(logging.INFO, logger="orchestrion")
    inputs = [RNG.standard_normal(16).astype(np.float32) for _ in range(30)]
    counts = {}
    for fusion in ("on", "off"):
        async with orchestrion.open_server(models=_models(fusion=fusion)) as server:
            await server.infer("pipe", {"IN": inputs[0]})  # compiles (fused: in the background)
            await settled(server)
            for x in inputs:
                response = await server.infer("pipe", {"IN": x})
                for name, want in _reference(x).items():
                    np.testing.assert_allclose(response.outputs[name], want, rtol=1e-5)
            assert await settled(server) is (fusion == "on")
            counts[fusion] = {
                s.name: (
                    s.inference_count,
                    s.execution_count,
                    s.inference_stats.success.count,
                    s.inference_stats.fail.count,
                )
                for s in server.model_statistics()
            }
    assert counts["on"] == counts["off"]
    assert counts["on"]["segment"] == (31, 31, 31, 0)
    assert any("runs fused" in r.getMessage() for r in caplog.records)


async def test_a_subset_of_outputs_runs_only_the_steps_it_needs() -> None:
    """Asking for CLASS alone takes the scheduler's path, which prunes segment."""
    async with orchestrion.open_server(models=_models()) as server:
        x = RNG.standard_normal(16).astype(np.float32)
        await server.infer("pipe", {"IN": x})
        response = await server.infer("pipe", {"IN": x}, outputs=["CLASS"])
        assert set(response.outputs) == {"CLASS"}
        segment = server.model_statistics("segment")[0]
    assert segment.inference_count == 1


async def test_reloading_a_composing_model_rebuilds_the_fusion() -> None:
    """After segment is reloaded with another function, fused requests use the new one."""
    async with orchestrion.open_server(models=_models()) as server:
        x = RNG.standard_normal(16).astype(np.float32)
        assert await infer_until_fused(server, "pipe", {"IN": x})
        before = await server.infer("pipe", {"IN": x})
        np.testing.assert_allclose(before.outputs["SEG"], -(x * 2 + 1), rtol=1e-5)
        await server.load_model(
            model("segment", lambda X: {"S": X * 10}, [tensor("X")], [tensor("S")])
        )
        first = await server.infer("pipe", {"IN": x})  # the scheduler's, while it compiles
        assert await infer_until_fused(server, "pipe", {"IN": x})
        after = await server.infer("pipe", {"IN": x})
    np.testing.assert_allclose(first.outputs["SEG"], (x * 2 + 1) * 10, rtol=1e-5)
    np.testing.assert_allclose(after.outputs["SEG"], (x * 2 + 1) * 10, rtol=1e-5)


async def test_a_step_output_that_breaks_its_config_fails_as_without_fusion() -> None:
    """segment returns FP64 where its config says FP32: the same error, naming the step's
    model, with and without fusion (the fused call refuses that signature)."""
    errors = {}
    for fusion in ("on", "off"):
        models = _models(fusion=fusion, segment=lambda X: {"S": X.astype(jnp.int32)})
        async with orchestrion.open_server(models=models) as server:
            with pytest.raises(InferenceError) as caught:
                await server.infer("pipe", {"IN": np.ones(16, np.float32)})
            errors[fusion] = str(caught.value)
            assert not await settled(server)  # its signature was refused
    assert errors["on"] == errors["off"]
    assert "segment" in errors["on"]
    assert "data type" in errors["on"]


async def test_observers_and_tracing_keep_the_scheduler() -> None:
    """With an observer, each step is still seen: no fusion."""
    recorder = StepRecorder()
    async with orchestrion.open_server(models=_models(), observers=[recorder]) as server:
        await server.infer("pipe", {"IN": np.ones(16, np.float32)})
        assert not fused(server)
    assert len(recorder.requests) == 3


async def test_variable_shapes_compile_off_the_loop_under_concurrency() -> None:
    """A -1 dim: the instances start in worker threads (no fusion) and move inline once
    their calls prove short; then 40 concurrent requests of four shapes, three of them new,
    are all answered right: a new shape takes the scheduler's path, which compiles it in a
    worker thread, and runs fused afterwards."""
    async with orchestrion.open_server(models=_models(dims=(-1,))) as server:
        assert await infer_until_fused(server, "pipe", {"IN": np.ones(16, np.float32)})
        answers: dict[int, Any] = {}

        async def one(i: int) -> None:
            x = np.arange(16 + 2 * (i % 4), dtype=np.float32) + i
            response = await server.infer("pipe", {"IN": x})
            prepared = x * 2 + 1
            np.testing.assert_allclose(response.outputs["SEG"], -prepared, rtol=1e-5)
            answers[i] = response

        async with trio.open_nursery() as nursery:
            for i in range(40):
                nursery.start_soon(one, i)
        assert await settled(server)
        for i in range(4):  # after the compilations: fused
            await one(i)
        assert fused(server)
    assert len(answers) == 40


async def test_a_fused_result_past_its_deadline_is_a_timeout() -> None:
    """The fused call cannot be interrupted (as an inline step); a result that comes after
    the request's deadline is a timeout, not an answer."""
    async with orchestrion.open_server(models=_models()) as server:
        x = np.ones(16, np.float32)
        assert await infer_until_fused(server, "pipe", {"IN": x})
        with trio.move_on_at(trio.current_time() - 1) as scope:  # a deadline already passed
            await server.infer("pipe", {"IN": x})
        assert scope.cancelled_caught
        with pytest.raises(InferenceTimeoutError):
            await server.infer("pipe", {"IN": x}, timeout=1e-9)
        assert server.model_statistics("pipe")[0].inference_stats.fail.count >= 1


def _batching_models(*, fusion: str = "on", delay: int = 0, rows_out: Any = None) -> list:
    """The pipeline with max_batch_size 8 and dynamic batching on every step: a request is
    one row (or a few) of 16."""
    batching = DynamicBatching(max_queue_delay_microseconds=delay)

    def batched(definition: orchestrion.Model) -> orchestrion.Model:
        config = attrs.evolve(definition.config, max_batch_size=8, dynamic_batching=batching)
        return attrs.evolve(definition, config=config)

    # Inline by configuration: on a loaded machine the warm-up's timing could put a step in a
    # worker thread, and only inline steps are gathered into a fused call (what this tests).
    inline = {"execution": "inline"}
    prepare = model(
        "prepare", lambda X: {"Y": X * 2 + 1}, [tensor("X")], [tensor("Y")], parameters=inline
    )
    classify = model(
        "classify",
        rows_out or (lambda X: {"C": X.sum(axis=1, keepdims=True)}),
        [tensor("X")],
        [tensor("C", dims=(1,))],
        parameters=inline,
    )
    segment = model("segment", lambda X: {"S": -X}, [tensor("X")], [tensor("S")], parameters=inline)
    pipe = ensemble(
        "pipe",
        [tensor("IN")],
        [tensor("CLASS", dims=(1,)), tensor("SEG")],
        [
            step("prepare", {"X": "IN"}, {"Y": "prepared"}),
            step("classify", {"X": "prepared"}, {"C": "CLASS"}),
            step("segment", {"X": "prepared"}, {"S": "SEG"}),
        ],
        max_batch_size=8,
    )
    return [
        batched(prepare),
        batched(classify),
        batched(segment),
        with_fusion(pipe, fusion),
    ]


async def _concurrent_rows(server: orchestrion.AsyncServer, count: int) -> dict[int, Any]:
    """``count`` concurrent requests, request i carrying 1 + i % 3 rows of its own values:
    each must get back exactly its own rows."""
    answers: dict[int, Any] = {}

    async def one(i: int) -> None:
        x = (np.arange(16, dtype=np.float32) + 100 * i)[None].repeat(1 + i % 3, axis=0)
        x[:, 0] += np.arange(x.shape[0])
        response = await server.infer("pipe", {"IN": x})
        prepared = x * 2 + 1
        np.testing.assert_allclose(response.outputs["SEG"], -prepared, rtol=1e-6)
        np.testing.assert_allclose(
            response.outputs["CLASS"], prepared.sum(axis=1, keepdims=True), rtol=1e-5
        )
        answers[i] = response

    async with trio.open_nursery() as nursery:
        for i in range(count):
            nursery.start_soon(one, i)
    return answers


async def test_concurrent_requests_are_gathered_into_fused_batches() -> None:
    """With dynamic batching (no queue delay) on every step, concurrent requests of 1-3 rows
    share fused calls of at most 8 rows: each gets exactly its own rows, as without fusion;
    composing models count one inference per row and fewer executions than requests."""
    stats = {}
    for fusion in ("on", "off"):
        async with orchestrion.open_server(models=_batching_models(fusion=fusion)) as server:
            await _concurrent_rows(server, 4)  # compiles (fused: every padded size at once)
            await settled(server)
            answers = await _concurrent_rows(server, 60)
            assert len(answers) == 60
            assert await settled(server) is (fusion == "on")
            stats[fusion] = server.model_statistics("segment")[0]
    fused, scheduled = stats["on"], stats["off"]
    rows = sum(1 + i % 3 for i in range(4)) + sum(1 + i % 3 for i in range(60))
    assert fused.inference_count == scheduled.inference_count == rows
    assert fused.inference_stats.success.count == scheduled.inference_stats.success.count
    assert fused.execution_count < 64 / 2


async def test_a_batching_step_that_breaks_rows_fails_as_without_fusion() -> None:
    """A batching model that returns one row for the whole batch: refused by the fused
    call's check, so the scheduler's path reports it, as without fusion."""
    errors = {}
    for fusion in ("on", "off"):
        models = _batching_models(
            fusion=fusion, rows_out=lambda X: {"C": X.sum(axis=(0, 1))[None, None]}
        )
        async with orchestrion.open_server(models=models) as server:
            with pytest.raises(InferenceError) as caught:
                await server.infer("pipe", {"IN": np.ones((2, 16), np.float32)})
            errors[fusion] = str(caught.value)
    assert errors["on"] == errors["off"]
    assert "classify" in errors["on"]


async def test_a_queue_delay_keeps_the_batchers() -> None:
    """A step with a queue delay asks its batcher to wait for company: no fusion."""
    async with orchestrion.open_server(models=_batching_models(delay=100)) as server:
        await _concurrent_rows(server, 8)
        assert not fused(server)


async def test_cancelled_and_timed_out_requests_in_a_gathered_batch_get_one_outcome() -> None:
    """A storm of concurrent requests, a third with a timeout that expires at once and a
    third cancelled by their callers: each caller gets exactly one outcome, the others their
    own rows, and the server is at rest."""
    outcomes: dict[int, str] = {}
    async with orchestrion.open_server(models=_batching_models()) as server:
        await _concurrent_rows(server, 4)
        assert await settled(server)

        async def one(i: int) -> None:
            x = np.full((1, 16), float(i), np.float32)
            with trio.CancelScope() as scope:
                if i % 3 == 1:
                    scope.cancel()
                try:
                    response = await server.infer(
                        "pipe", {"IN": x}, timeout=1e-6 if i % 3 == 2 else None
                    )
                except InferenceTimeoutError:
                    outcomes[i] = "timed out"
                    return
                np.testing.assert_allclose(response.outputs["SEG"], -(x * 2 + 1))
                outcomes[i] = "answered"
            if scope.cancelled_caught:
                outcomes[i] = "cancelled"

        for _ in range(3):
            async with trio.open_nursery() as nursery:
                for i in range(48):
                    nursery.start_soon(one, i)
        fusion = inside(server).fusion("pipe")
        assert fusion is not None
        assert fusion._pass.waiting == 0
        assert all(s.pending_request_count == 0 for s in server.model_statistics())
    assert len(outcomes) == 48
    assert {outcomes[i] for i in range(0, 48, 3)} == {"answered"}


async def test_xla_mode_compiles_the_whole_graph_in_the_background() -> None:
    """fusion "xla": the first request of a new shape takes the scheduler's path while the
    whole graph compiles in the ensemble's own task; later requests run as one compiled call
    and answer the reference (to rounding: XLA may optimise across steps)."""
    async with orchestrion.open_server(models=_models(fusion="xla")) as server:
        x = RNG.standard_normal(16).astype(np.float32)
        assert await infer_until_fused(server, "pipe", {"IN": x})
        fusion = inside(server).fusion("pipe")
        assert fusion is not None
        assert fusion.mode == "xla"
        assert len(fusion._ready) == 1
        for _ in range(5):
            response = await server.infer("pipe", {"IN": x})
            for name, want in _reference(x).items():
                np.testing.assert_allclose(response.outputs[name], want, rtol=1e-5)
        assert server.model_statistics("segment")[0].inference_count == 6


async def test_an_unknown_fusion_mode_is_a_load_error_naming_the_parameter() -> None:
    """A misspelt ``fusion`` parameter used to turn fusion off without a word; it is refused
    at load, naming the parameter and the modes there are."""
    with pytest.raises(
        orchestrion.ConfigError, match=r"parameter 'fusion' must be one of on, xla, off, got 'xlaa'"
    ):
        async with orchestrion.open_server(models=_models(fusion="xlaa")):
            pass
