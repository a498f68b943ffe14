"""Control flow in ensembles, declared in their parameters: conditional steps, joins, bounded
loops, mapped steps, constants, defaults, per-step parameters and timeouts, each through the
real scheduler with real models, and what holds through them (backpressure, cancellation,
the response cache, statistics)."""

from __future__ import annotations

import json
import tracemalloc
from typing import Any

import attrs
import numpy as np
import pytest
import trio
import trio.testing

import orchestrion
from orchestrion.protocols import DynamicBatching, InferRequest
from orchestrion.testing import assert_idle, cached, ensemble, model, step, tensor

ONE = (1,)


def constant(data_type: str, dims: list[int], value: Any) -> str:
    return json.dumps({"data_type": data_type, "dims": dims, "value": value})


def scaler(
    name: str = "scale", factor: float = 2.0, dims: tuple[int, ...] = ONE
) -> orchestrion.Model:
    """Y = X * factor (plain Python, inline)."""
    return model(
        name,
        lambda X: {"Y": X * factor},
        [tensor("X", dims=dims)],
        [tensor("Y", dims=dims)],
        jit=False,
    )


def gate_model() -> orchestrion.Model:
    """OPEN = X > 0 (BOOL)."""
    return model(
        "gate",
        lambda X: {"OPEN": X > 0},
        [tensor("X", dims=ONE)],
        [tensor("OPEN", "BOOL", dims=ONE)],
        jit=False,
    )


# -- conditional steps ---------------------------------------------------------------------


def conditional(**parameters: str) -> list[orchestrion.Model]:
    """gate -> (scale when open) -> after; ``parameters`` more or other declarations."""
    return [
        gate_model(),
        scaler(),
        scaler("after", 10.0),
        ensemble(
            "pipe",
            [tensor("IN", dims=ONE)],
            [tensor("SCALED", dims=ONE), tensor("AFTER", dims=ONE)],
            [
                step("gate", {"X": "IN"}, {"OPEN": "open"}),
                step("scale", {"X": "IN"}, {"Y": "SCALED"}),
                step("after", {"X": "SCALED"}, {"Y": "AFTER"}),
            ],
            parameters={"step[1].when": "open", **parameters},
        ),
    ]


async def test_a_step_runs_only_when_its_condition_holds() -> None:
    """The step runs on a true condition; on a false one it is skipped, what takes its output
    is skipped too, and the outputs are left out of the response."""
    async with orchestrion.open_server(models=conditional()) as server:
        ran = await server.infer("pipe", {"IN": np.array([3.0], np.float32)})
        assert ran.outputs["SCALED"].tolist() == [6.0]
        assert ran.outputs["AFTER"].tolist() == [60.0]
        skipped = await server.infer("pipe", {"IN": np.array([-3.0], np.float32)})
        assert skipped.outputs == {}
        stats = {s.step: s for s in server.step_statistics("pipe")}
        assert (stats[1].runs, stats[1].skipped) == (1, 1)
        assert (stats[2].runs, stats[2].skipped) == (1, 1)
        assert server.model_statistics("scale")[0].inference_stats.success.count == 1
        assert_idle(server, "pipe")


async def test_not_negates_the_condition() -> None:
    """``not TENSOR``: the step runs when the condition does not hold."""
    async with orchestrion.open_server(
        models=conditional(**{"step[1].when": "not open"})
    ) as server:
        skipped = await server.infer("pipe", {"IN": np.array([3.0], np.float32)})
        ran = await server.infer("pipe", {"IN": np.array([-3.0], np.float32)})
    assert skipped.outputs == {}
    assert ran.outputs["SCALED"].tolist() == [-6.0]


async def test_a_default_stands_in_for_a_skipped_output() -> None:
    """With a declared default, a skipped step's output takes it, and its consumer runs."""
    default = constant("TYPE_FP32", [1], [0.5])
    async with orchestrion.open_server(models=conditional(**{"default.SCALED": default})) as server:
        response = await server.infer("pipe", {"IN": np.array([-3.0], np.float32)})
    assert response.outputs["SCALED"].tolist() == [0.5]
    assert response.outputs["AFTER"].tolist() == [5.0]


async def test_a_condition_can_come_from_the_client() -> None:
    """The condition is an ensemble input: the client decides whether the step runs."""
    models = [
        scaler(),
        ensemble(
            "pipe",
            [tensor("IN", dims=ONE), tensor("RUN", "BOOL", dims=ONE)],
            [tensor("OUT", dims=ONE)],
            [step("scale", {"X": "IN"}, {"Y": "OUT"})],
            parameters={"step[0].when": "RUN"},
        ),
    ]
    x = np.array([1.0], np.float32)
    async with orchestrion.open_server(models=models) as server:
        yes = await server.infer("pipe", {"IN": x, "RUN": np.array([True])})
        no = await server.infer("pipe", {"IN": x, "RUN": np.array([False])})
    assert yes.outputs["OUT"].tolist() == [2.0]
    assert no.outputs == {}


