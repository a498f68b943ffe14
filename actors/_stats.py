"""Mutable counters behind `ModelStatistics` snapshots (one recorder per model version)."""

from __future__ import annotations

import time
from collections.abc import Sequence

import attrs

from ..protocols import (
    BatchStatistics,
    DurationStatistics,
    InferStatistics,
    ModelStatistics,
    failure_reason,
)


@attrs.define(eq=False)
class StatsRecorder:
    """Accumulates Triton's statistics for one model version; `snapshot` freezes them."""

    name: str
    version: int
    success_count: int = 0
    success_ns: int = 0
    fail_count: int = 0
    fail_ns: int = 0
    queue_count: int = 0
    queue_ns: int = 0
    compute_count: int = 0
    input_ns: int = 0
    infer_ns: int = 0
    output_ns: int = 0
    inference_count: int = 0
    execution_count: int = 0
    last_inference_ms: int = 0
    pending: int = 0
    cache_hit_count: int = 0
    cache_hit_ns: int = 0
    cache_miss_count: int = 0
    cache_miss_ns: int = 0
    failures: dict[str, int] = attrs.field(factory=dict)
    batches: dict[int, list[int]] = attrs.field(factory=dict)
    """By batch size: executions, and their input, infer and output nanoseconds."""
    cache_enabled: bool = False
    load_ns: int = 0
    is_ensemble: bool = False

    def request_finished(
        self,
        error: BaseException | None,
        duration_ns: int,
        batch_size: int,
        cache_hit: bool = False,
    ) -> None:
        """Count one answered request (a cache hit is a success, not an inference)."""
        if error is None:
            self.success_count += 1
            self.success_ns += duration_ns
            if not cache_hit:
                self.inference_count += batch_size
        else:
            self.fail_count += 1
            self.fail_ns += duration_ns
            reason = failure_reason(error)
            self.failures[reason] = self.failures.get(reason, 0) + 1
        self.last_inference_ms = time.time_ns() // 1_000_000

    def execution_finished(
        self,
        queue_ns: int,
        input_ns: int,
        infer_ns: int,
        output_ns: int,
        requests: int = 1,
        batch_size: int = 0,
    ) -> None:
        """Count one run of ``execute`` for ``requests`` requests (a batch: more than one)
        holding ``batch_size`` inferences (0: one per request).

        As in Triton, queue and compute statistics are per request: ``queue_ns`` is the sum
        of the requests' waits, and each request is charged the execution's compute times;
        the batch statistics count the execution once, under its batch size.
        """
        entry = self.batches.setdefault(batch_size or requests, [0, 0, 0, 0])
        entry[0] += 1
        entry[1] += input_ns
        entry[2] += infer_ns
        entry[3] += output_ns
        self.execution_count += 1
        self.queue_count += requests
        self.queue_ns += queue_ns
        self.compute_count += requests
        self.input_ns += input_ns * requests
        self.infer_ns += infer_ns * requests
        self.output_ns += output_ns * requests

    def executed_together(self, duration_ns: int, rows: Sequence[int]) -> None:
        """Count one execution, taking ``duration_ns``, of requests that all succeeded
        (``rows``: each one's inferences) and waited in no queue: `request_finished` for
        each and `execution_finished` once, in one call (an ensemble's fused call)."""
        requests = len(rows)
        inferences = sum(rows)
        self.success_count += requests
        self.success_ns += duration_ns * requests
        self.inference_count += inferences
        self.last_inference_ms = time.time_ns() // 1_000_000
        entry = self.batches.setdefault(inferences or requests, [0, 0, 0, 0])
        entry[0] += 1
        entry[2] += duration_ns
        self.execution_count += 1
        self.queue_count += requests
        self.compute_count += requests
        self.infer_ns += duration_ns * requests

    def cached_answers(self, count: int, duration_ns: int, lookup_ns: int) -> None:
        """Count ``count`` requests answered by a cache tier outside the runtime: each a
        success and a cache hit (``duration_ns`` and ``lookup_ns``: their totals)."""
        self.success_count += count
        self.success_ns += duration_ns
        self.cache_hit_count += count
        self.cache_hit_ns += lookup_ns
        self.last_inference_ms = time.time_ns() // 1_000_000

    def cache_looked_up(self, hit: bool, duration_ns: int) -> None:
        """Count one cache lookup: a hit's lookup time, or a miss's lookup + insert time."""
        if hit:
            self.cache_hit_count += 1
            self.cache_hit_ns += duration_ns
        else:
            self.cache_miss_count += 1
            self.cache_miss_ns += duration_ns

    def snapshot(self) -> ModelStatistics:
        """A frozen copy of the counters."""
        n = self.compute_count
        return ModelStatistics(
            name=self.name,
            version=self.version,
            last_inference=self.last_inference_ms,
            inference_count=self.inference_count,
            execution_count=self.execution_count,
            pending_request_count=self.pending,
            failures_by_reason=dict(self.failures),
            cache_enabled=self.cache_enabled,
            load_ns=self.load_ns,
            is_ensemble=self.is_ensemble,
            batch_stats=tuple(
                BatchStatistics(
                    batch_size=size,
                    compute_input=DurationStatistics(count=count, ns=input_ns),
                    compute_infer=DurationStatistics(count=count, ns=infer_ns),
                    compute_output=DurationStatistics(count=count, ns=output_ns),
                )
                for size, (count, input_ns, infer_ns, output_ns) in sorted(self.batches.items())
            ),
            inference_stats=InferStatistics(
                success=DurationStatistics(count=self.success_count, ns=self.success_ns),
                fail=DurationStatistics(count=self.fail_count, ns=self.fail_ns),
                queue=DurationStatistics(count=self.queue_count, ns=self.queue_ns),
                compute_input=DurationStatistics(count=n, ns=self.input_ns),
                compute_infer=DurationStatistics(count=n, ns=self.infer_ns),
                compute_output=DurationStatistics(count=n, ns=self.output_ns),
                cache_hit=DurationStatistics(count=self.cache_hit_count, ns=self.cache_hit_ns),
                cache_miss=DurationStatistics(count=self.cache_miss_count, ns=self.cache_miss_ns),
            ),
        )
