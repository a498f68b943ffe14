"""Frozen statistics snapshots, in the shape of Triton's statistics extension."""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from ._errors import InferenceError, InvalidRequestError, OrchestrionError, QueueTimeoutError

FAILURE_REASONS = ("REJECTED", "CANCELED", "BACKEND", "OTHER")
"""Triton's ``reason`` label values of ``nv_inference_request_failure``."""


def failure_reason(error: BaseException) -> str:
    """Triton's failure reason for ``error``: the caller's bad request was REJECTED, a
    cancellation or timeout CANCELED, a model's failure BACKEND, anything else OTHER."""
    if isinstance(error, InvalidRequestError | QueueTimeoutError):
        return "REJECTED"  # the caller's bad request, or refused unrun by the scheduler
    if isinstance(error, TimeoutError) or not isinstance(error, Exception):
        return "CANCELED"  # trio.Cancelled is a BaseException; InferenceTimeoutError
    if isinstance(error, InferenceError):
        return "BACKEND"
    if isinstance(error, OrchestrionError):
        return "REJECTED"  # the server is closing: not the model's doing
    return "OTHER"


@attrs.frozen(kw_only=True)
class DurationStatistics:
    """How many times something happened and the total nanoseconds it took."""

    count: int = 0
    ns: int = 0


@attrs.frozen(kw_only=True)
class BatchStatistics:
    """Triton's ``InferBatchStatistics``: the executions of one batch size (inferences in
    one ``execute``) and their cumulative compute durations."""

    batch_size: int
    compute_input: DurationStatistics = DurationStatistics()
    compute_infer: DurationStatistics = DurationStatistics()
    compute_output: DurationStatistics = DurationStatistics()


@attrs.frozen(kw_only=True)
class InferStatistics:
    """Triton's ``InferStatistics``: per-outcome counts and cumulative durations."""

    success: DurationStatistics = DurationStatistics()
    """Requests answered successfully (cache hits included), end-to-end duration."""
    fail: DurationStatistics = DurationStatistics()
    """Requests answered with an error (cancellations and timeouts included)."""
    queue: DurationStatistics = DurationStatistics()
    """Time requests waited for a model instance."""
    compute_input: DurationStatistics = DurationStatistics()
    compute_infer: DurationStatistics = DurationStatistics()
    compute_output: DurationStatistics = DurationStatistics()
    cache_hit: DurationStatistics = DurationStatistics()
    cache_miss: DurationStatistics = DurationStatistics()


@attrs.frozen(kw_only=True)
class ModelStatistics:
    """Triton's ``ModelStatistics`` for one model version."""

    name: str
    version: int
    last_inference: int = 0
    """Milliseconds since the epoch of the last request's end (0: none yet)."""
    inference_count: int = 0
    """Inferences performed: a request of batch size B counts B."""
    execution_count: int = 0
    """Model executions (a batched execution counts once)."""
    inference_stats: InferStatistics = InferStatistics()
    batch_stats: tuple[BatchStatistics, ...] = ()
    """Executions by batch size, smallest first."""
    pending_request_count: int = 0
    """Requests accepted and not yet answered."""
    failures_by_reason: Mapping[str, int] = attrs.field(factory=dict)
    """Failed requests by Triton's reason (REJECTED, CANCELED, BACKEND, OTHER)."""
    cache_enabled: bool = False
    """``response_cache`` is on for this model and the server has a cache."""
    load_ns: int = 0
    """How long loading (initialising and compiling) this version took."""
    is_ensemble: bool = False


@attrs.frozen(kw_only=True)
class StepStatistics:
    """The live state of one ensemble step (orchestrion's own, not in Triton)."""

    ensemble: str
    step: int
    model_name: str
    queued: int
    """Requests waiting in the step's channel."""
    in_flight: int
    """Requests sent to the composing model and not yet answered."""
    max_inflight_requests: int
    """The step's limit (0 = unbounded)."""
    blocked_ns: int
    """Total nanoseconds producers spent waiting for room in this step's channel."""
    runs: int = 0
    """Times the step sent its model a request (a loop's step once per iteration, a mapped
    step once per run, whatever its items)."""
    skipped: int = 0
    """Times the step was skipped (its condition did not hold, or it takes a skipped tensor)."""
    items: int = 0
    """A mapped step's items sent to its model."""


@attrs.frozen(kw_only=True)
class CacheStatistics:
    """The server's response cache as a whole (Triton's cache-wide metrics, and more)."""

    name: str
    """The cache's name in ``--cache-config`` (``local``, ``redis``, a plugin's)."""
    lookups: int = 0
    """Lookups answered (hits + misses)."""
    hits: int = 0
    misses: int = 0
    """Lookups that found nothing usable (errors and skipped lookups while down included)."""
    coalesced: int = 0
    """Hits that waited for an identical running request's result (counted in ``hits`` and
    ``lookups`` too)."""
    insertions: int = 0
    insert_failures: int = 0
    """Insertions lost: the backend failed, or the insert queue was full."""
    errors: int = 0
    """Backend operations that failed (each failed batch counts once)."""
    batches: int = 0
    """Calls to a batched backend (round trips to Redis); 0 for immediate caches."""
    lookup_ns: int = 0
    """Total time spent in lookups, queueing included."""
    insert_ns: int = 0
    """Total time the backend spent storing entries."""
    queue_depth: int = 0
    """Operations waiting for the cache actor right now."""
    available: bool = True
    """False while the backend is failing (requests run uncached)."""
    entries: int | None = None
    """Entries stored (None when the backend cannot tell cheaply)."""
    evictions: int | None = None
    used_bytes: int | None = None
    capacity_bytes: int | None = None
    frontend_hits: int = 0
    """Hits answered by the native front end's tier (counted in ``hits`` too)."""
    frontend_entries: int | None = None
    """Answers the native front end's tier holds (None: no tier)."""
    frontend_bytes: int | None = None

    @property
    def utilization(self) -> float | None:
        """Fraction of the capacity in use (None for unbounded or unknown capacities)."""
        if self.used_bytes is None or not self.capacity_bytes:
            return None
        return self.used_bytes / self.capacity_bytes


@attrs.frozen(kw_only=True)
class CustomMetricSample:
    """One labelled series of a model's own metric: a counter's or gauge's value, or a
    histogram's cumulative ``buckets`` (upper bound, count; the last one ``inf``), sum and
    count."""

    labels: Mapping[str, str]
    value: float = 0.0
    buckets: tuple[tuple[float, int], ...] = ()
    sum: float = 0.0
    count: int = 0


@attrs.frozen(kw_only=True)
class CustomMetricFamily:
    """A metric family a model's code made (Triton's python-backend custom metrics)."""

    name: str
    description: str
    kind: str
    """``counter``, ``gauge`` or ``histogram``."""
    samples: tuple[CustomMetricSample, ...] = ()
