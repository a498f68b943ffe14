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
import enum
import itertools
import logging
import math
import threading
from collections.abc import Mapping, Sequence
from typing import ClassVar

import attrs

from ..protocols import CustomMetricFamily, CustomMetricSample
from ._triton_api import TritonModelException, check_argument

_log = logging.getLogger("orchestrion.models")


@attrs.define(eq=False)
class MetricStore:
    """The custom metric families one loaded model made, by name: a family made again
    with the same name is the same family (its first description kept), as in Triton."""

    families: dict[str, _Family] = attrs.field(factory=dict)
    _lock: threading.RLock = attrs.field(factory=threading.RLock)
    """Reentrant: a handle's ``__del__`` (which releases its family) may run in the middle
    of this store's own work, when the garbage collector runs there."""

    def join(self, name: str, description: str, kind: int) -> _Family:
        """The family ``name`` (made when new), with one more handle on it.

        Raises:
            TritonModelException: it exists with another kind.
        """
        with self._lock:
            family = self.families.get(name)
            if family is None:
                family = self.families[name] = _Family(name, description, kind, self)
            elif family.kind != kind:
                raise TritonModelException(
                    f"MetricFamily '{name}' exists already as a "
                    f"{MetricFamily._KINDS[family.kind]}: a family of the same name must have "
                    "the same kind"
                )
            family.handles += 1
            return family

    def release(self, family: _Family) -> None:
        """One handle of ``family`` is gone; with the last, the family leaves ``/metrics``
        and its metrics refuse every operation (Triton's)."""
        with self._lock:
            family.handles -= 1
            if family.handles <= 0:
                family.deleted = True
                if self.families.get(family.name) is family:
                    del self.families[family.name]

    def snapshot(self) -> list[CustomMetricFamily]:
        """Every family's current values."""
        with self._lock:
            families = list(self.families.values())
        return [family.snapshot() for family in families]


@attrs.frozen
class ModelScope:
    """Which model's code is running: its name, where its metrics go and its folder."""

    name: str
    version: int
    metrics: MetricStore | None = None
    directory: str = ""
    """The version folder (``pb_utils.get_model_dir()``; "": a model made in Python)."""


_SCOPE: contextvars.ContextVar[ModelScope] = contextvars.ContextVar("orchestrion_model_scope")


def enter_scope(scope: ModelScope) -> contextvars.Token[ModelScope]:
    """Make ``scope`` current (in this thread or task); undo with `leave_scope`."""
    return _SCOPE.set(scope)


def leave_scope(token: contextvars.Token[ModelScope]) -> None:
    """Undo `enter_scope`."""
    _SCOPE.reset(token)


def get_model_dir() -> str:
    """The folder of the running model's version (``<repository>/<model>/<version>``, a
    python-based backend's model too), as Triton's ``pb_utils.get_model_dir()``: from the
    model's ``auto_complete_config``, ``initialize``, ``execute`` and ``finalize``.

    Raises:
        TritonModelException: outside a model's code, or the model was made in Python
            (it has no folder).
    """
    try:
        directory = _SCOPE.get().directory
    except LookupError:
        raise TritonModelException(
            "get_model_dir() is only available in a model's code (auto_complete_config, "
            "initialize, execute, finalize)"
        ) from None
    if not directory:
        raise TritonModelException(
            "get_model_dir(): this model was made in Python and has no model folder"
        )
    return directory


class Logger:
    """Triton's model logger: ``pb_utils.Logger.log_info("...")`` and friends; its levels
    are ``Logger.INFO`` ... (``Logger.LogLevel``), and nothing else (an int is a TypeError,
    as in Triton)."""

    class LogLevel(enum.Enum):
        """A level of `Logger.log`, by the Python logging level it logs at."""

        INFO = logging.INFO
        WARNING = logging.WARNING
        ERROR = logging.ERROR
        VERBOSE = logging.DEBUG

    INFO = LogLevel.INFO
    WARNING = LogLevel.WARNING
    ERROR = LogLevel.ERROR
    VERBOSE = LogLevel.VERBOSE

    @staticmethod
    def log(message: str, level: Logger.LogLevel = LogLevel.INFO) -> None:
        """Log ``message`` at ``level`` (`Logger.INFO` unless given).

        Raises:
            TypeError: ``message`` is not a string, or ``level`` not a `LogLevel`.
        """
        check_argument("log", "message", message, str, "a string")
        check_argument("log", "level", level, Logger.LogLevel, "a pb_utils.Logger.LogLevel")
        try:
            scope = _SCOPE.get()
            prefix = f"model '{scope.name}' (version {scope.version}): "
        except LookupError:
            prefix = ""
        _log.log(level.value, "%s%s", prefix, message)

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


@attrs.define(eq=False)
class _Family:
    """A metric family as the server keeps it: its series by labels, shared by every
    `MetricFamily` handle of its name."""

    name: str
    description: str
    kind: int
    store: MetricStore | None
    handles: int = 0
    deleted: bool = False
    series: dict[tuple[tuple[str, str], ...], _Series] = attrs.field(factory=dict)
    lock: threading.Lock = attrs.field(factory=threading.Lock)

    def snapshot(self) -> CustomMetricFamily:
        with self.lock:
            series = list(self.series.values())
        return CustomMetricFamily(
            name=self.name,
            description=self.description,
            kind=MetricFamily._KINDS[self.kind],
            samples=tuple(s.snapshot() for s in series),
        )


