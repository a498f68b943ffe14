"""The load `tune` puts on a candidate, and what it measures: throughput, latency and memory
at each concurrency, once stable.

How this works. `request_pool` makes the requests: from sample requests the user gives (an
``example.py`` with ``make_inputs``, as ``orchestrion run`` reads, or an ``.npz`` file of one
request's inputs), or else from the model's config (every required input, its dims with -1
as 1 or as ``--shape`` says, random values of its type; BYTES as random 16-byte strings).
`measure` then drives a call (`Call`: the in-process server's ``infer``, or a client's) at
each concurrency with that many tasks that each send their next request when the last one
is answered, as perf_analyzer's concurrency mode does. Time is cut into windows; the first
is warm-up and never counted. When requests fail and none has been answered by the end of a
window, the candidate fails (`AllRequestsFailed`, with the first error); otherwise failures
are counted in the point. A point is stable, by perf_analyzer's rule, when the
throughput and the mean latency of each of the last three windows are within ``stability``
of those three windows' mean; after ``max_windows`` it is kept and marked unstable. The
latency percentiles are those of every request the last three windows completed. A window
that completes fewer than `MIN_WINDOW_REQUESTS` requests doubles the next one's length (up
to eight times), so slow models are measured over enough requests.

`MemorySampler` reads the process's resident memory (and, on GPUs, JAX's device memory in
use) every 20 ms while a candidate is loaded and measured: its peak over what was resident
before the candidate loaded is the candidate's memory.
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import trio
import trio.lowlevel

from ..protocols import ConfigError, DataType, ModelConfig, OrchestrionError

Inputs = Mapping[str, Any]
Call = Callable[[Inputs], Awaitable[object]]
"""Send one request and wait for its answer (raises `OrchestrionError` when it fails)."""

POOL_SIZE = 16
"""Distinct requests generated from a config (perf_analyzer also reuses a few)."""
MIN_WINDOW_REQUESTS = 10


@attrs.frozen(kw_only=True)
class LoadSettings:
    """How `measure` loads a candidate and decides a point is stable."""

    concurrency: tuple[int, ...] = (1, 4, 16)
    window_s: float = 0.5
    """A measurement window's length (perf_analyzer's --measurement-interval, in seconds)."""
    stability: float = 0.10
    """The spread the last three windows may have (perf_analyzer's --stability-percentage)."""
    max_windows: int = 10
    """Windows measured at most per concurrency (perf_analyzer's --max-trials)."""


@attrs.frozen(kw_only=True)
class Point:
    """One concurrency's measurement."""

    concurrency: int
    throughput: float
    """Answered requests per second."""
    p50_ms: float
    p99_ms: float
    mean_ms: float
    requests: int
    """Answered requests in the counted windows."""
    errors: int
    """Failed requests over the whole point, warm-up included."""
    stable: bool
    windows: int


class AllRequestsFailed(OrchestrionError):
    """No request of a window was answered: the candidate does not serve this load."""


@attrs.define
class _Log:
    """What the client tasks record: each answer's end time and latency, and the errors."""

    ends: list[float] = attrs.Factory(list)
    latencies: list[float] = attrs.Factory(list)
    errors: int = 0
    first_error: str = ""

    def since(self, start: float) -> int:
        """The index of the first answer that ended at or after ``start``."""
        # Answers are appended in end order (one event loop): a search, not a scan.
        lo, hi = 0, len(self.ends)
        while lo < hi:
            mid = (lo + hi) // 2
            if self.ends[mid] < start:
                lo = mid + 1
            else:
                hi = mid
        return lo


async def measure(
    call: Call,
    pool: Sequence[Inputs],
    settings: LoadSettings,
    on_point: Callable[[Point], None],
) -> None:
    """Every concurrency of ``settings``, measured in turn, each point given to ``on_point``
    as it is measured (a run cut short keeps the points before).

    Raises:
        AllRequestsFailed: requests failed and none was answered (the first error is in
            the message).
    """
    for concurrency in settings.concurrency:
        on_point(await _measure_one(call, pool, settings, concurrency))


async def _measure_one(
    call: Call, pool: Sequence[Inputs], settings: LoadSettings, concurrency: int
) -> Point:
    log = _Log()

    async def client(first: int) -> None:
        index = first
        while True:
            inputs = pool[index % len(pool)]
            index += concurrency
            started = time.perf_counter()
            try:
                await call(inputs)
            except OrchestrionError as exc:
                log.errors += 1
                log.first_error = log.first_error or str(exc)
                await trio.lowlevel.checkpoint()  # a failing model must not starve the controller
                continue
            ended = time.perf_counter()
            log.ends.append(ended)
            log.latencies.append(ended - started)

    point: Point | None = None
    async with trio.open_nursery() as nursery:
        for first in range(concurrency):
            nursery.start_soon(client, first)
        try:
            point = await _windows(log, settings, concurrency)
        finally:
            nursery.cancel_scope.cancel()
    if point is None:  # raised here, not inside the nursery: one error, not a group
        raise AllRequestsFailed(f"every request failed: {log.first_error}")
    return point


async def _windows(log: _Log, settings: LoadSettings, concurrency: int) -> Point | None:
    """The point, once stable (or after ``max_windows``); None: requests failed and none
    was ever answered."""
    length = settings.window_s
    await trio.sleep(length)  # warm-up: never counted
    windows: list[tuple[float, float, int, int]] = []  # (start, end, first, last) answers
    while True:
        start, first = time.perf_counter(), len(log.ends)
        await trio.sleep(length)
        end, last = time.perf_counter(), len(log.ends)
        if not log.ends and log.errors:
            return None
        windows.append((start, end, first, last))
        if last - first < MIN_WINDOW_REQUESTS:
            length = min(length * 2, settings.window_s * 8)
        if len(windows) >= 3 and _stable(log, windows[-3:], settings.stability):
            return _point(log, windows[-3:], concurrency, True, len(windows))
        if len(windows) >= settings.max_windows:
            return _point(log, windows[-3:], concurrency, False, len(windows))


def _stable(log: _Log, windows: Sequence[tuple[float, float, int, int]], spread: float) -> bool:
    rates = [(last - first) / (end - start) for start, end, first, last in windows]
    means = [
        sum(log.latencies[first:last]) / (last - first) if last > first else math.inf
        for _, _, first, last in windows
    ]
    return _within(rates, spread) and _within(means, spread)


def _within(values: Sequence[float], spread: float) -> bool:
    if any(not math.isfinite(v) for v in values):
        return False
    mean = sum(values) / len(values)
    return mean > 0 and all(abs(v - mean) <= spread * mean for v in values)


def _point(
    log: _Log,
    windows: Sequence[tuple[float, float, int, int]],
    concurrency: int,
    stable: bool,
    count: int,
) -> Point:
    start, first = windows[0][0], windows[0][2]
    end, last = windows[-1][1], windows[-1][3]
    latencies = np.asarray(log.latencies[first:last]) * 1000.0
    if latencies.size == 0:
        latencies = np.asarray([math.inf])
    return Point(
        concurrency=concurrency,
        throughput=(last - first) / (end - start),
        # Nearest rank, as perf_analyzer reports percentiles (no interpolation).
        p50_ms=float(np.percentile(latencies, 50, method="inverted_cdf")),
        p99_ms=float(np.percentile(latencies, 99, method="inverted_cdf")),
        mean_ms=float(latencies.mean()),
        requests=last - first,
        errors=log.errors,
        stable=stable,
        windows=count,
    )


# -- the requests ---------------------------------------------------------------------------


def request_pool(
    config: ModelConfig,
    *,
    samples: Path | None = None,
    batch_size: int = 1,
    shapes: Mapping[str, Sequence[int]] | None = None,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """The requests `measure` sends, in turn.

    Raises:
        ConfigError: ``samples`` cannot be read, or an input's shape is left open (-1 in
            ``dims``, with ``--shape`` naming it wrongly).
    """
    rng = np.random.default_rng(seed)
    if samples is not None:
        return _samples(samples, rng)
    shapes = dict(shapes or {})
    unknown = set(shapes) - {t.name for t in config.input}
    if unknown:
        raise ConfigError(f"--shape: '{config.name}' has no input {', '.join(sorted(unknown))}")
    if config.max_batch_size and not 1 <= batch_size <= config.max_batch_size:
        raise ConfigError(
            f"--batch-size {batch_size}: '{config.name}' takes 1 to {config.max_batch_size}"
        )
    pool = []
    for _ in range(POOL_SIZE):
        request = {}
        for tensor in config.input:
            if tensor.optional:
                continue
            dims = tuple(shapes.get(tensor.name, (1 if d < 0 else d for d in tensor.dims)))
            if config.max_batch_size:
                dims = (batch_size, *dims)
            request[tensor.name] = _random(tensor.data_type, dims, rng)
        pool.append(request)
    return pool


def _random(data_type: DataType, dims: tuple[int, ...], rng: np.random.Generator) -> Any:
    if data_type is DataType.BYTES:
        flat = [rng.bytes(16) for _ in range(math.prod(dims))]
        return np.array(flat, dtype=object).reshape(dims)
    dtype = data_type.numpy_dtype
    if data_type is DataType.BOOL:
        return rng.integers(0, 2, size=dims).astype(np.bool_)
    if dtype.kind in "iu":
        return rng.integers(0, 100, size=dims).astype(dtype)
    return rng.random(size=dims).astype(dtype)


def _samples(path: Path, rng: np.random.Generator) -> list[dict[str, Any]]:
    if path.is_dir() and (path / "example.py").is_file():
        path = path / "example.py"
    if path.suffix == ".npz":
        try:
            with np.load(path, allow_pickle=True) as data:
                return [{name: data[name] for name in data.files}]
        except (OSError, ValueError) as exc:
            raise ConfigError(f"--samples {path}: {exc}") from exc
    if path.suffix != ".py":
        raise ConfigError(
            f"--samples {path}: expected an .npz file of one request's inputs, or a Python "
            "file (or an example's folder) that defines make_inputs(index, rng)"
        )
    make_inputs = _make_inputs(path)
    return [dict(make_inputs(index, rng)) for index in range(POOL_SIZE)]


def _make_inputs(path: Path) -> Callable[[int, np.random.Generator], Inputs]:
    name = f"_orchestrion_tune_samples_{abs(hash(path.resolve()))}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None or not path.is_file():
        raise ConfigError(f"--samples {path}: no such Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    make_inputs = getattr(module, "make_inputs", None)
    if not callable(make_inputs):
        raise ConfigError(f"--samples {path}: defines no make_inputs(index, rng)")
    return make_inputs  # type: ignore[no-any-return]


def samples_beside(root: Path) -> Path | None:
    """The ``example.py`` of the example whose ``models/`` folder ``root`` is, if any:
    its requests are the ones the pipeline was made for."""
    candidate = root.resolve().parent / "example.py"
    return candidate if root.resolve().name == "models" and candidate.is_file() else None


# -- memory ---------------------------------------------------------------------------------


def resident_bytes() -> int | None:
    """This process's resident memory (Linux; None elsewhere)."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * _PAGE
    except OSError:
        return None


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def device_bytes() -> int | None:
    """Device memory JAX has in use on its accelerators (None: JAX runs on CPUs only)."""
    jax = sys.modules.get("jax")
    if jax is None:
        return None
    total, seen = 0, False
    for device in jax.local_devices():
        if device.platform == "cpu":
            continue
        stats = device.memory_stats() or {}
        if "bytes_in_use" in stats:
            total += int(stats["bytes_in_use"])
            seen = True
    return total if seen else None


@attrs.define
class MemorySampler:
    """Peaks of resident and device memory over what was in use when it started."""

    baseline: int | None
    device_baseline: int | None
    peak: int = 0
    device_peak: int = 0

    def sample(self) -> None:
        """Read memory once."""
        rss, device = resident_bytes(), device_bytes()
        if rss is not None and self.baseline is not None:
            self.peak = max(self.peak, rss - self.baseline)
        if device is not None and self.device_baseline is not None:
            self.device_peak = max(self.device_peak, device - self.device_baseline)

    @property
    def memory(self) -> int | None:
        """The resident peak over the baseline (None: not measurable here)."""
        return None if self.baseline is None else self.peak

    @property
    def device_memory(self) -> int | None:
        """The device peak over the baseline (None: no accelerator)."""
        return None if self.device_baseline is None else self.device_peak


@asynccontextmanager
async def sampling_memory(every_s: float = 0.02) -> AsyncIterator[MemorySampler]:
    """A `MemorySampler` reading memory every ``every_s`` while the block runs."""
    sampler = MemorySampler(resident_bytes(), device_bytes())

    async def run() -> None:
        while True:
            sampler.sample()
            await trio.sleep(every_s)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run)
        try:
            yield sampler
        finally:
            sampler.sample()
            nursery.cancel_scope.cancel()
