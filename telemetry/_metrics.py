"""Prometheus metrics: Triton's names and labels, plus orchestrion's own.

How this works: nothing is counted on the request path for metrics. The runtime already keeps
Triton's statistics (per model version, per ensemble step, for the cache); `ServerMetrics` is
a prometheus-client *collector* that turns a snapshot of them into metric families when
Prometheus scrapes, so metrics cost nothing between scrapes.

Names. Triton's metrics keep Triton's exact names, labels and units (microsecond counters,
``model``/``version`` labels, ``reason`` on failures), so existing Triton dashboards work:
``nv_inference_count`` is a counter with no ``_total``. prometheus-client's own text writer
appends ``_total`` to every counter's ``# TYPE`` line, which would announce names Triton does
not have; `render_text` writes the Prometheus text format (0.0.4) itself, naming each family
exactly as its samples are named. orchestrion's own metrics follow Prometheus practice: the
``orchestrion_`` prefix, base units (seconds), ``_total`` on counters.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Protocol

from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.samples import Sample

from ..protocols import (
    FAILURE_REASONS,
    CacheStatistics,
    CustomMetricFamily,
    ModelStatistics,
    StepStatistics,
)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""The Content-Type of `render_text`'s output."""


class MetricsSource(Protocol):
    """What the collector reads at each scrape (the server implements it)."""

    def model_statistics(self) -> list[ModelStatistics]: ...

    def cache_statistics(self) -> CacheStatistics | None: ...

    def all_step_statistics(self) -> list[StepStatistics]: ...

    def custom_metrics(self) -> list[CustomMetricFamily]: ...


class _Family(Metric):
    """A metric family whose samples list their labels in name order, a bucket's ``le``
    last, as Triton's (prometheus-cpp) do: ``{model="m",reason="BACKEND",version="1"}``,
    byte for byte what scripts written against Triton's endpoint match."""

    def add_sample(self, name: str, labels: dict[str, str], *args: Any, **kwargs: Any) -> None:
        """A sample, its labels in Triton's order."""
        ordered = dict(sorted(labels.items(), key=lambda item: (item[0] == "le", item[0])))
        super().add_sample(name, ordered, *args, **kwargs)


def _family(name: str, documentation: str, kind: str) -> Metric:
    return _Family(name, documentation, kind)


def _us(ns: int) -> int:
    return ns // 1000