class MetricFamily:
    """A custom metric family: a name, a description and a kind (`COUNTER`, `GAUGE` or
    `HISTOGRAM`); its `Metric` objects are its labelled series. Made again with the same
    name, it is the same family; once every handle of it is deleted, it leaves
    ``/metrics`` and its metrics refuse every operation (as in Triton)."""

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
        try:
            store = _SCOPE.get().metrics
        except LookupError:
            store = None
        if store is None:  # outside a served model (its unit test): shown nowhere
            self._family = _Family(name, description, kind, None, handles=1)
        else:
            self._family = store.join(name, description, kind)
        self.name = name
        self.description = self._family.description
        self.kind = kind

    def __del__(self) -> None:
        family = getattr(self, "_family", None)
        if family is not None and family.store is not None:
            family.store.release(family)
        elif family is not None:
            family.deleted = True

    def Metric(
        self, labels: Mapping[str, str] | None = None, buckets: Sequence[float] | None = None
    ) -> Metric:
        """The series of this family with ``labels`` (the same one for the same labels);
        a histogram needs ``buckets``, strictly ascending.

        Raises:
            TritonModelException: buckets missing or out of order for a histogram, or
                given for another kind.
        """
        return Metric(self._family, dict(labels or {}), buckets)

    def snapshot(self) -> CustomMetricFamily:
        """The family's current values."""
        return self._family.snapshot()


@attrs.define(eq=False)
class _Series:
    labels: dict[str, str]
    buckets: list[float]
    counts: list[int]
    histogram: bool
    value: float = 0.0
    sum: float = 0.0
    count: int = 0
    lock: threading.Lock = attrs.field(factory=threading.Lock)

    def snapshot(self) -> CustomMetricSample:
        with self.lock:
            buckets = tuple(zip(self.buckets, self.counts, strict=True))
            if self.histogram:
                buckets += ((math.inf, self.count),)
            return CustomMetricSample(
                labels=dict(self.labels),
                value=self.value,
                buckets=buckets,
                sum=self.sum,
                count=self.count,
            )


_DELETED = "Invalid metric operation as the corresponding 'MetricFamily' has been deleted."


class Metric:
    """One labelled series of a `MetricFamily` (two with the same labels share it)."""

    def __init__(
        self, family: _Family, labels: Mapping[str, str], buckets: Sequence[float] | None
    ) -> None:
        histogram = family.kind == MetricFamily.HISTOGRAM
        if histogram and buckets is None:
            raise TritonModelException(f"metric of '{family.name}': a histogram needs buckets")
        if buckets and not histogram:
            raise TritonModelException(f"metric of '{family.name}': only histograms take buckets")
        bounds = [float(b) for b in buckets or ()]
        if any(later <= earlier for earlier, later in itertools.pairwise(bounds)):
            raise TritonModelException(
                f"metric of '{family.name}': histogram buckets must be strictly ascending, "
                f"got {list(buckets or ())}"
            )
        self._family = family
        named = {str(k): str(v) for k, v in labels.items()}
        key = tuple(sorted(named.items()))
        with family.lock:
            series = family.series.get(key)
            if series is None:
                series = family.series[key] = _Series(named, bounds, [0] * len(bounds), histogram)
        self._series = series

    def _only(self, *kinds: int, call: str) -> _Series:
        if self._family.deleted:
            raise TritonModelException(_DELETED)
        if self._family.kind not in kinds:
            kind = MetricFamily._KINDS[self._family.kind]
            raise TritonModelException(f"{call} on a {kind} ('{self._family.name}')")
        return self._series

    def increment(self, value: float) -> None:
        """Add ``value`` (a counter only grows).

        Raises:
            TritonModelException: a negative value for a counter, a histogram, or the
                family deleted.
        """
        series = self._only(MetricFamily.COUNTER, MetricFamily.GAUGE, call="increment()")
        if self._family.kind == MetricFamily.COUNTER and value < 0:
            raise TritonModelException(f"increment({value}) on counter '{self._family.name}'")
        with series.lock:
            series.value += value

    def set(self, value: float) -> None:
        """Set a gauge to ``value``.

        Raises:
            TritonModelException: not a gauge, or the family deleted.
        """
        series = self._only(MetricFamily.GAUGE, call="set()")
        with series.lock:
            series.value = float(value)

    def observe(self, value: float) -> None:
        """Count ``value`` in a histogram.

        Raises:
            TritonModelException: not a histogram, or the family deleted.
        """
        series = self._only(MetricFamily.HISTOGRAM, call="observe()")
        with series.lock:
            index = bisect.bisect_left(series.buckets, value)
            for i in range(index, len(series.counts)):
                series.counts[i] += 1
            series.sum += value
            series.count += 1

    def value(self) -> float:
        """The counter's or gauge's value.

        Raises:
            TritonModelException: a histogram (it has no single value), or the family
                deleted.
        """
        series = self._only(MetricFamily.COUNTER, MetricFamily.GAUGE, call="value()")
        with series.lock:
            return series.value

    def snapshot(self) -> CustomMetricSample:
        """The series' current values."""
        return self._series.snapshot()
