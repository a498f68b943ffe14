"""What orchestrion's ensemble machinery costs per request, against the cheapest trio pipeline.

How this works. One tiny pipeline, the shape of the seed example: ``preprocess`` computes
``x*2+1`` on a ``[1,16]`` FP32 tensor, then ``classify`` (sum over axis 1, output ``[1]``)
and ``segment`` (``x - mean(x)``, output ``[1,16]``) run in parallel on its result. The
models are so small that almost all the time goes to scheduling, which is what is measured.
Three variants run the same three Python functions, each compiled with ``jax.jit``:

(a) ``orchestrion``: the functions as `orchestrion.Model` definitions plus an ensemble
    config, served by `orchestrion.open_server`; C client tasks call
    ``await server.infer("pipeline", {"INPUT": x})`` in a loop until N requests are done.
(b) ``floor``: a hand-written minimal trio pipeline: one stage task per step, connected by
    unbounded memory channels, fan-out of each request to the two branch stages and fan-in
    by a counter on the request, whose reply `trio.Event` the last branch sets. The same C
    client tasks drive it. No validation, statistics, cancellation or error handling: it is
    the least any trio pipeline of three actors can cost.
(c) ``sync``: the three jitted calls one after another in a plain loop, no trio at all.
    Concurrency means nothing here, so it gets one row of its own (concurrency ``-``).

Every measurement is one `trio.run` (for (a) it also opens the server, so JAX compiles
there, outside the timed part): a warm-up of a few hundred requests, then N timed requests,
each request's latency taken with `time.perf_counter_ns` around its call. The machine is
shared and noisy, so each measurement is repeated R times with the variants interleaved
(a, b, c, a, b, c, ...) and the table shows the median over repeats of the throughput and
of the p50 and p99 latencies.

Reading the ratio. ``a/b`` is orchestrion's throughput divided by the floor's at the same
concurrency: 1.0 means the ensemble machinery costs nothing beyond the channel hops any
trio pipeline pays; 0.5 means each request costs orchestrion twice the floor's CPU time.
Since the process runs on one event loop, ``1 / throughput`` is roughly the CPU time per
request, and the gap between (b) and (c) is what trio's tasks and channels alone cost.

Run: ``.venv/bin/python bench/pipeline.py [--requests N] [--concurrency 1,16,64]
[--repeats R] [--warmup W] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import platform
import statistics
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import attrs
import jax
import jax.numpy as jnp
import numpy as np
import trio

import orchestrion
from orchestrion import (
    DataType,
    EnsembleScheduling,
    EnsembleStep,
    ModelConfig,
    TensorConfig,
)
from orchestrion.protocols import DynamicBatching
from orchestrion.testing import inside

SHAPE = (1, 16)
VARIANTS = ("orchestrion", "floor", "sync", "batching")
LABELS = {
    "orchestrion": "(a) orchestrion",
    "floor": "(b) trio floor",
    "sync": "(c) sync loop",
    "batching": "(d) orchestrion, batching",
}
BATCH = 64
FUSION = ["on"]
"""The ensembles' ``fusion`` parameter (``--fusion``): on (the default), xla or off."""


# -- the models: plain Python functions, the same for every variant ---------------------------


def preprocess(INPUT: jax.Array) -> dict[str, jax.Array]:
    """INPUT float32 [1,16] -> PREPROCESSED = INPUT*2+1."""
    return {"PREPROCESSED": INPUT * 2 + 1}


def classify(X: jax.Array) -> dict[str, jax.Array]:
    """X float32 [1,16] -> CLASSIFICATION float32 [1], the sum over axis 1."""
    return {"CLASSIFICATION": jnp.sum(X, axis=1)}


def segment(X: jax.Array) -> dict[str, jax.Array]:
    """X float32 [1,16] -> SEGMENTATION float32 [1,16], X minus its mean."""
    return {"SEGMENTATION": X - jnp.mean(X)}


def classify_rows(X: jax.Array) -> dict[str, jax.Array]:
    """X float32 [B,16] -> CLASSIFICATION float32 [B,1], each row's sum."""
    return {"CLASSIFICATION": jnp.sum(X, axis=1, keepdims=True)}


