"""`tune` against a running server (``--url``): each candidate loaded through the server's
model control API, then measured over the wire with Triton's own client.

How this works. The server must run with explicit model control (``orchestrion serve
--model-control-mode explicit``, or Triton's); a candidate's configs reach it as Triton's
load request with a ``config`` override (the config as JSON), the composing models before
the ensembles. Every model of the pipeline is loaded with the config the candidate wants
whenever that differs from what was loaded last, so a knob set back to its configured value
is set back on the server too; when the run ends, every model changed is loaded again with
its configured config. The load is the candidate's: a refused override fails the candidate,
and the search goes on.

Requests go through ``tritonclient``'s gRPC client, one per concurrent task, each call in a
worker thread that trio owns and waits for (calls time out after `CALL_TIMEOUT_S`, loads
after `LOAD_TIMEOUT_S`). A failed call counts as a failed request. Memory is not measured
(the server is another process).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import trio
from google.protobuf import json_format, text_format
from tritonclient.grpc import model_config_pb2

from ..protocols import ConfigError, DataType, OrchestrionError
from ..repository import CONFIG_FILE
from ._knobs import Pipeline
from ._measure import Inputs, LoadSettings, Point, measure
from ._search import CandidateResult, Status

CALL_TIMEOUT_S = 60.0
LOAD_TIMEOUT_S = 300.0
_log = logging.getLogger("orchestrion")


class RemoteError(OrchestrionError):
    """The server refused a load, or a request failed on the wire (its message)."""


def client_module(url: str) -> tuple[Any, str]:
    """``tritonclient.grpc`` and the address ``url`` names.

    Raises:
        ConfigError: not ``grpc://HOST:PORT``.
    """
    parts = urlsplit(url)
    if parts.scheme != "grpc" or not parts.netloc:
        # Over HTTP, tritonclient's blocking client (gevent) is bound to the thread that made
        # it, and the load runs its calls in worker threads: gRPC's client is thread-safe.
        raise ConfigError(f"--url {url!r}: expected grpc://HOST:PORT (the server's gRPC endpoint)")
    import tritonclient.grpc as module

    return module, parts.netloc


class RemoteTarget:
    """The server at a URL: what is loaded there, and clients to call it."""

    def __init__(self, url: str, pipeline: Pipeline) -> None:
        self.module, self.address = client_module(url)
        self.pipeline = pipeline
        self.loaded: dict[str, str] = {}
        """The config JSON tune loaded last, per model (none yet: what the server runs is
        not known, so the first candidate loads every model)."""
        self.limiter = trio.CapacityLimiter(1)

    def client(self) -> Any:
        """A new blocking client of the server."""
        return self.module.InferenceServerClient(self.address)

    async def apply(self, texts: Mapping[str, str]) -> None:
        """Load every model whose wanted config differs from what was loaded last.

        Raises:
            RemoteError: the server refused a load (its message).
        """
        order = sorted(self.pipeline.configs, key=lambda n: (_depth(self.pipeline, n), n))
        client = self.client()
        try:
            for name in order:
                wanted = _json(self.pipeline, name, texts.get(name))
                if self.loaded.get(name) == wanted:  # the first time, every model loads
                    continue
                await trio.to_thread.run_sync(_load, client, name, wanted)
                self.loaded[name] = wanted
        finally:
            client.close()

    async def restore(self) -> None:
        """Load the configured config of every model tune changed."""
        await self.apply({})

    def caller(self, clients: list[Any]) -> Callable[[Inputs], Any]:
        """A `Call` that takes a free client of ``clients`` for each request."""
        model = self.pipeline.model
        module = self.module
        free = list(clients)

        async def call(inputs: Inputs) -> object:
            client = free.pop()
            try:
                return await trio.to_thread.run_sync(
                    _infer, module, client, model, inputs, limiter=self.limiter
                )
            finally:
                free.append(client)

        return call


def _depth(pipeline: Pipeline, name: str) -> int:
    """0 for a model, 1 + its deepest step for an ensemble: the order loads go in."""
    config = pipeline.configs[name]
    if config.ensemble_scheduling is None:
        return 0
    steps = [s.model_name for s in config.ensemble_scheduling.step]
    return 1 + max((_depth(pipeline, s) for s in steps if s in pipeline.configs), default=0)


def _json(pipeline: Pipeline, name: str, text: str | None) -> str:
    if text is None:
        path = pipeline.folders[name] / CONFIG_FILE
        text = path.read_text() if path.is_file() else f'name: "{name}"\n'
    message = model_config_pb2.ModelConfig()
    text_format.Parse(text, message)
    if not message.name:
        message.name = name
    return str(json_format.MessageToJson(message, preserving_proto_field_name=True))


def _load(client: Any, name: str, config: str) -> None:
    try:
        client.load_model(name, config=config, client_timeout=LOAD_TIMEOUT_S)
    except Exception as exc:  # tritonclient's InferenceServerException, or a socket error
        raise RemoteError(f"loading '{name}' on the server failed: {exc}") from exc


def _infer(module: Any, client: Any, model: str, inputs: Inputs) -> object:
    wire = []
    for name, value in inputs.items():
        array = np.asarray(value)
        data_type = DataType.from_numpy(array.dtype).value
        tensor = module.InferInput(name, list(array.shape), data_type)
        tensor.set_data_from_numpy(array)
        wire.append(tensor)
    try:
        return client.infer(model, wire, client_timeout=CALL_TIMEOUT_S)
    except Exception as exc:  # tritonclient's InferenceServerException, or a socket error
        raise RemoteError(str(exc)) from exc


@contextlib.asynccontextmanager
async def open_remote(url: str, pipeline: Pipeline) -> AsyncIterator[RemoteTarget]:
    """The server at ``url``; its models get their configured configs back at the end."""
    target = RemoteTarget(url, pipeline)
    try:
        yield target
    finally:
        with trio.CancelScope(shield=True), trio.move_on_after(60) as scope:
            try:
                await target.restore()
            except RemoteError as exc:
                _log.warning("tune: the server keeps a candidate's config: %s", exc)
        if scope.cancelled_caught:
            _log.warning("tune: restoring the configured configs on %s took over 60 s", url)


async def measure_remote(
    target: RemoteTarget,
    texts: Mapping[str, str],
    pool: Sequence[Inputs],
    settings: LoadSettings,
    result: CandidateResult,
    on_point: Callable[[Point], None],
) -> None:
    """Load ``texts`` on the server and measure the model there into ``result``."""
    started = trio.current_time()
    try:
        await target.apply(texts)
    except RemoteError as exc:
        result.status, result.error = Status.FAILED, str(exc)
        return
    result.load_s = trio.current_time() - started
    clients: list[Any] = []
    try:
        clients.extend(target.client() for _ in range(max(settings.concurrency)))
        target.limiter.total_tokens = len(clients)
        await measure(target.caller(clients), pool, settings, on_point)
    except OrchestrionError as exc:
        result.status, result.error = Status.FAILED, str(exc)
    finally:
        for client in clients:
            client.close()