# -- joins -----------------------------------------------------------------------------------


def branches(
    slow_delay: float = 0.0, right_when: str | None = "not open"
) -> list[orchestrion.Model]:
    """gate -> left (when open) or right (``right_when``) -> a join -> finish; without
    ``right_when`` both branches run, and there is no gate."""

    async def slow(X: Any) -> dict[str, Any]:
        await trio.sleep(slow_delay)
        return {"Y": X + 100}

    gate = [step("gate", {"X": "IN"}, {"OPEN": "open"})] if right_when else []
    parameters = {"any.merged": "from_left, from_right"}
    if right_when:
        parameters |= {"step[1].when": "open", "step[2].when": right_when}
    return [
        gate_model(),
        scaler("left", 2.0),
        model("right", slow, [tensor("X", dims=ONE)], [tensor("Y", dims=ONE)], jit=False),
        scaler("finish", 1.0),
        ensemble(
            "pipe",
            [tensor("IN", dims=ONE)],
            [tensor("OUT", dims=ONE)],
            [
                *gate,
                step("left", {"X": "IN"}, {"Y": "from_left"}),
                step("right", {"X": "IN"}, {"Y": "from_right"}),
                step("finish", {"X": "merged"}, {"Y": "OUT"}),
            ],
            parameters={
                k.replace("[1]", f"[{len(gate)}]").replace("[2]", f"[{len(gate) + 1}]"): v
                for k, v in parameters.items()
            },
        ),
    ]


async def test_a_join_merges_two_branches() -> None:
    """``any.NAME`` takes whichever branch ran."""
    async with orchestrion.open_server(models=branches()) as server:
        left = await server.infer("pipe", {"IN": np.array([1.0], np.float32)})
        right = await server.infer("pipe", {"IN": np.array([-1.0], np.float32)})
    assert left.outputs["OUT"].tolist() == [2.0]
    assert right.outputs["OUT"].tolist() == [99.0]