def segment_rows(X: jax.Array) -> dict[str, jax.Array]:
    """X float32 [B,16] -> SEGMENTATION float32 [B,16], each row minus its mean."""
    return {"SEGMENTATION": X - jnp.mean(X, axis=1, keepdims=True)}


def reference(x: np.ndarray) -> dict[str, np.ndarray]:
    """What the pipeline must answer, computed with numpy."""
    pre = x * np.float32(2) + np.float32(1)
    return {"CLASSIFICATION": pre.sum(axis=1), "SEGMENTATION": pre - pre.mean()}


def _tensor(name: str, dims: tuple[int, ...]) -> TensorConfig:
    return TensorConfig(name=name, data_type=DataType.FP32, dims=dims)


def orchestrion_models() -> list[orchestrion.Model]:
    """The three models and the ensemble ``pipeline`` that wires them, defined in Python."""
    steps = (
        EnsembleStep(
            model_name="preprocess",
            input_map={"INPUT": "INPUT"},
            output_map={"PREPROCESSED": "preprocessed"},
        ),
        EnsembleStep(
            model_name="classify",
            input_map={"X": "preprocessed"},
            output_map={"CLASSIFICATION": "CLASSIFICATION"},
        ),
        EnsembleStep(
            model_name="segment",
            input_map={"X": "preprocessed"},
            output_map={"SEGMENTATION": "SEGMENTATION"},
        ),
    )
    return [
        orchestrion.Model(
            config=ModelConfig(
                name="preprocess",
                max_batch_size=0,
                input=(_tensor("INPUT", SHAPE),),
                output=(_tensor("PREPROCESSED", SHAPE),),
            ),
            execute=preprocess,
        ),
        orchestrion.Model(
            config=ModelConfig(
                name="classify",
                max_batch_size=0,
                input=(_tensor("X", SHAPE),),
                output=(_tensor("CLASSIFICATION", (1,)),),
            ),
            execute=classify,
        ),
        orchestrion.Model(
            config=ModelConfig(
                name="segment",
                max_batch_size=0,
                input=(_tensor("X", SHAPE),),
                output=(_tensor("SEGMENTATION", SHAPE),),
            ),
            execute=segment,
        ),
        orchestrion.Model(
            config=ModelConfig(
                name="pipeline",
                platform="ensemble",
                max_batch_size=0,
                input=(_tensor("INPUT", SHAPE),),
                output=(_tensor("CLASSIFICATION", (1,)), _tensor("SEGMENTATION", SHAPE)),
                ensemble_scheduling=EnsembleScheduling(step=steps, max_inflight_requests=0),
                parameters={"fusion": FUSION[0]},
            ),
        ),
    ]


def batching_models() -> list[orchestrion.Model]:
    """(d): the same pipeline with ``max_batch_size: 64`` and ``dynamic_batching { }`` on
    every model (the ensemble batches too): a request is one row ``[1,16]``."""
    plain = {m.config.name: m for m in orchestrion_models()}
    functions = {"preprocess": preprocess, "classify": classify_rows, "segment": segment_rows}
    models = []
    for name, model in plain.items():
        config = model.config
        dims = {"CLASSIFICATION": (1,)}
        inputs = tuple(attrs.evolve(t, dims=SHAPE[1:]) for t in config.input)
        outputs = tuple(attrs.evolve(t, dims=dims.get(t.name, SHAPE[1:])) for t in config.output)
        changes: dict[str, Any] = {"max_batch_size": BATCH, "input": inputs, "output": outputs}
        if name in functions:
            changes["dynamic_batching"] = DynamicBatching()
        code = model.code
        if name in functions and isinstance(code, orchestrion.Function):
            code = attrs.evolve(code, execute=functions[name])
        models.append(attrs.evolve(model, config=attrs.evolve(config, **changes), code=code))
    return models


# The floor and the sync loop call these; orchestrion jits the same functions itself.
PREPROCESS = jax.jit(preprocess)
CLASSIFY = jax.jit(classify)
SEGMENT = jax.jit(segment)


