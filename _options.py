"""What a server is opened with, declared once for every face: `ServerOptions`.

`orchestrion.open_server` (trio), `orchestrion.aio.open_server` (asyncio) and
`orchestrion.Server` (blocking) take a `ServerOptions` as ``options=``, and any of its fields
as keyword arguments (``metrics_port=0``), which override the ones ``options`` holds; the
faces hand both on without naming a field. `ServerOptionFields` is the same list for type
checkers (a test keeps the two equal).
"""

from __future__ import annotations

from collections.abc import Sequence
from os import PathLike
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

import attrs

from .protocols import Observer
from .repository import TRITON_BACKEND_DIRECTORY, ConfigReading

if TYPE_CHECKING:
    from opentelemetry import trace


@attrs.frozen(kw_only=True)
class ServerOptions:
    """How a server runs besides its models (see `orchestrion.open_server`)."""

    load_models: Sequence[str] | None = None
    """Load only these repository models at start (with the composing models their
    ensembles need); None loads the whole repository, ``[]`` none of it (load later with
    `AsyncServer.load_model`)."""
    cache_config: str | Sequence[str] | None = None
    """The response cache, as Triton's ``--cache-config`` values: one string or several
    (``"local,size=1048576"``, or ``["redis,host=localhost", "redis,port=6379"]``). Models
    cache only with ``response_cache { enable: true }``."""
    metrics_port: int | None = None
    """Serve Prometheus metrics at ``http://<metrics_host>:<port>/metrics`` while the server
    runs (0: any free port; see ``server.metrics_url``). None: no endpoint
    (``server.metrics_text()`` still returns the text)."""
    metrics_host: str = "127.0.0.1"
    """The address the metrics endpoint binds (loopback by default)."""
    tracing: str | Sequence[str] | trace.TracerProvider | None = None
    """OpenTelemetry traces: Triton's ``--trace-config`` values (``["mode=opentelemetry",
    "rate=100", "opentelemetry,url=http://localhost:4318/v1/traces"]``; the server owns the
    exporter and flushes it on exit), or an application's own ``TracerProvider``. None: no
    spans."""
    observers: Sequence[Observer] = ()
    """Receivers of runtime events (metrics, traces, tests)."""
    auto_complete_config: bool = True
    """A python-backend model's ``auto_complete_config`` (an ONNX model's graph) completes
    its repository config, and may stand in for a missing ``config.pbtxt``; False (Triton's
    ``--disable-auto-complete-config``): every folder needs a complete one."""
    model_config_name: str = ""
    """Read ``<model>/configs/<name>.pbtxt`` instead of ``config.pbtxt`` in the repository
    folders that have one (Triton's ``--model-config-name``)."""
    backend_directory: str | PathLike[str] = TRITON_BACKEND_DIRECTORY
    """Where python-based backends are (Triton's ``--backend-directory``): a config whose
    ``backend`` is none of orchestrion's own runs ``<backend_directory>/<backend>/model.py``."""

    def reading(self) -> ConfigReading:
        """How the repository's configs and code are found, by these options.

        Raises:
            ConfigError: ``model_config_name`` is not a plain file name.
        """
        return ConfigReading(
            auto_complete=self.auto_complete_config,
            config_name=self.model_config_name,
            backend_directory=Path(self.backend_directory),
        )


class ServerOptionFields(TypedDict, total=False):
    """`ServerOptions`' fields as keyword arguments of the faces (for type checkers)."""

    load_models: Sequence[str] | None
    cache_config: str | Sequence[str] | None
    metrics_port: int | None
    metrics_host: str
    tracing: str | Sequence[str] | trace.TracerProvider | None
    observers: Sequence[Observer]
    auto_complete_config: bool
    model_config_name: str
    backend_directory: str | PathLike[str]


def chosen(options: ServerOptions | None, fields: ServerOptionFields) -> ServerOptions:
    """``options`` (the defaults when None) with ``fields`` over it.

    Raises:
        TypeError: a field that `ServerOptions` does not have.
    """
    return attrs.evolve(options or ServerOptions(), **fields)
