"""`serve`: a model repository behind the HTTP, gRPC and metrics endpoints, Triton-style.

How this works: `serve` checks its options (`_checked_mode`), opens the server (models,
cache, tracing, metrics) and its model control (`_open_model_control`), then starts the
HTTP and gRPC front ends (`_start_http`, `_start_grpc`), reports where they listen through
its ``task_status``, and runs (polling the repository in poll mode: `_run_until_stopped`)
until cancelled (everything stops at once) or until its `Shutdown` is requested. That
stop is graceful and bounded: readiness turns false, both front ends stop accepting,
requests in flight get up to ``exit_timeout`` seconds, then whatever is left is cancelled,
the models close, and `serve` returns.

`ServeOptions` holds the one definition of every ``orchestrion serve`` default: the command
line takes its defaults from it. With ``exit_on_error=False`` (Triton's
``--exit-on-error=false``) the models load one by one after the server opens, and those that
fail are left out (`ModelControl.load_at_start`) instead of stopping the start.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import ipaddress
import logging
import os
from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from pathlib import Path

import attrs
import trio

from .._server import AsyncServer, open_server
from ..protocols import DEFAULT_MAX_UPLOAD_SIZE, ConfigError, UploadLimits, ungrouped
from ..repository import AUTO_COMPLETE, ConfigReading, UploadFolders, open_upload_folders
from ._control import (
    DEFAULT_EXIT_TIMEOUT,
    ModelControl,
    ModelControlMode,
    Shutdown,
    repository_fingerprints,
)
from ._grpc_service import (
    DEFAULT_MAX_MESSAGE_SIZE,
    DirectCalls,
    InferenceService,
    serve_grpc_api,
)
from ._http_api import DEFAULT_MAX_INPUT_SIZE, HttpApi, serve_http_api
from ._http_server import (
    DEFAULT_BODY_MIN_RATE,
    DEFAULT_BODY_TIMEOUT,
    DEFAULT_HEADER_TIMEOUT,
    default_max_connections,
)
from ._native import native_available, serve_native
from ._native_cache import DEFAULT_TIER_SIZE
from ._on_demand import OnDemand, open_on_demand
from ._restricted import GRPC_HEADER_PREFIX, Restrictions
from ._shared_memory import DEFAULT_MAX_REGIONS, SharedMemory

_log = logging.getLogger("orchestrion")
ORPHAN_CHECK = 1.0
"""How often a worker of ``serve --workers`` checks that its supervisor is still there
(seconds)."""

LOOPBACK = "127.0.0.1"
"""The address every endpoint binds unless told otherwise (Triton binds every address)."""


@attrs.frozen(kw_only=True)
class ServeOptions:
    """What `serve` serves and how: the ``orchestrion serve`` flags, with their defaults
    (Triton's, but loopback addresses and a smaller gRPC message limit)."""

    model_repository: Path
    http_address: str = LOOPBACK
    http_port: int | None = 8000
    """None: no HTTP endpoint (``--allow-http=false``)."""
    grpc_address: str = LOOPBACK
    grpc_port: int | None = 8001
    metrics_address: str = LOOPBACK
    metrics_port: int | None = 8002
    cache_config: Sequence[str] = ()
    """Empty: no response cache (as Triton)."""
    tracing: Sequence[str] | None = None
    model_control_mode: ModelControlMode = ModelControlMode.NONE
    load_models: Sequence[str] = ()
    exit_on_error: bool = True
    """A model that fails to load at start stops the start (False: it is left out, listed
    UNAVAILABLE with the reason, and the others are served)."""
    reading: ConfigReading = AUTO_COMPLETE
    """How configs and code are found (``--disable-auto-complete-config``,
    ``--model-config-name``, ``--backend-directory``)."""
    strict_readiness: bool = True
    exit_timeout: float = DEFAULT_EXIT_TIMEOUT
    poll_interval: float = 15.0
    http_max_input_size: int = DEFAULT_MAX_INPUT_SIZE
    http_max_connections: int | None = None
    """None: `default_max_connections` (half the open-file limit, within a cap)."""
    http_header_timeout: float = DEFAULT_HEADER_TIMEOUT
    http_body_timeout: float = DEFAULT_BODY_TIMEOUT
    http_body_min_rate: float = DEFAULT_BODY_MIN_RATE
    server_id: str = "orchestrion"
    """The server's name in its metadata (Triton's ``--id``)."""
    grpc_max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE
    allow_client_shm: bool | None = None
    """Whether clients may use system shared memory (Triton's ``--allow-client-shm``);
    None: when the HTTP and gRPC front ends listen on loopback addresses only."""
    max_shm_regions: int = DEFAULT_MAX_REGIONS
    """How many shared memory regions may be registered at once."""
    http_restricted_apis: Sequence[str] = ()
    """Triton's ``--http-restricted-api`` values: ``<apis>:<header>=<value>``."""
    grpc_restricted_protocols: Sequence[str] = ()
    """Triton's ``--grpc-restricted-protocol`` values: ``<protocols>:<key>=<value>``."""
    model_upload_max_size: int = DEFAULT_MAX_UPLOAD_SIZE
    """The most bytes the ``file:`` parameters of one load request may hold (0: none)."""
    grpc_channel_args: Sequence[tuple[str, int]] = ()
    """More of grpcio's server options (Triton's gRPC keepalive flags, ``--reuse-grpc-port``),
    over the defaults."""
    frontend: str = "auto"
    """What serves HTTP and gRPC: ``native`` (the orchestrion-native package: hyper in
    threads of its own), ``python`` (h11 on trio, grpcio), ``auto`` (native when installed)."""
    frontend_threads: int = 2
    """The native front end's socket threads."""
    frontend_cache_size: int = DEFAULT_TIER_SIZE
    """Bytes of answers the native front end keeps and answers itself, for models whose
    responses the server caches (0: none; see `frontends._native_cache`)."""
    model_load_on_demand: bool = False
    """Load a repository model on its first request (``--model-load-on-demand``; implies
    ``explicit`` model control), and unload the least recently used under the limits."""
    model_count_limit: int | None = None
    """The most models loaded at once, with ``model_load_on_demand`` (None: no limit)."""
    model_memory_limit: int | None = None
    """The most bytes of model files loaded at once, with ``model_load_on_demand``."""
    workers: int = 1
    """Server processes sharing the ports (``--workers``; see `frontends._workers`)."""
    worker_of: int = 0
    """This process is one of that many workers (0: it serves alone): it binds with
    SO_REUSEPORT, refuses model control through the API and client shared memory (each
    would reach one worker only), and stops when its parent process goes away."""


@attrs.frozen(kw_only=True)
class Endpoints:
    """Where a running `serve` listens (``host:port``; None when disabled)."""

    http: str | None
    grpc: str | None
    metrics: str | None


async def serve(
    options: ServeOptions,
    *,
    shutdown: Shutdown | None = None,
    version: str = "",
    task_status: trio.TaskStatus[Endpoints] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``options.model_repository`` until cancelled, or until ``shutdown`` is
    requested; reports where it listens through ``task_status``.

    ``endpoints = await nursery.start(serve, options)`` returns once the models are loaded
    and every endpoint listens. Cancelling stops everything at once. Requesting
    ``shutdown`` stops gracefully (see the module docstring), then `serve` returns.

    Raises:
        ConfigError: the repository, a config, a flag or an address is invalid.
        ModelLoadError: a model's code failed to load.
        CacheUnavailableError: the cache's backend cannot be reached.
    """
    mode = _checked_mode(options)
    restrictions = _restrictions(options)
    version = version or _version()
    shutdown = shutdown or Shutdown()
    baseline: dict[str, object] = {}
    if mode is ModelControlMode.POLL:  # before loading: no change is missed
        baseline = await trio.to_thread.run_sync(repository_fingerprints, options.model_repository)
    one_by_one = mode is ModelControlMode.EXPLICIT or not options.exit_on_error
    # Uploaded model files are removed once every model (their user) has closed.
    limits = UploadLimits(max_size=options.model_upload_max_size)
    async with (
        open_upload_folders(limits) as uploads,
        open_server(
            options.model_repository,
            load_models=[] if one_by_one else None,
            cache_config=list(options.cache_config) or None,
            metrics_port=options.metrics_port,
            metrics_host=options.metrics_address,
            tracing=options.tracing,
            auto_complete_config=options.reading.auto_complete,
            model_config_name=options.reading.config_name,
            backend_directory=options.reading.backend_directory,
        ) as server,
    ):
        control = await _open_model_control(server, options, mode, uploads)
        # The stop's steps run in the order they are tied to ``shutdown``: readiness turns
        # false, the HTTP and gRPC front ends stop accepting, polling ends. Leaving the
        # nursery then waits (each front end at most exit_timeout) for requests in flight;
        # the models close after it.
        memory = SharedMemory(_shm_allowed(options), options.max_shm_regions)
        if options.worker_of:
            memory = SharedMemory(False, refusal=worker_refusal("client shared memory", options))
        async with _on_demand(server, control, options) as on_demand:
            with contextlib.closing(memory):
                serving = _Serving(
                    server, control, version, options, shutdown, memory, restrictions, on_demand
                )
                async with ungrouped(trio.open_nursery()) as front_ends:
                    with shutdown.on_request(control.stop_accepting):
                        if _native_chosen(options):
                            http, grpc = await _start_native(front_ends, serving)
                        else:
                            http = await _start_http(front_ends, serving)
                            grpc = await _start_grpc(front_ends, serving)
                        metrics = server.metrics_url
                        task_status.started(
                            Endpoints(
                                http=http,
                                grpc=grpc,
                                metrics=metrics.removeprefix("http://").removesuffix("/metrics")
                                if metrics
                                else None,
                            )
                        )
                        async with trio.open_nursery() as running:
                            if options.worker_of:  # an orphaned worker stops
                                running.start_soon(stop_when_orphaned, shutdown)
                            await _run_until_stopped(
                                control, mode, options.poll_interval, baseline, shutdown
                            )
                            running.cancel_scope.cancel()


@attrs.frozen
class _Serving:
    """What both front ends serve with."""

    server: AsyncServer
    control: ModelControl
    version: str
    options: ServeOptions
    shutdown: Shutdown
    memory: SharedMemory
    restrictions: tuple[Restrictions, Restrictions]
    """HTTP's and gRPC's."""
    on_demand: OnDemand | None = None
    """Loads models on first use (``--model-load-on-demand``)."""


def _restrictions(options: ServeOptions) -> tuple[Restrictions, Restrictions]:
    """The HTTP and gRPC restrictions of ``options``.

    Raises:
        ConfigError: a malformed restriction flag.
    """
    http = Restrictions.parse(options.http_restricted_apis, flag="http-restricted-api")
    grpc = Restrictions.parse(
        options.grpc_restricted_protocols,
        flag="grpc-restricted-protocol",
        prefix=GRPC_HEADER_PREFIX,
    )
    return http, grpc


def _checked_mode(options: ServeOptions) -> ModelControlMode:
    """``options``' model control mode, once the options that can be checked before
    anything loads are.

    Raises:
        ConfigError: an option is invalid, or contradicts another.
    """
    try:
        mode = ModelControlMode(options.model_control_mode)
    except ValueError:
        raise ConfigError(
            f"--model-control-mode must be none, explicit or poll, not "
            f"'{options.model_control_mode}'"
        ) from None
    mode = _on_demand_mode(options, mode)
    if options.frontend not in ("auto", "native", "python"):
        raise ConfigError(f"--frontend must be auto, native or python, not '{options.frontend}'")
    if options.frontend == "native" and not native_available():
        raise ConfigError(
            "--frontend native: the native front end is not installed (pip install ./native "
            "from orchestrion's repository)"
        )
    if options.frontend_cache_size < 0:
        raise ConfigError(
            f"--frontend-cache-size must be >= 0 (0: none), not {options.frontend_cache_size}"
        )
    if options.frontend_threads < 1:
        raise ConfigError(f"--frontend-threads must be >= 1, not {options.frontend_threads}")
    if options.max_shm_regions < 0:
        raise ConfigError(f"--max-shm-regions must be >= 0, not {options.max_shm_regions}")
    if options.load_models and mode is not ModelControlMode.EXPLICIT:
        raise ConfigError("--load-model needs --model-control-mode=explicit")
    if options.exit_timeout < 0 or options.poll_interval <= 0:
        raise ConfigError("--exit-timeout-secs must be >= 0 and --repository-poll-secs > 0")
    if options.model_upload_max_size < 0:
        raise ConfigError("--model-upload-max-size must be >= 0 (0: no files in load requests)")
    if not options.model_repository.exists():
        raise ConfigError(f"{options.model_repository}: model repository does not exist")
    if not options.model_repository.is_dir():
        raise ConfigError(f"{options.model_repository}: model repository is not a directory")
    return mode


def _on_demand(
    server: AsyncServer, control: ModelControl, options: ServeOptions
) -> AbstractAsyncContextManager[OnDemand | None]:
    """What loads models on first use (``--model-load-on-demand``; None: off)."""
    if not options.model_load_on_demand:
        return contextlib.nullcontext()
    return open_on_demand(
        server,
        control,
        max_models=options.model_count_limit,
        max_bytes=options.model_memory_limit,
    )


def _on_demand_mode(options: ServeOptions, mode: ModelControlMode) -> ModelControlMode:
    """The model control mode with ``--model-load-on-demand`` (explicit), its flags checked.

    Raises:
        ConfigError: on-demand loading with poll mode or ``--workers``, or its limits
            without it.
    """
    if not options.model_load_on_demand:
        if options.model_count_limit is not None or options.model_memory_limit is not None:
            raise ConfigError(
                "--model-count-limit and --model-memory-limit need --model-load-on-demand"
            )
        return mode
    if mode is ModelControlMode.POLL:
        raise ConfigError(
            "--model-load-on-demand loads and unloads models itself: it cannot follow the "
            "repository (--model-control-mode=poll); use explicit"
        )
    if options.worker_of:
        raise ConfigError(
            "--model-load-on-demand cannot be used with --workers (each worker would load "
            "and unload on its own)"
        )
    return ModelControlMode.EXPLICIT


async def _open_model_control(
    server: AsyncServer, options: ServeOptions, mode: ModelControlMode, uploads: UploadFolders
) -> ModelControl:
    """The model control of ``server``, with explicit mode's ``--load-model`` models
    loaded, and everything loaded so far frozen out of the garbage collector's sight."""
    control = ModelControl(
        server,
        mode=mode,
        strict_readiness=options.strict_readiness,
        uploads=uploads,
        config_reading=options.reading,
        api_refusal=worker_refusal("model control", options) if options.worker_of else None,
    )
    server.use_model_control(control)  # the models' own load_model calls
    if mode is ModelControlMode.EXPLICIT:
        await control.load_at_start(options.load_models, exit_on_error=options.exit_on_error)
    elif not options.exit_on_error:
        await control.load_at_start(["*"], exit_on_error=False)
    # Everything loaded so far (JAX, the models, compiled functions) lives as long as the
    # server: move it out of the garbage collector's sight. Otherwise every full
    # collection walks it all while requests wait: under perf_analyzer at concurrency 64,
    # p99 went from 75-92 ms to 18-24 ms with this (p50 unchanged, 12-13 ms).
    gc.collect()
    gc.freeze()
    return control


def check_workers(options: ServeOptions) -> None:
    """Check ``--workers`` against the other flags (before any worker starts).

    Raises:
        ConfigError: a count below 1, or a front end other than the native one.
    """
    if options.workers < 1:
        raise ConfigError(f"--workers {options.workers}: give 1 or more server processes")
    if not _native_chosen(options):
        raise ConfigError(
            "--workers needs the native front end (its ports are shared with SO_REUSEPORT): "
            "install it (pip install ./native) and leave --frontend at auto or native"
        )


def _native_chosen(options: ServeOptions) -> bool:
    """Whether the native front end serves: asked for, or ``auto`` where it is installed and
    no grpcio option is given (keepalive, connection age: the native one has none yet)."""
    if options.frontend == "native":
        if options.grpc_channel_args:
            _log.warning(
                "--frontend native ignores the gRPC keepalive and connection flags (%s): "
                "use --frontend python to have them",
                ", ".join(name for name, _ in options.grpc_channel_args),
            )
        return True
    if options.frontend == "auto" and options.grpc_channel_args:
        return False
    return options.frontend == "auto" and native_available()


def _http_api(serving: _Serving) -> HttpApi:
    options = serving.options
    return HttpApi(
        serving.server,
        serving.control,
        serving.version,
        options.http_max_input_size,
        serving.memory,
        serving.restrictions[0],
        name=options.server_id,
        on_demand=serving.on_demand,
    )


async def _start_native(
    front_ends: trio.Nursery, serving: _Serving
) -> tuple[str | None, str | None]:
    """Start the native front end in ``front_ends``; where HTTP and gRPC listen."""
    options = serving.options
    http_address = None if options.http_port is None else (options.http_address, options.http_port)
    grpc_address = None if options.grpc_port is None else (options.grpc_address, options.grpc_port)
    service = InferenceService(
        serving.server,
        serving.control,
        DirectCalls(),
        serving.version,
        serving.memory,
        serving.restrictions[1],
        name=options.server_id,
        on_demand=serving.on_demand,
    )
    addresses: tuple[str | None, str | None] = await front_ends.start(
        functools.partial(
            serve_native,
            http=_http_api(serving) if http_address else None,
            http_address=http_address,
            grpc_service=service if grpc_address else None,
            grpc_address=grpc_address,
            max_body=options.http_max_input_size,
            body_timeout=options.http_body_timeout,
            body_min_rate=options.http_body_min_rate,
            header_timeout=options.http_header_timeout,
            max_connections=options.http_max_connections or default_max_connections(),
            max_message_size=options.grpc_max_message_size,
            cache_tier_size=_cache_tier_size(serving),
            threads=options.frontend_threads,
            reuse_port=bool(options.worker_of),
            shutdown=serving.shutdown,
            exit_timeout=options.exit_timeout,
        )
    )
    return addresses


def _cache_tier_size(serving: _Serving) -> int:
    """The native cache tier's size: none where inference needs a header (the tier keys
    on the request's bytes, and answers without checking headers)."""
    if any("inference" in r.rules for r in serving.restrictions):
        return 0
    return serving.options.frontend_cache_size


async def _start_http(front_ends: trio.Nursery, serving: _Serving) -> str | None:
    """Start the HTTP front end in ``front_ends``; where it listens (None: disabled)."""
    options = serving.options
    if options.http_port is None:
        return None
    api = _http_api(serving)
    address: str = await front_ends.start(
        functools.partial(
            serve_http_api,
            api,
            options.http_address,
            options.http_port,
            shutdown=serving.shutdown,
            exit_timeout=options.exit_timeout,
            header_timeout=options.http_header_timeout,
            body_timeout=options.http_body_timeout,
            body_min_rate=options.http_body_min_rate,
            max_connections=options.http_max_connections,
        )
    )
    return address


async def _start_grpc(front_ends: trio.Nursery, serving: _Serving) -> str | None:
    """Start the gRPC front end in ``front_ends``; where it listens (None: disabled)."""
    options = serving.options
    if options.grpc_port is None:
        return None
    address: str = await front_ends.start(
        functools.partial(
            serve_grpc_api,
            serving.server,
            serving.control,
            serving.version,
            options.grpc_address,
            options.grpc_port,
            shutdown=serving.shutdown,
            exit_timeout=options.exit_timeout,
            max_message_size=options.grpc_max_message_size,
            shared_memory=serving.memory,
            restrictions=serving.restrictions[1],
            channel_args=options.grpc_channel_args,
            name=options.server_id,
            on_demand=serving.on_demand,
        )
    )
    return address


async def _run_until_stopped(
    control: ModelControl,
    mode: ModelControlMode,
    poll_interval: float,
    baseline: dict[str, object],
    shutdown: Shutdown,
) -> None:
    """Poll the repository (poll mode) or wait, until ``shutdown`` is requested or this is
    cancelled."""
    with trio.CancelScope() as polling, shutdown.on_request(polling.cancel):
        if mode is ModelControlMode.POLL:
            await control.poll(poll_interval, baseline)
        else:
            await trio.sleep_forever()


def _shm_allowed(options: ServeOptions) -> bool:
    """``--allow-client-shm``, or when not given: whether every front end that runs listens
    on a loopback address only (shared memory is the same machine's; a client that reaches
    a public address must not get to read and write the server's shared memory objects)."""
    if options.allow_client_shm is not None:
        return options.allow_client_shm
    hosts = [
        address
        for address, port in (
            (options.http_address, options.http_port),
            (options.grpc_address, options.grpc_port),
        )
        if port is not None
    ]
    return all(_is_loopback(host) for host in hosts)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _version() -> str:
    from .. import __version__

    return __version__


# -- as a worker of serve --workers (its supervisor: _workers.py) ------------------------


def worker_refusal(what: str, options: ServeOptions) -> str:
    """Why a worker of ``serve --workers`` refuses ``what``."""
    return (
        f"{what} is not available with --workers {options.worker_of}: each worker process "
        "has its own, and a request reaches only the worker its connection landed on "
        "(start the server with --workers 1 to use it)"
    )


async def stop_when_orphaned(shutdown: Shutdown) -> None:
    """Request ``shutdown`` once this process's parent (the supervisor) has gone away."""
    parent = os.getppid()
    while os.getppid() == parent:  # noqa: ASYNC110 (no event tells a process its parent died)
        await trio.sleep(ORPHAN_CHECK)
    _log.error("the supervisor of this worker (pid %d) has gone away: stopping", parent)
    shutdown.request()
