"""A Triton python-backend model's logger and custom metrics (``pb_utils.Logger``,
``pb_utils.MetricFamily`` / ``Metric``).

How this works: while a model's code runs (``auto_complete_config``, ``initialize``,
``execute``, ``finalize``) a context variable names the model (`ModelScope`). The logger
writes to the ``orchestrion.models`` logger with the model's name in front. A
``MetricFamily`` made then belongs to that model: the backend keeps it in the model's
`MetricStore`, and the server's ``/metrics`` shows it next to Triton's metrics (as
`CustomMetricFamily` snapshots, read at scrape time) for as long as the model is loaded. A
family made outside a model (a model's unit test) works the same, and is shown nowhere.
Values are guarded by a lock: model code may update them from several threads.
"""

from __future__ import annotations

import bisect
import contextvars
import logging
import math
import threading
from collections.abc import Mapping, Sequence
from typing import ClassVar

import attrs

from ..protocols import CustomMetricFamily, CustomMetricSample
from ._triton_api import TritonModelException

_log = logging.getLogger("orchestrion.models")


@attrs.define(eq=False)
class MetricStore:
    """The custom metric families one loaded model made."""

    families: list[MetricFamily] = attrs.field(factory=list)
    _lock: threading.Lock = attrs.field(factory=threading.Lock)

    def add(self, family: MetricFamily) -> None:
        """Keep ``family`` (it shows on ``/metrics`` while the model is loaded)."""
        with self._lock:
            self.families.append(family)

    def snapshot(self) -> list[CustomMetricFamily]:
        """Every family's current values."""
        with self._lock:
            families = list(self.families)
        return [family.snapshot() for family in families]


@attrs.frozen
class ModelScope:
    """Which model's code is running: its name and where its metrics go."""

    name: str
    version: int
    metrics: MetricStore | None = None


_SCOPE: contextvars.ContextVar[ModelScope] = contextvars.ContextVar("orchestrion_model_scope")


def enter_scope(scope: ModelScope) -> contextvars.Token[ModelScope]:
    """Make ``scope`` current (in this thread or task); undo with `leave_scope`."""
    return _SCOPE.set(scope)


def leave_scope(token: contextvars.Token[ModelScope]) -> None:
    """Undo `enter_scope`."""
    _SCOPE.reset(token)


class Logger:
    """Triton's model logger: ``pb_utils.Logger.log_info("...")`` and friends."""

    INFO = 0
    WARNING = 1
    ERROR = 2
    VERBOSE = 3
    _LEVELS: ClassVar[dict[int, int]] = {
        INFO: logging.INFO,
        WARNING: logging.WARNING,
        ERROR: logging.ERROR,
        VERBOSE: logging.DEBUG,
    }

    @staticmethod
    def log(message: str, level: int = INFO) -> None:
        """Log ``message`` at ``level`` (`Logger.INFO` unless given)."""
        try:
            scope = _SCOPE.get()
            prefix = f"model '{scope.name}' (version {scope.version}): "
        except LookupError:
            prefix = ""
        _log.log(Logger._LEVELS.get(level, logging.INFO), "%s%s", prefix, message)

    @staticmethod
    def log_info(message: str) -> None:
        """Log ``message`` at INFO."""
        Logger.log(message, Logger.INFO)

    @staticmethod
    def log_warn(message: str) -> None:
        """Log ``message`` at WARNING."""
        Logger.log(message, Logger.WARNING)

    @staticmethod
    def log_error(message: str) -> None:
        """Log ``message`` at ERROR."""
        Logger.log(message, Logger.ERROR)

    @staticmethod
    def log_verbose(message: str) -> None:
        """Log ``message`` at VERBOSE (Python's DEBUG)."""
        Logger.log(message, Logger.VERBOSE)