class ServerMetrics(Collector):
    """The metrics of one server, collected from its statistics at scrape time."""

    def __init__(self, source: MetricsSource) -> None:
        self._source = source

    def collect(self) -> Iterator[Metric]:
        """Every metric family, from one snapshot of the server's statistics."""
        models = self._source.model_statistics()
        yield from self._models(models)
        yield from self._model_cache(models)
        cache = self._source.cache_statistics()
        if cache is not None:
            yield from self._cache(cache)
        yield from self._steps(self._source.all_step_statistics())
        yield from self._loads(models)
        yield from self._custom(self._source.custom_metrics())

    # -- Triton's per-model metrics ----------------------------------------------------------

    @staticmethod
    def _models(models: Sequence[ModelStatistics]) -> Iterator[Metric]:
        success = _family(
            "nv_inference_request_success",
            "Requests answered (hits included)",
            "counter",
        )
        failure = _family(
            "nv_inference_request_failure", "Requests answered with an error, by reason", "counter"
        )
        count = _family(
            "nv_inference_count", "Inferences run: a batch of B counts B (hits excluded)", "counter"
        )
        executions = _family(
            "nv_inference_exec_count", "Executions of the model (hits excluded)", "counter"
        )
        pending = _family(
            "nv_inference_pending_request_count", "Requests accepted and not yet answered", "gauge"
        )
        durations = {
            key: _family(
                f"nv_inference_{key}_duration_us", f"Total {what}, microseconds", "counter"
            )
            for key, what in (
                ("request", "time of successful requests"),
                ("queue", "time queued for an instance"),
                ("compute_input", "input handling time"),
                ("compute_infer", "execute time"),
                ("compute_output", "output handling time"),
            )
        }
        for s in models:
            labels = {"model": s.name, "version": str(s.version)}
            stats = s.inference_stats
            success.add_sample(success.name, labels, stats.success.count)
            for reason in FAILURE_REASONS:
                failure.add_sample(
                    failure.name, {**labels, "reason": reason}, s.failures_by_reason.get(reason, 0)
                )
            count.add_sample(count.name, labels, s.inference_count)
            executions.add_sample(executions.name, labels, s.execution_count)
            # An ensemble queues nothing itself: its composing models show the pending work.
            pending.add_sample(
                pending.name, labels, 0 if s.is_ensemble else s.pending_request_count
            )
            values = {
                "request": stats.success.ns,  # as in Triton: successes (hits included)
                "queue": stats.queue.ns,
                "compute_input": stats.compute_input.ns,
                "compute_infer": stats.compute_infer.ns,
                "compute_output": stats.compute_output.ns,
            }
            for key, family in durations.items():
                family.add_sample(family.name, labels, _us(values[key]))
        yield from (success, failure, count, executions, pending, *durations.values())

    @staticmethod
    def _model_cache(models: Sequence[ModelStatistics]) -> Iterator[Metric]:
        cached = [s for s in models if s.cache_enabled]
        if not cached:
            return
        families = (
            ("nv_cache_num_hits_per_model", "Number of cache hits per model", "hit", False),
            ("nv_cache_num_misses_per_model", "Number of cache misses per model", "miss", False),
            (
                "nv_cache_hit_duration_per_model",
                "Total cache hit duration per model, in microseconds",
                "hit",
                True,
            ),
            (
                "nv_cache_miss_duration_per_model",
                "Total cache miss (insert + lookup) duration per model, in microseconds",
                "miss",
                True,
            ),
        )
        for name, documentation, which, duration in families:
            family = _family(name, documentation, "counter")
            for s in cached:
                stat = (
                    s.inference_stats.cache_hit if which == "hit" else s.inference_stats.cache_miss
                )
                value = _us(stat.ns) if duration else stat.count
                family.add_sample(name, {"model": s.name, "version": str(s.version)}, value)
            yield family

    # -- the cache as a whole ----------------------------------------------------------------

    @staticmethod
    def _cache(cache: CacheStatistics) -> Iterator[Metric]:
        gauges: list[tuple[str, str, float | None]] = [
            ("nv_cache_num_entries", "Number of responses stored in response cache", cache.entries),
            ("nv_cache_num_lookups", "Number of cache lookups in response cache", cache.lookups),
            ("nv_cache_num_hits", "Number of cache hits in response cache", cache.hits),
            ("nv_cache_num_misses", "Number of cache misses in response cache", cache.misses),
            (
                "nv_cache_num_evictions",
                "Number of cache evictions in response cache",
                cache.evictions,
            ),
            ("nv_cache_util", "Cache utilization [0.0 - 1.0]", cache.utilization),
        ]
        for name, documentation, value in gauges:
            if value is None:  # the backend cannot tell (Redis entries, say): no sample
                continue
            family = _family(name, documentation, "gauge")
            family.add_sample(name, {}, value)
            yield family
        labels = {"cache": cache.name}
        own: list[tuple[str, str, str, float]] = [
            ("queue_depth", "Operations waiting for the cache actor", "gauge", cache.queue_depth),
            ("round_trips_total", "Batches sent to the backend", "counter", cache.batches),
            (
                "coalesced_total",
                "Requests that joined another",
                "counter",
                cache.coalesced,
            ),
            ("errors_total", "Failed backend operations", "counter", cache.errors),
            ("insertions_total", "Responses stored", "counter", cache.insertions),
            ("insert_failures_total", "Responses not stored", "counter", cache.insert_failures),
            ("available", "1 while the backend answers", "gauge", int(cache.available)),
            ("lookup_seconds_total", "Time in lookups", "counter", cache.lookup_ns / 1e9),
            ("insert_seconds_total", "Time storing responses", "counter", cache.insert_ns / 1e9),
        ]
        own.append(
            (
                "frontend_hits_total",
                "Hits answered by the native front end's tier (in nv_cache_num_hits too)",
                "counter",
                cache.frontend_hits,
            )
        )
        if cache.frontend_entries is not None:
            own.append(
                (
                    "frontend_entries",
                    "Answers the native front end's tier holds",
                    "gauge",
                    cache.frontend_entries,
                )
            )
        if cache.frontend_bytes is not None:
            own.append(
                (
                    "frontend_bytes",
                    "Bytes the front end's tier holds",
                    "gauge",
                    cache.frontend_bytes,
                )
            )
        if cache.used_bytes is not None:
            own.append(("used_bytes", "Bytes the stored responses take", "gauge", cache.used_bytes))
        if cache.capacity_bytes is not None:
            own.append(("capacity_bytes", "The cache's size", "gauge", cache.capacity_bytes))
        for suffix, documentation, kind, value in own:
            family = _family(f"orchestrion_cache_{suffix}", documentation, kind)
            family.add_sample(family.name, labels, value)
            yield family

    # -- orchestrion's own ----------------------------------------------------------------------

    @staticmethod
    def _steps(steps: Sequence[StepStatistics]) -> Iterator[Metric]:
        queued = _family(
            "orchestrion_step_queue_depth",
            "Requests waiting in an ensemble step's channel",
            "gauge",
        )
        in_flight = _family(
            "orchestrion_step_in_flight",
            "Requests an ensemble step has sent to its composing model and not yet received",
            "gauge",
        )
        limit = _family(
            "orchestrion_step_max_inflight_requests",
            "The step's max_inflight_requests (0: unbounded)",
            "gauge",
        )
        blocked = _family(
            "orchestrion_step_blocked_seconds_total",
            "Time producers spent waiting for room in the step's channel (backpressure)",
            "counter",
        )
        runs = _family(
            "orchestrion_step_runs_total",
            "Times the step sent its composing model a request (each loop iteration counts)",
            "counter",
        )
        skipped = _family(
            "orchestrion_step_skipped_total",
            "Times the step was skipped (its condition did not hold, or an input was skipped)",
            "counter",
        )
        items = _family(
            "orchestrion_step_items_total",
            "Items a mapped step sent to its composing model",
            "counter",
        )
        for s in steps:
            labels = {"ensemble": s.ensemble, "step": str(s.step), "model": s.model_name}
            queued.add_sample(queued.name, labels, s.queued)
            in_flight.add_sample(in_flight.name, labels, s.in_flight)
            limit.add_sample(limit.name, labels, s.max_inflight_requests)
            blocked.add_sample(blocked.name, labels, s.blocked_ns / 1e9)
            runs.add_sample(runs.name, labels, s.runs)
            skipped.add_sample(skipped.name, labels, s.skipped)
            items.add_sample(items.name, labels, s.items)
        if steps:
            yield from (queued, in_flight, limit, blocked, runs, skipped, items)

    @staticmethod
    def _loads(models: Sequence[ModelStatistics]) -> Iterator[Metric]:
        family = _family(
            "orchestrion_model_load_seconds",
            "How long loading (initialising and compiling) the model version took",
            "gauge",
        )
        for s in models:
            family.add_sample(
                family.name, {"model": s.name, "version": str(s.version)}, s.load_ns / 1e9
            )
        if models:
            yield family

    @staticmethod
    def _custom(families: Sequence[CustomMetricFamily]) -> Iterator[Metric]:
        """Models' own metric families (python-backend custom metrics), one per name: a
        later model's family of the same name and kind adds its series, one of another
        kind is left out."""
        merged: dict[str, Metric] = {}
        kinds: dict[str, str] = {}
        for family in families:
            metric = merged.get(family.name)
            if metric is None:
                metric = merged[family.name] = _family(family.name, family.description, family.kind)
                kinds[family.name] = family.kind
            elif kinds[family.name] != family.kind:
                continue
            for sample in family.samples:
                labels = dict(sample.labels)
                if family.kind != "histogram":
                    metric.add_sample(family.name, labels, sample.value)
                    continue
                for bound, count in sample.buckets:
                    le = {**labels, "le": _bound(bound)}
                    metric.add_sample(f"{family.name}_bucket", le, count)
                metric.add_sample(f"{family.name}_sum", labels, sample.sum)
                metric.add_sample(f"{family.name}_count", labels, sample.count)
        yield from merged.values()


