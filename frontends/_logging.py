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

While the server runs, Triton's logging extension reads and changes these settings
(`LogControl`, which the handler's filter carries: `log_control` finds it).
"""

from __future__ import annotations

import enum
import json
import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
from rich.console import Console
from tritonclient.grpc import service_pb2

from ..protocols import ConfigError, InvalidRequestError, UnsupportedError

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
    """Holds back the records of the severities switched off (``--log-info=false``, ...),
    as the control's settings say at the moment."""

    def __init__(self, control: LogControl) -> None:
        super().__init__()
        self.control = control

    def filter(self, record: logging.LogRecord) -> bool:
        settings = self.control.settings
        if record.levelno >= logging.ERROR:
            return settings.error
        if record.levelno >= logging.WARNING:
            return settings.warning
        return settings.info if record.levelno >= logging.INFO else True


ORCHESTRION_FORMAT = "orchestrion"
"""``log_format``'s value for orchestrion's own layout (no ``--log-format`` given)."""

_BOOLEANS = {"log_info": "info", "log_warning": "warning", "log_error": "error"}


@attrs.define(eq=False)
class LogControl:
    """The log settings of ``orchestrion serve`` while it runs, read and changed through
    Triton's logging extension (``GET``/``POST /v2/logging``, gRPC ``LogSettings``).

    ``log_info``, ``log_warning``, ``log_error``, ``log_verbose_level`` and ``log_format``
    change at once for every record from then on (a python-backend model's
    ``pb_utils.Logger`` too); ``log_file`` cannot change, as in Triton.
    """

    settings: LogSettings
    handler: logging.Handler

    def document(self) -> dict[str, Any]:
        """The settings, as Triton's logging extension gives them."""
        settings = self.settings
        return {
            "log_file": str(settings.file) if settings.file is not None else "",
            "log_info": settings.info,
            "log_warning": settings.warning,
            "log_error": settings.error,
            "log_verbose_level": settings.verbose,
            "log_format": settings.format.value if settings.format else ORCHESTRION_FORMAT,
        }

    def update(self, changes: Mapping[str, Any]) -> None:
        """Change the settings ``changes`` names (a null value changes nothing); all or
        none of them.

        Raises:
            InvalidRequestError: an unknown setting, or a value of the wrong kind.
            UnsupportedError: ``log_file`` (set at start only).
        """
        fields: dict[str, Any] = {}
        for name, value in changes.items():
            if value is None:
                continue
            if name == "log_file":
                raise UnsupportedError(
                    "log file location can not be updated through network protocol"
                )
            if name in _BOOLEANS:
                if not isinstance(value, bool):
                    raise InvalidRequestError(
                        f"log setting '{name}' must be a boolean, got {value!r}"
                    )
                fields[_BOOLEANS[name]] = value
            elif name == "log_verbose_level":
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise InvalidRequestError(
                        f"log setting 'log_verbose_level' must be an integer >= 0, got {value!r}"
                    )
                fields["verbose"] = value
            elif name == "log_format":
                fields["format"] = _log_format(value)
            else:
                raise InvalidRequestError(
                    f"unknown log setting '{name}' (settings: log_file, "
                    f"{', '.join(_BOOLEANS)}, log_verbose_level, log_format)"
                )
        self.settings = attrs.evolve(self.settings, **fields)
        self._apply()

    def _apply(self) -> None:
        settings = self.settings
        if settings.format is None:
            self.handler.setFormatter(logging.Formatter(ORCHESTRION_LAYOUT))
        else:
            self.handler.setFormatter(TritonFormatter(settings.format))
        logging.getLogger().setLevel(logging.DEBUG if settings.verbose > 0 else logging.INFO)


def _log_format(value: Any) -> LogFormat | None:
    if value == ORCHESTRION_FORMAT:
        return None
    try:
        return LogFormat(value)
    except ValueError:
        raise InvalidRequestError(
            f"invalid argument for --log_format, got: {value} (default, ISO8601 or "
            f"{ORCHESTRION_FORMAT})"
        ) from None


def log_control() -> LogControl | None:
    """The control of the log `configure_logging` set up; None where the embedding program
    configured logging itself."""
    for handler in logging.getLogger().handlers:
        for found in handler.filters:
            if isinstance(found, _Severities):
                return found.control
    return None


def logging_extension(changes: Mapping[str, Any] | None) -> dict[str, Any]:
    """Triton's logging extension: apply ``changes`` (None or empty: read only), and the
    settings after.

    Raises:
        UnsupportedError: the program that embeds the server configures logging.
        InvalidRequestError: see `LogControl.update`.
    """
    control = log_control()
    if control is None:
        raise UnsupportedError(
            "the server does not support dynamic logging: the program that embeds it "
            "configures logging"
        )
    if changes:
        control.update(changes)
    return control.document()


def grpc_log_changes(settings: Mapping[str, Any]) -> dict[str, Any]:
    """A ``LogSettingsRequest``'s settings as plain values."""
    changes: dict[str, Any] = {}
    for name, value in settings.items():
        which = value.WhichOneof("parameter_choice")
        changes[name] = None if which is None else getattr(value, which)
    return changes


def grpc_log_settings(document: Mapping[str, Any]) -> Any:
    """The settings as a ``LogSettingsResponse``."""
    response = service_pb2.LogSettingsResponse()
    for name, value in document.items():
        field = response.settings[name]
        if isinstance(value, bool):
            field.bool_param = value
        elif isinstance(value, int):
            field.uint32_param = value
        else:
            field.string_param = str(value)
    return response


def configure_logging(settings: LogSettings) -> None:
    """Send every log record through one handler, as ``settings`` say (changed later
    through `log_control`). A root logger that has handlers already (a test's, an
    embedding program's) is left as it is.

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
    control = LogControl(settings, handler)
    handler.addFilter(_Severities(control))
    control._apply()
    root.addHandler(handler)


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
