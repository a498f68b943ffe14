"""``orchestrion serve``'s logging, set by Triton's log flags.

How this works: `configure_logging` gives the root logger one handler, on standard error or
on ``--log-file``, at DEBUG with ``--log-verbose`` above 0, else INFO. ``--log-info``,
``--log-warning`` and ``--log-error`` (all true by default) each let one severity through
or hold it back (ERROR stands for CRITICAL too; verbose DEBUG records follow
``--log-verbose`` alone, as Triton's verbose lines do). Without ``--log-format`` records keep
orchestrion's layout, with the logger's name; with it, they take Triton's layouts, for log
pipelines that parse Triton's (`TritonFormatter`):

- ``default``: ``I1202 04:00:15.287454 7633 _control.py:170] "loaded model 'm'"``
- ``ISO8601``: ``2025-12-02T04:00:15Z I 7633 _control.py:170] "loaded model 'm'"``

(severity E, W or I, the process id, the file and line that logged, then the message as a
JSON string, as Triton 2.51 writes it: a message cannot forge a line of its own.)
"""

from __future__ import annotations

import enum
import json
import logging
import time
from pathlib import Path

import attrs
from rich.console import Console

from ..protocols import ConfigError

ORCHESTRION_LAYOUT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
"""The layout of a record without ``--log-format``."""


class LogFormat(enum.StrEnum):
    """Triton's ``--log-format`` values."""

    DEFAULT = "default"
    ISO8601 = "ISO8601"


@attrs.frozen(kw_only=True)
class LogSettings:
    """Triton's log flags, as ``orchestrion serve`` takes them."""

    verbose: int = 0
    """``--log-verbose``: above 0, DEBUG records too."""
    info: bool = True
    warning: bool = True
    error: bool = True
    format: LogFormat | None = None
    """None: orchestrion's own layout (no ``--log-format`` given)."""
    file: Path | None = None
    """Write the log there (appended) instead of standard error."""


_SEVERITY = {
    logging.CRITICAL: "E",
    logging.ERROR: "E",
    logging.WARNING: "W",
    logging.INFO: "I",
    logging.DEBUG: "I",  # Triton's verbose lines are I lines
}


class TritonFormatter(logging.Formatter):
    """A record in one of Triton's line layouts (see the module docstring)."""

    def __init__(self, layout: LogFormat) -> None:
        """Format records in ``layout``."""
        super().__init__()
        self.layout = layout

    def format(self, record: logging.LogRecord) -> str:
        """One line: the prefix of the layout, the process and place, the message quoted."""
        message = record.getMessage()
        if record.exc_info:
            message = f"{message}\n{self.formatException(record.exc_info)}"
        severity = _SEVERITY.get(record.levelno, "I")
        if self.layout is LogFormat.ISO8601:
            stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(record.created))
            prefix = f"{stamp} {severity}"
        else:
            local = time.localtime(record.created)
            micros = int((record.created % 1) * 1_000_000)
            prefix = f"{severity}{time.strftime('%m%d %H:%M:%S', local)}.{micros:06d}"
        place = f"{record.process} {record.filename}:{record.lineno}]"
        return f"{prefix} {place} {json.dumps(message, ensure_ascii=False)}"


class _Severities(logging.Filter):
    """Holds back the records of the severities switched off (``--log-info=false``, ...)."""

    def __init__(self, settings: LogSettings) -> None:
        super().__init__()
        self.off = {
            level
            for level, on in (
                (logging.INFO, settings.info),
                (logging.WARNING, settings.warning),
                (logging.ERROR, settings.error),
                (logging.CRITICAL, settings.error),
            )
            if not on
        }

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno not in self.off


def configure_logging(settings: LogSettings) -> None:
    """Send every log record through one handler, as ``settings`` say. A root logger that
    has handlers already (a test's, an embedding program's) is left as it is.

    Raises:
        ConfigError: the log file cannot be opened.
    """
    if settings.verbose == 0:
        # JAX reports at INFO each platform it probed and did not find ("Unable to initialize
        # backend 'tpu'"): noise on every machine without one.
        logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
    root = logging.getLogger()
    if root.handlers:
        return
    handler: logging.Handler
    if settings.file is not None:
        try:
            handler = logging.FileHandler(settings.file, mode="a", encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"--log-file: cannot open {settings.file}: {exc}") from None
    else:
        handler = logging.StreamHandler()
    if settings.format is None:
        handler.setFormatter(logging.Formatter(ORCHESTRION_LAYOUT))
    else:
        handler.setFormatter(TritonFormatter(settings.format))
    handler.addFilter(_Severities(settings))
    root.addHandler(handler)
    root.setLevel(logging.DEBUG if settings.verbose > 0 else logging.INFO)


GRPC_STARTED = "Started GRPCInferenceService at "
HTTP_STARTED = "Started HTTPService at "
METRICS_STARTED = "Started Metrics Service at "


def report_started(
    console: Console, grpc: str | None, http: str | None, metrics: str | None, seconds: float
) -> None:
    """Triton's start-up lines on standard output (``host:port`` each; None: not served),
    which scripts wait for, then how long the start took."""
    for line, address in ((GRPC_STARTED, grpc), (HTTP_STARTED, http), (METRICS_STARTED, metrics)):
        if address:
            console.print(f"{line}{address}", highlight=False, markup=False)
    console.print(f"ready in {seconds:.1f} s; Ctrl-C (SIGINT) or SIGTERM to stop", highlight=False)
    console.file.flush()  # scripts wait for these lines, also through a pipe