async def test_a_join_takes_the_first_alternative_to_arrive(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Both alternatives run; the join takes the fast one, and the run ends once every step
    is done (the slow one too)."""
    async with orchestrion.open_server(models=branches(5.0, right_when=None)) as server:
        start = trio.current_time()
        response = await server.infer("pipe", {"IN": np.array([1.0], np.float32)})
        assert response.outputs["OUT"].tolist() == [2.0]
        assert trio.current_time() - start == pytest.approx(5.0)
        assert server.model_statistics("right")[0].inference_stats.success.count == 1
        assert server.model_statistics("finish")[0].inference_stats.success.count == 1


async def test_a_join_of_skipped_alternatives_is_skipped() -> None:
    """When every alternative is skipped, the join is, and so is what takes it."""
    async with orchestrion.open_server(models=branches(right_when="open")) as server:
        response = await server.infer("pipe", {"IN": np.array([-1.0], np.float32)})
        assert response.outputs == {}
        assert server.step_statistics("pipe")[3].skipped == 1


# -- loops -----------------------------------------------------------------------------------


def refinement(max_iterations: int = 3, limit: int = 0) -> list[orchestrion.Model]:
    """A loop that halves X while its maximum is above 1, counting its iterations."""
    return [
        model(
            "halve",
            lambda X, N: {"Y": X / 2, "AGAIN": np.array([X.max() / 2 > 1]), "N1": N + 1},
            [tensor("X", dims=(-1,)), tensor("N", "INT32", dims=ONE)],
            [
                tensor("Y", dims=(-1,)),
                tensor("AGAIN", "BOOL", dims=ONE),
                tensor("N1", "INT32", dims=ONE),
            ],
            jit=False,
        ),
        scaler("after", 10.0, dims=(-1,)),
        ensemble(
            "pipe",
            [tensor("IN", dims=(-1,))],
            [tensor("OUT", dims=(-1,)), tensor("ROUNDS", "INT32", dims=ONE)],
            [
                step(
                    "halve",
                    {"X": "IN", "N": "zero"},
                    {"Y": "halved", "AGAIN": "again", "N1": "ROUNDS"},
                ),
                step("after", {"X": "halved"}, {"Y": "OUT"}),
            ],
            max_inflight_requests=limit,
            parameters={
                "constant.zero": constant("TYPE_INT32", [1], [0]),
                "loop.refine": json.dumps(
                    {
                        "steps": [0],
                        "while": "again",
                        "max_iterations": max_iterations,
                        "next": {"halved": "IN", "ROUNDS": "zero"},
                    }
                ),
            },
        ),
    ]


@pytest.mark.parametrize(
    ("start", "rounds", "result"),
    [(1.5, 1, 0.75), (3.0, 2, 0.75), (6.0, 3, 0.75), (100.0, 3, 12.5)],
)
async def test_a_loop_repeats_while_its_condition_holds_up_to_its_bound(
    start: float, rounds: int, result: float
) -> None:
    """Each iteration's outputs feed the next; the loop stops when the condition fails or
    at max_iterations; the step after the loop sees the last iteration's output, once."""
    async with orchestrion.open_server(models=refinement()) as server:
        response = await server.infer("pipe", {"IN": np.array([start, 1.0], np.float32)})
        assert response.outputs["ROUNDS"].tolist() == [rounds]
        assert response.outputs["OUT"].tolist() == [result * 10, 10 / 2**rounds]
        stats = server.step_statistics("pipe")
        assert (stats[0].runs, stats[1].runs) == (rounds, 1)
        assert server.model_statistics("halve")[0].execution_count == rounds


async def test_concurrent_runs_keep_their_own_iterations() -> None:
    """Many runs in one loop at once, each with its own count, under max_inflight_requests."""
    async with orchestrion.open_server(models=refinement(limit=2)) as server:
        results: dict[float, Any] = {}

        async def one(start: float) -> None:
            results[start] = await server.infer("pipe", {"IN": np.array([start], np.float32)})

        async with trio.open_nursery() as nursery:
            for start in (0.5, 3.0, 6.0, 100.0) * 5:
                nursery.start_soon(one, start)
        assert {k: v.outputs["ROUNDS"].tolist() for k, v in results.items()} == {
            0.5: [1],
            3.0: [2],
            6.0: [3],
            100.0: [3],
        }
        assert_idle(server, "pipe")


# -- maps ------------------------------------------------------------------------------------


def mapped(
    classify: orchestrion.Model, *, max_items: int | None = None, limit: int = 0
) -> list[orchestrion.Model]:
    """detect (N boxes of 4) -> classify mapped over each box -> scores [N, 1]."""
    parameters = {"step[1].map": "boxes"}
    if max_items is not None:
        parameters["step[1].max_items_in_flight"] = str(max_items)
    return [
        model(
            "detect",
            lambda COUNT: {"BOXES": np.arange(int(COUNT[0]) * 4, dtype=np.float32).reshape(-1, 4)},
            [tensor("COUNT", "INT32", dims=ONE)],
            [tensor("BOXES", dims=(-1, 4))],
            jit=False,
        ),
        classify,
        ensemble(
            "pipe",
            [tensor("COUNT", "INT32", dims=ONE)],
            [tensor("SCORES", dims=(-1, 1))],
            [
                step("detect", {"COUNT": "COUNT"}, {"BOXES": "boxes"}),
                step("classify", {"BOX": "boxes"}, {"SCORE": "SCORES"}),
            ],
            max_inflight_requests=limit,
            parameters=parameters,
        ),
    ]


def classifier(execute: Any, **kw: Any) -> orchestrion.Model:
    """A plain-Python model 'classify': BOX [4] -> SCORE [1] (``kw``: `model`'s options)."""
    return model(
        "classify",
        execute,
        [tensor("BOX", dims=(4,))],
        [tensor("SCORE", dims=ONE)],
        jit=False,
        **kw,
    )


def summing(execute: Any = None, **kw: Any) -> orchestrion.Model:
    """SCORE = sum(BOX): a model that batches (max_batch_size 8, dynamic batching)."""
    m = classifier(
        execute or (lambda BOX: {"SCORE": BOX.sum(axis=1, keepdims=True)}), max_batch_size=8, **kw
    )
    return attrs.evolve(m, config=attrs.evolve(m.config, dynamic_batching=DynamicBatching()))


def expected_scores(count: int) -> list[list[float]]:
    boxes = np.arange(count * 4, dtype=np.float32).reshape(-1, 4)
    return boxes.sum(axis=1, keepdims=True).tolist()


async def test_a_mapped_step_runs_once_per_item_in_order() -> None:
    """Items in flight at once finish in any order; the outputs come back in item order, and
    the items go through the model's batcher (fewer executions than items)."""

    async def execute(BOX: Any) -> dict[str, Any]:
        await trio.sleep(0.001 * float(BOX[:, 0].max() % 5))  # later items may finish first
        return {"SCORE": BOX.sum(axis=1, keepdims=True)}

    async with orchestrion.open_server(models=mapped(summing(execute, count=2))) as server:
        response = await server.infer("pipe", {"COUNT": np.array([40], np.int32)})
        assert response.outputs["SCORES"].tolist() == expected_scores(40)
        stats = server.model_statistics("classify")[0]
        assert stats.inference_stats.success.count == 40
        assert stats.execution_count < 40  # the batcher gathered items
        assert server.step_statistics("pipe")[1].items == 40


async def test_a_model_that_does_not_batch_gets_each_item_alone() -> None:
    """Without max_batch_size the model gets the item itself, and outputs are stacked."""
    seen: list[tuple[int, ...]] = []

    def execute(BOX: Any) -> dict[str, Any]:
        seen.append(BOX.shape)
        return {"SCORE": BOX.sum(keepdims=True)}

    classify = classifier(execute)
    async with orchestrion.open_server(models=mapped(classify)) as server:
        response = await server.infer("pipe", {"COUNT": np.array([3], np.int32)})
    assert response.outputs["SCORES"].tolist() == expected_scores(3)
    assert seen == [(4,)] * 3


async def test_a_map_over_no_items_gives_empty_outputs_of_the_declared_type() -> None:
    """Zero items: the model never runs, the outputs are empty arrays of its types."""
    async with orchestrion.open_server(models=mapped(summing())) as server:
        response = await server.infer("pipe", {"COUNT": np.array([0], np.int32)})
        assert response.outputs["SCORES"].shape == (0, 1)
        assert response.outputs["SCORES"].dtype == np.float32
        assert server.model_statistics("classify")[0].execution_count == 0


async def test_items_in_flight_stay_within_the_bound(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """max_items_in_flight bounds the items sent and not yet answered."""
    now = {"in": 0, "peak": 0}

    async def execute(BOX: Any) -> dict[str, Any]:
        now["in"] += 1
        now["peak"] = max(now["peak"], now["in"])
        await trio.sleep(1)
        now["in"] -= 1
        return {"SCORE": BOX.sum(axis=1, keepdims=True)}

    classify = classifier(execute, max_batch_size=8, count=16)
    async with orchestrion.open_server(models=mapped(classify, max_items=3)) as server:
        response = await server.infer("pipe", {"COUNT": np.array([12], np.int32)})
    assert response.outputs["SCORES"].tolist() == expected_scores(12)
    assert now["peak"] == 3


async def test_a_failing_item_fails_the_run_naming_the_item() -> None:
    """An item's error is the run's, naming the step and the item; the server goes on."""

    def execute(BOX: Any) -> dict[str, Any]:
        if BOX[0] == 20:  # item 5
            raise ValueError("bad box")
        return {"SCORE": BOX.sum(keepdims=True)}

    classify = classifier(execute)
    async with orchestrion.open_server(models=mapped(classify)) as server:
        with pytest.raises(orchestrion.InferenceError, match=r"step\[1\] item 5 of 8: .*bad box"):
            await server.infer("pipe", {"COUNT": np.array([8], np.int32)})
        again = await server.infer("pipe", {"COUNT": np.array([3], np.int32)})
        assert again.outputs["SCORES"].tolist() == expected_scores(3)
        assert_idle(server, "pipe")


async def test_cancelling_a_request_in_the_middle_of_a_map_stops_its_items() -> None:
    """The client goes away while items are in flight: they are cancelled, no further item
    is sent, and every counter comes back to rest."""
    started: list[int] = []
    release = trio.Event()

    async def execute(BOX: Any) -> dict[str, Any]:
        started.append(int(BOX[0, 0]) // 4)
        await release.wait()
        return {"SCORE": BOX.sum(axis=1, keepdims=True)}

    classify = classifier(execute, max_batch_size=1, count=4)
    async with orchestrion.open_server(models=mapped(classify, max_items=4)) as server:
        with trio.move_on_after(1):
            await server.infer("pipe", {"COUNT": np.array([1000], np.int32)})
        await trio.testing.wait_all_tasks_blocked()
        assert sorted(started) == [0, 1, 2, 3]
        assert server.step_statistics("pipe")[1].items == 4
        assert_idle(server, "pipe")
        release.set()
        response = await server.infer("pipe", {"COUNT": np.array([2], np.int32)})
        assert response.outputs["SCORES"].tolist() == expected_scores(2)


async def test_memory_stays_bounded_while_a_map_fans_out_thousands_of_items() -> None:
    """5,000 items, 8 in flight: what is held besides the inputs and the gathered outputs
    stays small (items are sliced as they are sent, never all made at once)."""
    async with orchestrion.open_server(models=mapped(summing(), max_items=8)) as server:
        await server.infer("pipe", {"COUNT": np.array([10], np.int32)})  # warm
        tracemalloc.start()
        try:
            response = await server.infer("pipe", {"COUNT": np.array([5000], np.int32)})
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert response.outputs["SCORES"].tolist() == expected_scores(5000)
    # The inputs (80 kB), the outputs (20 kB) and one small answer per item (5,000 dicts
    # of a 1-element array, ~1.5 MB gathered before joining); all items at once would be
    # ~10 MB of requests and tasks.
    assert peak < 4_000_000, peak


async def test_max_inflight_requests_holds_through_a_mapped_step(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A mapped step holds one of the step's slots for the whole map: with a limit of 2,
    at most 2 runs are mapping at once."""

    async def execute(BOX: Any) -> dict[str, Any]:
        await trio.sleep(1)
        return {"SCORE": BOX.sum(axis=1, keepdims=True)}

    classify = classifier(execute, max_batch_size=8, count=64)
    peaks: list[int] = []
    async with orchestrion.open_server(models=mapped(classify, limit=2)) as server:
        async with trio.open_nursery() as nursery:
            for _ in range(6):
                nursery.start_soon(server.infer, "pipe", {"COUNT": np.array([3], np.int32)})
            for _ in range(20):
                await trio.sleep(0.25)
                peaks.append(server.step_statistics("pipe")[1].in_flight)
        assert max(peaks) == 2
        assert_idle(server, "pipe")


# -- constants, parameters, timeouts ----------------------------------------------------------


async def test_constants_feed_steps_as_tensors() -> None:
    """A constant is a tensor every request starts with, of its declared type and dims."""
    models = [
        model(
            "affine",
            lambda X, W, B: {"Y": X * W + B},
            [tensor("X", dims=(2,)), tensor("W", dims=(2,)), tensor("B", dims=(2,))],
            [tensor("Y", dims=(2,))],
            jit=False,
        ),
        ensemble(
            "pipe",
            [tensor("IN", dims=(2,))],
            [tensor("OUT", dims=(2,))],
            [step("affine", {"X": "IN", "W": "weights", "B": "bias"}, {"Y": "OUT"})],
            parameters={
                "constant.weights": constant("TYPE_FP32", [2], [2.0, 3.0]),
                "constant.bias": constant("TYPE_FP32", [2], [1.0, -1.0]),
            },
        ),
    ]
    async with orchestrion.open_server(models=models) as server:
        response = await server.infer("pipe", {"IN": np.array([1.0, 1.0], np.float32)})
    assert response.outputs["OUT"].tolist() == [3.0, 2.0]


async def test_step_parameters_reach_the_composing_model() -> None:
    """``step[N].parameters`` are added to the step's request, over the client's."""
    seen: list[dict[str, Any]] = []

    def execute(X: Any, request: InferRequest) -> dict[str, Any]:
        seen.append(dict(request.parameters))
        return {"Y": X}

    models = [
        model("echo", execute, [tensor("X", dims=ONE)], [tensor("Y", dims=ONE)], jit=False),
        ensemble(
            "pipe",
            [tensor("IN", dims=ONE)],
            [tensor("OUT", dims=ONE)],
            [step("echo", {"X": "IN"}, {"Y": "OUT"})],
            parameters={"step[0].parameters": json.dumps({"threshold": 0.5, "mode": "fast"})},
        ),
    ]
    async with orchestrion.open_server(models=models) as server:
        x = np.array([1.0], np.float32)
        await server.infer("pipe", {"IN": x}, parameters={"mode": "slow", "tenant": "t1"})
    assert seen == [{"mode": "fast", "tenant": "t1", "threshold": 0.5}]


async def test_a_step_timeout_fails_the_run_and_the_server_goes_on(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A step past its own timeout: the client gets InferenceTimeoutError naming the step
    and the parameter; the model's work is cancelled; later requests are served."""

    async def execute(X: Any) -> dict[str, Any]:
        await trio.sleep(float(X[0]))
        return {"Y": X}

    models = [
        model("slow", execute, [tensor("X", dims=ONE)], [tensor("Y", dims=ONE)], jit=False),
        ensemble(
            "pipe",
            [tensor("IN", dims=ONE)],
            [tensor("OUT", dims=ONE)],
            [step("slow", {"X": "IN"}, {"Y": "OUT"})],
            parameters={"step[0].timeout_ms": "250"},
        ),
    ]
    async with orchestrion.open_server(models=models) as server:
        start = trio.current_time()
        with pytest.raises(
            orchestrion.InferenceTimeoutError,
            match=r"step\[0\]: model 'slow' did not answer within the step's timeout of 250 ms "
            r"\(parameter 'step\[0\].timeout_ms'\)",
        ):
            await server.infer("pipe", {"IN": np.array([5.0], np.float32)})
        assert trio.current_time() - start == pytest.approx(0.25)
        fast = await server.infer("pipe", {"IN": np.array([0.1], np.float32)})
        assert fast.outputs["OUT"].tolist() == [pytest.approx(0.1)]
        await trio.testing.wait_all_tasks_blocked()
        assert_idle(server, "pipe")


# -- what holds through them ------------------------------------------------------------------


async def test_the_response_cache_answers_a_controlled_ensemble_and_its_items() -> None:
    """The ensemble's cache answers a repeated request; a mapped step's items are cached
    per item (a new request with the same boxes computes nothing new)."""
    models = mapped(cached(summing()))
    models[-1] = cached(models[-1])
    async with orchestrion.open_server(models=models, cache_config="local,size=1048576") as server:
        first = await server.infer("pipe", {"COUNT": np.array([5], np.int32)})
        again = await server.infer("pipe", {"COUNT": np.array([5], np.int32)})
        assert again.outputs["SCORES"].tolist() == first.outputs["SCORES"].tolist()
        assert server.model_statistics("pipe")[0].inference_stats.cache_hit.count == 1
        more = await server.infer("pipe", {"COUNT": np.array([6], np.int32)})
        assert more.outputs["SCORES"].tolist() == expected_scores(6)
        item_stats = server.model_statistics("classify")[0].inference_stats
        assert (item_stats.cache_hit.count, item_stats.cache_miss.count) == (5, 6)


async def test_constants_take_part_in_the_cache_key() -> None:
    """Two ensembles that differ only in a constant never share a cached answer."""

    def pipe(name: str, value: float) -> orchestrion.Model:
        return cached(
            ensemble(
                name,
                [tensor("IN", dims=ONE)],
                [tensor("OUT", dims=ONE)],
                [step("mul", {"X": "IN", "W": "w"}, {"Y": "OUT"})],
                parameters={"constant.w": constant("TYPE_FP32", [1], [value])},
            )
        )

    mul = model(
        "mul",
        lambda X, W: {"Y": X * W},
        [tensor("X", dims=ONE), tensor("W", dims=ONE)],
        [tensor("Y", dims=ONE)],
        jit=False,
    )
    models = [mul, pipe("two", 2.0), pipe("three", 3.0)]
    async with orchestrion.open_server(models=models, cache_config="local,size=1048576") as server:
        x = {"IN": np.array([1.0], np.float32)}
        assert (await server.infer("two", x)).outputs["OUT"].tolist() == [2.0]
        assert (await server.infer("three", x)).outputs["OUT"].tolist() == [3.0]
        assert (await server.infer("two", x)).outputs["OUT"].tolist() == [2.0]


async def test_controlled_ensembles_are_not_fused() -> None:
    """The fused call has no conditions, maps or loops: such an ensemble always runs on the
    scheduler (and gives the same answers)."""
    async with orchestrion.open_server(models=conditional()) as server:
        for _ in range(30):
            await server.infer("pipe", {"IN": np.array([1.0], np.float32)})
        assert orchestrion.testing.inside(server).fusion("pipe") is None


async def test_cancelling_a_request_in_the_middle_of_a_loop_stops_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The client goes away during an iteration: the iteration's model call is cancelled, no
    further iteration starts, and every counter comes back to rest."""
    started: list[int] = []

    async def execute(X: Any, N: Any) -> dict[str, Any]:
        started.append(int(N[0]))
        await trio.sleep(1 if N[0] < 2 else 1000)
        return {"Y": X, "AGAIN": np.array([True]), "N1": N + 1}

    models = refinement(max_iterations=10)
    models[0] = model(
        "halve",
        execute,
        [tensor("X", dims=(-1,)), tensor("N", "INT32", dims=ONE)],
        [
            tensor("Y", dims=(-1,)),
            tensor("AGAIN", "BOOL", dims=ONE),
            tensor("N1", "INT32", dims=ONE),
        ],
        jit=False,
    )
    async with orchestrion.open_server(models=models) as server:
        with trio.move_on_after(2.5) as scope:  # iterations 0 and 1 end, then 2 hangs
            await server.infer("pipe", {"IN": np.array([1.0], np.float32)})
        assert scope.cancelled_caught
        await trio.testing.wait_all_tasks_blocked()
        assert started == [0, 1, 2]
        assert server.model_statistics("halve")[0].pending_request_count == 0
        assert_idle(server, "pipe")


async def test_each_item_and_each_iteration_is_a_span() -> None:
    """Traced, a mapped step's items and a loop's iterations are each a span of their own,
    children of the client's request span."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    try:
        async with orchestrion.open_server(models=mapped(summing()), tracing=provider) as server:
            await server.infer("pipe", {"COUNT": np.array([5], np.int32)})
        mapped_spans = exporter.get_finished_spans()
        exporter.clear()
        async with orchestrion.open_server(models=refinement(), tracing=provider) as server:
            await server.infer("pipe", {"IN": np.array([100.0], np.float32)})
        loop_spans = exporter.get_finished_spans()
    finally:
        provider.shutdown()
    for spans, model_name, count in ((mapped_spans, "classify", 5), (loop_spans, "halve", 3)):
        root = next(s for s in spans if s.name == "InferRequest")
        children = [
            s for s in spans if s.parent is not None and s.parent.span_id == root.context.span_id
        ]
        assert sorted(s.name for s in children).count(model_name) == count, [
            s.name for s in children
        ]


async def test_metrics_count_runs_skips_and_items() -> None:
    """/metrics exports each step's runs, skips and map items as counters."""
    from prometheus_client.parser import text_string_to_metric_families

    async with orchestrion.open_server(models=conditional()) as server:
        await server.infer("pipe", {"IN": np.array([1.0], np.float32)})
        await server.infer("pipe", {"IN": np.array([-1.0], np.float32)})
        text = server.metrics_text()
    values = {
        (sample.name, sample.labels.get("step")): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.labels.get("ensemble") == "pipe"
    }
    assert values[("orchestrion_step_runs_total", "1")] == 1
    assert values[("orchestrion_step_skipped_total", "1")] == 1
    assert values[("orchestrion_step_skipped_total", "0")] == 0
    assert values[("orchestrion_step_items_total", "1")] == 0


@pytest.mark.parametrize("mode", ["on", "xla"])
async def test_an_ensemble_that_declares_only_constants_is_fused(mode: str) -> None:
    """Constants need no scheduler: jitted steps still run fused (both fusion modes), with
    the scheduler's answers."""

    def pipe(name: str, fusion: str) -> orchestrion.Model:
        return ensemble(
            name,
            [tensor("IN", dims=(2,))],
            [tensor("OUT", dims=(2,))],
            [
                step("mul", {"X": "IN", "W": "w"}, {"Y": "mid"}),
                step("add", {"X": "mid", "W": "b"}, {"Y": "OUT"}),
            ],
            parameters={
                "constant.w": constant("TYPE_FP32", [2], [2.0, 3.0]),
                "constant.b": constant("TYPE_FP32", [2], [1.0, -1.0]),
                "fusion": fusion,
            },
        )

    two = [tensor("X", dims=(2,)), tensor("W", dims=(2,))]
    models = [
        model("mul", lambda X, W: {"Y": X * W}, two, [tensor("Y", dims=(2,))]),
        model("add", lambda X, W: {"Y": X + W}, two, [tensor("Y", dims=(2,))]),
        pipe("fused", mode),
        pipe("scheduled", "off"),
    ]
    x = {"IN": np.array([1.0, 2.0], np.float32)}
    async with orchestrion.open_server(models=models) as server:
        assert await orchestrion.testing.infer_until_fused(server, "fused", x)
        fused = await server.infer("fused", x)
        scheduled = await server.infer("scheduled", x)
    assert fused.outputs["OUT"].tolist() == scheduled.outputs["OUT"].tolist() == [3.0, 5.0]


def countdown(name: str = "dec", delay: float = 0.01) -> orchestrion.Model:
    """Y = X - 1, AGAIN = Y > 0 (async: each iteration waits ``delay`` seconds)."""

    async def execute(X: Any) -> dict[str, Any]:
        await trio.sleep(delay)
        return {"Y": X - 1, "AGAIN": np.array([X[0] - 1 > 0])}

    return model(
        name,
        execute,
        [tensor("X", dims=ONE)],
        [tensor("Y", dims=ONE), tensor("AGAIN", "BOOL", dims=ONE)],
        jit=False,
    )


@pytest.mark.parametrize("steps", [1, 2])
async def test_loops_do_not_deadlock_under_max_inflight_requests(
    autojump_clock: trio.testing.MockClock, steps: int
) -> None:
    """With max_inflight_requests 1, runs re-entering a loop and runs entering it wait for
    the same slots: a loop's step gives its slot back before it waits to send, so every
    run finishes (one-step and two-step loops, many runs at once)."""
    wiring = [step("dec", {"X": "IN"}, {"Y": "OUT" if steps == 1 else "mid", "AGAIN": "again"})]
    if steps == 2:
        wiring.append(step("pass", {"X": "mid"}, {"Y": "OUT"}))
    pipe = ensemble(
        "pipe",
        [tensor("IN", dims=ONE)],
        [tensor("OUT", dims=ONE)],
        wiring,
        max_inflight_requests=1,
        parameters={
            "loop.l": json.dumps(
                {
                    "steps": list(range(steps)),
                    "while": "again",
                    "max_iterations": 10,
                    "next": {"OUT": "IN"},
                }
            )
        },
    )
    models = [countdown(), scaler("pass", 1.0), pipe]
    async with orchestrion.open_server(models=models) as server:
        results: dict[int, Any] = {}

        async def one(index: int) -> None:
            with trio.fail_after(60):
                answer = await server.infer("pipe", {"IN": np.array([3.0], np.float32)})
            results[index] = answer.outputs["OUT"].tolist()

        async with trio.open_nursery() as nursery:
            for index in range(6):
                nursery.start_soon(one, index)
        assert results == {i: [0.0] for i in range(6)}
        assert server.step_statistics("pipe")[0].runs == 18
        assert_idle(server, "pipe")


async def test_two_loops_one_after_the_other() -> None:
    """The second loop starts from the first one's last output (its 'next' feeds a tensor
    the first loop makes, once that loop is over)."""
    halve = model(
        "halve",
        lambda X: {"Y": X / 2, "AGAIN": np.array([X[0] / 2 > 8])},
        [tensor("X", dims=ONE)],
        [tensor("Y", dims=ONE), tensor("AGAIN", "BOOL", dims=ONE)],
        jit=False,
    )
    pipe = ensemble(
        "pipe",
        [tensor("IN", dims=ONE)],
        [tensor("OUT", dims=ONE)],
        [
            step("halve", {"X": "IN"}, {"Y": "coarse", "AGAIN": "a1"}),
            step("dec", {"X": "coarse"}, {"Y": "OUT", "AGAIN": "a2"}),
        ],
        parameters={
            "loop.a": json.dumps(
                {"steps": [0], "while": "a1", "max_iterations": 10, "next": {"coarse": "IN"}}
            ),
            "loop.b": json.dumps(
                {"steps": [1], "while": "a2", "max_iterations": 100, "next": {"OUT": "coarse"}}
            ),
        },
    )
    async with orchestrion.open_server(models=[halve, countdown(delay=0), pipe]) as server:
        response = await server.infer("pipe", {"IN": np.array([100.0], np.float32)})
        # 100 -> 50 -> 25 -> 12.5 -> 6.25, then 6.25 - 1 ... until at most 0: -0.75
        assert response.outputs["OUT"].tolist() == [-0.75]
        assert [s.runs for s in server.step_statistics("pipe")] == [4, 7]


async def test_a_map_over_a_tensor_an_earlier_model_left_out() -> None:
    """As without a map: the step's model is asked once and refuses, naming the step that
    left the tensor out."""

    def detect(COUNT: Any) -> dict[str, Any]:
        count = int(COUNT[0])
        return {} if count == 0 else {"BOXES": np.ones((count, 4), np.float32)}

    models = mapped(classifier(lambda BOX: {"SCORE": BOX.sum(keepdims=True)}))
    models[0] = model(
        "detect",
        detect,
        [tensor("COUNT", "INT32", dims=ONE)],
        [tensor("BOXES", dims=(-1, 4))],
        jit=False,
    )
    async with orchestrion.open_server(models=models) as server:
        with pytest.raises(
            orchestrion.StepRefusedError,
            match=r"step\[1\]: model 'classify': missing required input 'BOX' \(tensor 'boxes': "
            r"step\[0\]'s model 'detect' left its output 'BOXES' out\)",
        ):
            await server.infer("pipe", {"COUNT": np.array([0], np.int32)})
        response = await server.infer("pipe", {"COUNT": np.array([2], np.int32)})
        assert response.outputs["SCORES"].tolist() == [[4.0], [4.0]]


async def test_items_whose_outputs_differ_in_shape_are_an_error() -> None:
    """Outputs that cannot be joined (a -1 dim that differs per item) fail the request with
    a message that says so, naming the step."""
    ragged = model(
        "classify",
        lambda BOX: {"SCORE": np.ones(int(BOX[0]) // 4 % 2 + 1, np.float32)},  # item parity
        [tensor("BOX", dims=(4,))],
        [tensor("SCORE", dims=(-1,))],
        jit=False,
    )
    models = mapped(ragged)
    models[-1] = ensemble(
        "pipe",
        [tensor("COUNT", "INT32", dims=ONE)],
        [tensor("SCORES", dims=(-1, -1))],
        [
            step("detect", {"COUNT": "COUNT"}, {"BOXES": "boxes"}),
            step("classify", {"BOX": "boxes"}, {"SCORE": "SCORES"}),
        ],
        parameters={"step[1].map": "boxes"},
    )
    async with orchestrion.open_server(models=models) as server:
        with pytest.raises(
            orchestrion.InferenceError,
            match=r"step\[1\]: model 'classify': the items' output 'SCORE' differ in shape "
            r"\(\[1\], \[2\]\)",
        ):
            await server.infer("pipe", {"COUNT": np.array([3], np.int32)})