# -- (b) the floor: the least a trio pipeline of three actors can do ------------------------


class _Request:
    """One request travelling through the floor pipeline."""

    __slots__ = ("done", "outputs", "pending", "preprocessed", "x")

    def __init__(self, x: np.ndarray) -> None:
        self.x = x
        self.preprocessed: np.ndarray | None = None
        self.outputs: dict[str, np.ndarray] = {}
        self.pending = 2
        self.done = trio.Event()


async def _preprocess_stage(
    receive: trio.MemoryReceiveChannel[_Request],
    to_classify: trio.MemorySendChannel[_Request],
    to_segment: trio.MemorySendChannel[_Request],
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    async with receive, to_classify, to_segment:
        task_status.started()
        async for request in receive:
            request.preprocessed = np.asarray(PREPROCESS(INPUT=request.x)["PREPROCESSED"])
            # Fan-out. Unbounded channels, like max_inflight_requests: 0, never block.
            to_classify.send_nowait(request)
            to_segment.send_nowait(request)


async def _branch_stage(
    receive: trio.MemoryReceiveChannel[_Request],
    fn: Callable[..., dict[str, jax.Array]],
    output: str,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    async with receive:
        task_status.started()
        async for request in receive:
            request.outputs[output] = np.asarray(fn(X=request.preprocessed)[output])
            request.pending -= 1
            if request.pending == 0:
                request.done.set()


@contextlib.asynccontextmanager
async def open_floor() -> AsyncIterator[Callable[[np.ndarray], Awaitable[dict[str, np.ndarray]]]]:
    """Run the floor pipeline; yields ``infer(x) -> outputs``. Stages end on exit."""
    send, receive = trio.open_memory_channel[_Request](math.inf)
    to_classify, from_preprocess_c = trio.open_memory_channel[_Request](math.inf)
    to_segment, from_preprocess_s = trio.open_memory_channel[_Request](math.inf)
    async with trio.open_nursery() as nursery:
        await nursery.start(_branch_stage, from_preprocess_c, CLASSIFY, "CLASSIFICATION")
        await nursery.start(_branch_stage, from_preprocess_s, SEGMENT, "SEGMENTATION")
        await nursery.start(_preprocess_stage, receive, to_classify, to_segment)

        async def infer(x: np.ndarray) -> dict[str, np.ndarray]:
            request = _Request(x)
            send.send_nowait(request)
            await request.done.wait()
            return request.outputs

        async with send:
            yield infer


# -- (c) the sync loop ----------------------------------------------------------------------


def sync_infer(x: np.ndarray) -> dict[str, np.ndarray]:
    """The three jitted calls one after another."""
    pre = np.asarray(PREPROCESS(INPUT=x)["PREPROCESSED"])
    return {
        "CLASSIFICATION": np.asarray(CLASSIFY(X=pre)["CLASSIFICATION"]),
        "SEGMENTATION": np.asarray(SEGMENT(X=pre)["SEGMENTATION"]),
    }


# -- measuring ------------------------------------------------------------------------------


class Sample:
    """One measurement: every request's latency and the wall time of the whole batch."""

    def __init__(self, latencies_ns: np.ndarray, elapsed_ns: int) -> None:
        self.latencies_ns = latencies_ns
        self.elapsed_ns = elapsed_ns

    @property
    def throughput(self) -> float:
        return len(self.latencies_ns) / (self.elapsed_ns / 1e9)

    def percentile_us(self, q: float) -> float:
        return float(np.percentile(self.latencies_ns, q)) / 1e3


async def _drive(call: Callable[[], Awaitable[Any]], n: int, concurrency: int) -> Sample:
    """``concurrency`` client tasks calling ``call()`` until ``n`` calls are done in total."""
    latencies = np.empty(n, dtype=np.int64)
    next_index = 0

    async def client() -> None:
        nonlocal next_index
        clock = time.perf_counter_ns
        while next_index < n:
            index = next_index
            next_index += 1
            t0 = clock()
            await call()
            latencies[index] = clock() - t0

    start = time.perf_counter_ns()
    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(client)
    return Sample(latencies, time.perf_counter_ns() - start)


def _measure_server(
    models: list[orchestrion.Model], x: np.ndarray, n: int, concurrency: int, warmup: int
) -> Sample:
    """(a) or (d): ``models`` served by open_server, warmed up, then timed."""

    async def main() -> Sample:
        async with orchestrion.open_server(models=models) as server:

            async def call() -> Any:
                return await server.infer("pipeline", {"INPUT": x})

            await _drive(call, warmup, concurrency)
            await _settle(server)
            await _drive(call, warmup, concurrency)
            return await _drive(call, n, concurrency)

    return trio.run(main)


def measure_orchestrion(x: np.ndarray, n: int, concurrency: int, warmup: int) -> Sample:
    return _measure_server(orchestrion_models(), x, n, concurrency, warmup)


async def _settle(server: orchestrion.AsyncServer) -> None:
    """Wait (at most 60 s) for the fused calls compiling in the background (``--fusion
    xla``): the timed part then measures the server as it will run."""
    fusion = inside(server).fusion("pipeline")
    deadline = time.monotonic() + 60
    while fusion is not None and fusion._compiling and time.monotonic() < deadline:  # noqa: ASYNC110
        await trio.sleep(0.01)


def measure_floor(x: np.ndarray, n: int, concurrency: int, warmup: int) -> Sample:
    async def main() -> Sample:
        async with open_floor() as infer:

            async def call() -> Any:
                return await infer(x)

            await _drive(call, warmup, concurrency)
            return await _drive(call, n, concurrency)

    return trio.run(main)


def measure_sync(x: np.ndarray, n: int, concurrency: int, warmup: int) -> Sample:
    del concurrency  # one caller, by construction
    for _ in range(warmup):
        sync_infer(x)
    latencies = np.empty(n, dtype=np.int64)
    clock = time.perf_counter_ns
    start = clock()
    for index in range(n):
        t0 = clock()
        sync_infer(x)
        latencies[index] = clock() - t0
    return Sample(latencies, clock() - start)


def measure_batching(x: np.ndarray, n: int, concurrency: int, warmup: int) -> Sample:
    return _measure_server(batching_models(), x, n, concurrency, warmup)


MEASURE = {
    "orchestrion": measure_orchestrion,
    "floor": measure_floor,
    "sync": measure_sync,
    "batching": measure_batching,
}


def verify(x: np.ndarray) -> None:
    """Every variant answers what numpy computes (raises AssertionError otherwise)."""

    async def main() -> tuple[dict[str, np.ndarray], ...]:
        async with orchestrion.open_server(models=orchestrion_models()) as server:
            served = dict((await server.infer("pipeline", {"INPUT": x})).outputs)
        async with orchestrion.open_server(models=batching_models()) as server:
            batched = dict((await server.infer("pipeline", {"INPUT": x})).outputs)
        batched["CLASSIFICATION"] = batched["CLASSIFICATION"].reshape(-1)  # [1,1] -> [1]
        async with open_floor() as infer:
            floor = await infer(x)
        return served, floor, batched

    served, floor, batched = trio.run(main)
    expected = reference(x)
    variants = (("orchestrion", served), ("floor", floor), ("sync", sync_infer(x)))
    for variant, outputs in (*variants, ("batching", batched)):
        assert outputs.keys() == expected.keys(), (variant, sorted(outputs))
        for name, want in expected.items():
            got = outputs[name]
            assert got.dtype == np.float32, (variant, name, got.dtype)
            assert got.shape == want.shape, (variant, name, got.shape)
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6, err_msg=variant)


# -- reporting ------------------------------------------------------------------------------


def summarize(samples: list[Sample]) -> dict[str, Any]:
    return {
        "throughput_rps": statistics.median(s.throughput for s in samples),
        "p50_us": statistics.median(s.percentile_us(50) for s in samples),
        "p99_us": statistics.median(s.percentile_us(99) for s in samples),
        "repeats": [
            {
                "throughput_rps": s.throughput,
                "p50_us": s.percentile_us(50),
                "p99_us": s.percentile_us(99),
                "elapsed_s": s.elapsed_ns / 1e9,
            }
            for s in samples
        ],
    }


def table(rows: list[dict[str, Any]]) -> str:
    header = ("concurrency", "variant", "req/s", "p50 µs", "p99 µs", "÷ (b)")
    cells = [header]
    for row in rows:
        ratio = row.get("a_over_b")
        cells.append(
            (
                str(row["concurrency"]),
                LABELS[row["variant"]],
                f"{row['throughput_rps']:,.0f}",
                f"{row['p50_us']:,.1f}",
                f"{row['p99_us']:,.1f}",
                f"{ratio:.3f}" if ratio is not None else "",
            )
        )
    widths = [max(len(line[i]) for line in cells) for i in range(len(header))]
    lines = []
    for number, line in enumerate(cells):
        parts = [
            cell.ljust(width) if i == 1 else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(line, widths, strict=True))
        ]
        lines.append("  ".join(parts).rstrip())
        if number == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _concurrencies(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("a comma-separated list of positive integers")
    return values


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=5000, help="timed requests (N)")
    parser.add_argument("--concurrency", type=_concurrencies, default=[1, 16, 64])
    parser.add_argument("--repeats", type=int, default=3, help="measurements per cell (R)")
    parser.add_argument("--warmup", type=int, default=300, help="untimed requests first")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument(
        "--fusion",
        choices=["on", "xla", "off"],
        default="on",
        help="the ensembles' fusion parameter (see docs/guide.md)",
    )
    args = parser.parse_args(argv)
    FUSION[0] = args.fusion

    began = time.perf_counter()
    environment = {
        "python": platform.python_version(),
        "jax": jax.__version__,
        "trio": trio.__version__,
        "numpy": np.__version__,
        "orchestrion": orchestrion.__version__,
        "jax_device": str(jax.devices()[0]),
        "cpu_count": os.cpu_count(),
    }
    print(
        f"Python {environment['python']}, jax {environment['jax']} "
        f"({environment['jax_device']}), trio {environment['trio']}, "
        f"numpy {environment['numpy']}, os.cpu_count() = {environment['cpu_count']}"
    )
    print(
        f"{args.requests} requests per measurement after {args.warmup} warm-up, "
        f"median of {args.repeats} interleaved repeats"
    )

    x = np.random.default_rng(0).standard_normal(SHAPE).astype(np.float32)
    verify(x)
    print("outputs of (a), (b), (c) and (d) match numpy")

    samples: dict[tuple[int, str], list[Sample]] = {}
    for concurrency in args.concurrency:
        for _ in range(args.repeats):
            for variant in VARIANTS:
                gc.collect()
                sample = MEASURE[variant](x, args.requests, concurrency, args.warmup)
                samples.setdefault((concurrency, variant), []).append(sample)

    rows: list[dict[str, Any]] = []
    for concurrency in args.concurrency:
        a = summarize(samples[concurrency, "orchestrion"])
        b = summarize(samples[concurrency, "floor"])
        d = summarize(samples[concurrency, "batching"])
        a["a_over_b"] = a["throughput_rps"] / b["throughput_rps"]
        d["a_over_b"] = d["throughput_rps"] / b["throughput_rps"]
        rows.append({"concurrency": concurrency, "variant": "orchestrion", **a})
        rows.append({"concurrency": concurrency, "variant": "floor", **b})
        rows.append({"concurrency": concurrency, "variant": "batching", **d})
    # The sync loop ignores concurrency: its samples from every round make one row.
    pooled = [s for c in args.concurrency for s in samples[c, "sync"]]
    rows.append({"concurrency": "-", "variant": "sync", **summarize(pooled)})

    print()
    print(table(rows))
    took = time.perf_counter() - began
    print(f"\ntotal time: {took:.1f} s")

    if args.json:
        result = {
            "environment": environment,
            "settings": {
                "requests": args.requests,
                "warmup": args.warmup,
                "repeats": args.repeats,
                "concurrency": args.concurrency,
            },
            "rows": rows,
            "total_s": took,
        }
        with open(args.json, "w") as file:
            json.dump(result, file, indent=2)
            file.write("\n")


if __name__ == "__main__":
    main()