def _escape_label(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _escape_help(text: str) -> str:
    return text.replace("\\", r"\\").replace("\n", r"\n")


def _bound(value: float) -> str:
    """A histogram bucket's bound as Triton writes it: ``1``, ``2.5``, ``+Inf``."""
    if math.isfinite(value) and float(value).is_integer() and abs(value) < 1e15:
        return str(int(value))
    return _number(value)


def _number(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def _sample_line(sample: Sample) -> str:
    labels = ""
    if sample.labels:
        labels = "{" + ",".join(f'{k}="{_escape_label(v)}"' for k, v in sample.labels.items()) + "}"
    return f"{sample.name}{labels} {_number(sample.value)}\n"


def render_text(families: Iterable[Metric]) -> str:
    """Prometheus text format 0.0.4, each family announced under its samples' own name.

    Families of prometheus-client's own instruments also render correctly: a counter whose
    samples carry ``_total`` is announced with it, and its ``_created`` samples are left out.
    """
    out: list[str] = []
    for family in families:
        samples = [s for s in family.samples if not s.name.endswith("_created")]
        name = family.name
        if family.type == "counter" and samples and all(s.name == name + "_total" for s in samples):
            name += "_total"
        kind = (
            family.type
            if family.type in ("counter", "gauge", "histogram", "summary")
            else "untyped"
        )
        out.append(f"# HELP {name} {_escape_help(family.documentation)}\n")
        out.append(f"# TYPE {name} {kind}\n")
        out.extend(_sample_line(s) for s in samples)
    return "".join(out)


def make_metrics_registry(source: MetricsSource) -> CollectorRegistry:
    """A registry of its own holding the server's collector (tests get their own too)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ServerMetrics(source))
    return registry


def metrics_text(registry: CollectorRegistry) -> str:
    """The text a scrape of ``registry`` returns."""
    return render_text(registry.collect())