class MetricFamily:
    """A custom metric family: a name, a description and a kind (`COUNTER`, `GAUGE` or
    `HISTOGRAM`); its `Metric` objects are its labelled series."""

    COUNTER = 0
    GAUGE = 1
    HISTOGRAM = 2
    _KINDS: ClassVar[dict[int, str]] = {COUNTER: "counter", GAUGE: "gauge", HISTOGRAM: "histogram"}

    def __init__(self, name: str, description: str, kind: int) -> None:
        if kind not in self._KINDS:
            raise TritonModelException(
                f"MetricFamily '{name}': kind must be MetricFamily.COUNTER, GAUGE or HISTOGRAM"
            )
        if (
            not name
            or not (name[0].isalpha() or name[0] in "_:")
            or not all(c.isalnum() or c in "_:" for c in name)
        ):
            raise TritonModelException(f"MetricFamily '{name}': not a valid Prometheus name")
        self.name = name
        self.description = description
        self.kind = kind
        self._metrics: list[Metric] = []
        self._lock = threading.Lock()
        try:
            store = _SCOPE.get().metrics
        except LookupError:
            store = None
        if store is not None:
            store.add(self)

    def Metric(
        self, labels: Mapping[str, str] | None = None, buckets: Sequence[float] | None = None
    ) -> Metric:
        """A series of this family with ``labels`` (a histogram needs ``buckets``).

        Raises:
            TritonModelException: buckets missing for a histogram, or given for another kind.
        """
        metric = Metric(self, dict(labels or {}), buckets)
        with self._lock:
            self._metrics.append(metric)
        return metric

    def snapshot(self) -> CustomMetricFamily:
        """The family's current values."""
        with self._lock:
            metrics = list(self._metrics)
        return CustomMetricFamily(
            name=self.name,
            description=self.description,
            kind=self._KINDS[self.kind],
            samples=tuple(m.snapshot() for m in metrics),
        )


class Metric:
    """One labelled series of a `MetricFamily`."""

    def __init__(
        self, family: MetricFamily, labels: Mapping[str, str], buckets: Sequence[float] | None
    ) -> None:
        histogram = family.kind == MetricFamily.HISTOGRAM
        if histogram and not buckets:
            raise TritonModelException(f"metric of '{family.name}': a histogram needs buckets")
        if buckets and not histogram:
            raise TritonModelException(f"metric of '{family.name}': only histograms take buckets")
        self._family = family
        self._labels = {str(k): str(v) for k, v in labels.items()}
        self._buckets = sorted(float(b) for b in buckets or ())
        self._counts = [0] * len(self._buckets)
        self._value = 0.0
        self._sum = 0.0
        self._count = 0
        self._lock = threading.Lock()

    def _only(self, *kinds: int, call: str) -> None:
        if self._family.kind not in kinds:
            kind = MetricFamily._KINDS[self._family.kind]
            raise TritonModelException(f"{call} on a {kind} ('{self._family.name}')")

    def increment(self, value: float) -> None:
        """Add ``value`` (a counter only grows).

        Raises:
            TritonModelException: a negative value for a counter, or a histogram.
        """
        self._only(MetricFamily.COUNTER, MetricFamily.GAUGE, call="increment()")
        if self._family.kind == MetricFamily.COUNTER and value < 0:
            raise TritonModelException(f"increment({value}) on counter '{self._family.name}'")
        with self._lock:
            self._value += value

    def set(self, value: float) -> None:
        """Set a gauge to ``value``.

        Raises:
            TritonModelException: not a gauge.
        """
        self._only(MetricFamily.GAUGE, call="set()")
        with self._lock:
            self._value = float(value)

    def observe(self, value: float) -> None:
        """Count ``value`` in a histogram.

        Raises:
            TritonModelException: not a histogram.
        """
        self._only(MetricFamily.HISTOGRAM, call="observe()")
        with self._lock:
            index = bisect.bisect_left(self._buckets, value)
            for i in range(index, len(self._counts)):
                self._counts[i] += 1
            self._sum += value
            self._count += 1

    def value(self) -> float:
        """The counter's or gauge's value.

        Raises:
            TritonModelException: a histogram (it has no single value).
        """
        self._only(MetricFamily.COUNTER, MetricFamily.GAUGE, call="value()")
        with self._lock:
            return self._value

    def snapshot(self) -> CustomMetricSample:
        """The series' current values."""
        with self._lock:
            buckets = tuple(zip(self._buckets, self._counts, strict=True))
            if buckets:
                buckets += ((math.inf, self._count),)
            return CustomMetricSample(
                labels=dict(self._labels),
                value=self._value,
                buckets=buckets,
                sum=self._sum,
                count=self._count,
            )
