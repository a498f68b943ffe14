"""`tune` against a running server (``--url``): each candidate loaded through the server's
model control API, then measured over the wire.

How this works. The server must run with explicit model control (``orchestrion serve
--model-control-mode explicit``, or Triton's); a candidate's configs reach it as Triton's
load request with a ``config`` override (the config as JSON), the composing models before
the ensembles. Every model of the pipeline is loaded with the config the candidate wants
whenever that differs from what was loaded last (the first candidate loads them all, so
what the server ran before does not count), so a knob set back to its configured value is
set back on the server too; when the run ends, every model is loaded again with its
configured config. The load is the candidate's: a refused override fails the candidate, and
the search goes on.

Requests go over gRPC (``grpc://``: ``tritonclient``'s client, which is thread-safe) or HTTP
(``http://``: one keep-alive connection of the standard library's per concurrent task,
bodies in Triton's binary tensor extension, made by ``tritonclient.http``'s request encoder;
its gevent client is bound to the thread that made it, and calls here run in worker
threads). One `_Wire` per concurrent task, each call in a worker thread that trio owns and
waits for (calls time out after `CALL_TIMEOUT_S`, loads after `LOAD_TIMEOUT_S`). A failed
call counts as a failed request. Memory is not measured (the server is another process).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any, Protocol
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


class _Wire(Protocol):
    """One blocking connection to the server (used by one thread at a time)."""

    def load(self, name: str, config: str) -> None:
        """Load ``name`` with ``config`` (JSON). Raises `RemoteError`."""

    def infer(self, model: str, inputs: Inputs) -> None:
        """One request, answered. Raises `RemoteError`."""

    def close(self) -> None:
        """Close the connection."""


def check_url(url: str) -> tuple[str, str]:
    """``url``'s scheme (``grpc`` or ``http``) and address.

    Raises:
        ConfigError: neither ``grpc://HOST:PORT`` nor ``http://HOST:PORT``, or HTTP without
            ``tritonclient[http]`` (its request encoder).
    """
    parts = urlsplit(url)
    if parts.scheme not in ("grpc", "http") or not parts.hostname or not parts.port:
        raise ConfigError(f"--url {url!r}: expected grpc://HOST:PORT or http://HOST:PORT")
    if parts.scheme == "http":
        try:
            import tritonclient.http  # noqa: F401 (its request encoder)
        except ImportError as exc:
            raise ConfigError(
                f"--url {url!r}: HTTP needs tritonclient's HTTP part "
                "(pip install 'tritonclient[http]'), or use grpc://"
            ) from exc
    return parts.scheme, parts.netloc


class _GrpcWire:
    def __init__(self, address: str) -> None:
        import tritonclient.grpc as grpcclient

        self.module = grpcclient
        self.client = grpcclient.InferenceServerClient(address)

    def load(self, name: str, config: str) -> None:
        try:
            self.client.load_model(name, config=config, client_timeout=LOAD_TIMEOUT_S)
        except Exception as exc:  # tritonclient's InferenceServerException, or gRPC's
            raise RemoteError(f"loading '{name}' on the server failed: {exc}") from exc

    def infer(self, model: str, inputs: Inputs) -> None:
        wire = [_input(self.module, name, value) for name, value in inputs.items()]
        try:
            self.client.infer(model, wire, client_timeout=CALL_TIMEOUT_S)
        except Exception as exc:  # tritonclient's InferenceServerException, or gRPC's
            raise RemoteError(str(exc)) from exc

    def close(self) -> None:
        self.client.close()


class _HttpWire:
    def __init__(self, address: str, outputs: Sequence[str]) -> None:
        import tritonclient.http as httpclient

        self.module = httpclient
        self.address = address
        self.outputs = [httpclient.InferRequestedOutput(name, binary_data=True) for name in outputs]
        self.connection: http.client.HTTPConnection | None = None

    def _post(self, path: str, body: bytes, headers: dict[str, str], timeout: float) -> bytes:
        if self.connection is None:
            self.connection = http.client.HTTPConnection(self.address, timeout=timeout)
        try:
            self.connection.request("POST", path, body, headers)
            answer = self.connection.getresponse()
            data = answer.read()
        except (OSError, http.client.HTTPException) as exc:
            self.close()  # the next call connects again
            raise RemoteError(f"POST {path}: {exc}") from exc
        if answer.status != 200:
            try:
                message = json.loads(data.split(b"\0", 1)[0])["error"]
            except (ValueError, KeyError, TypeError):
                message = data[:200].decode(errors="replace")
            raise RemoteError(f"POST {path}: {answer.status}: {message}")
        return data

    def load(self, name: str, config: str) -> None:
        body = json.dumps({"parameters": {"config": config}}).encode()
        path = f"/v2/repository/models/{name}/load"
        try:
            self._post(path, body, {"Content-Type": "application/json"}, LOAD_TIMEOUT_S)
        except RemoteError as exc:
            raise RemoteError(f"loading '{name}' on the server failed: {exc}") from exc

    def infer(self, model: str, inputs: Inputs) -> None:
        wire = [_input(self.module, name, value) for name, value in inputs.items()]
        body, json_size = self.module.InferenceServerClient.generate_request_body(
            wire, outputs=self.outputs
        )
        headers = {"Content-Type": "application/octet-stream"}
        if json_size is not None:
            headers["Inference-Header-Content-Length"] = str(json_size)
        self._post(f"/v2/models/{model}/infer", body, headers, CALL_TIMEOUT_S)

    def close(self) -> None:
        if self.connection is not None:
            self.connection.close()
            self.connection = None


def _input(module: Any, name: str, value: Any) -> Any:
    array = np.asarray(value)
    tensor = module.InferInput(name, list(array.shape), DataType.from_numpy(array.dtype).value)
    tensor.set_data_from_numpy(array)
    return tensor


class RemoteTarget:
    """The server at a URL: what is loaded there, and connections to call it."""

    def __init__(self, url: str, pipeline: Pipeline) -> None:
        self.scheme, self.address = check_url(url)
        self.pipeline = pipeline
        self.loaded: dict[str, str] = {}
        """The config JSON tune loaded last, per model (none yet: the first candidate loads
        every model)."""
        self.limiter = trio.CapacityLimiter(1)

    def wire(self) -> _Wire:
        """A new connection to the server."""
        if self.scheme == "grpc":
            return _GrpcWire(self.address)
        return _HttpWire(self.address, [t.name for t in self.pipeline.config.output])

    async def apply(self, texts: Mapping[str, str]) -> None:
        """Load every model whose wanted config differs from what was loaded last.

        Raises:
            RemoteError: the server refused a load (its message).
        """
        order = sorted(self.pipeline.configs, key=lambda n: (_depth(self.pipeline, n), n))
        wire = self.wire()
        try:
            for name in order:
                wanted = _json(self.pipeline, name, texts.get(name))
                if self.loaded.get(name) == wanted:
                    continue
                self.loaded.pop(name, None)  # unknown until the load answers
                await trio.to_thread.run_sync(wire.load, name, wanted)
                self.loaded[name] = wanted
        finally:
            wire.close()

    async def restore(self) -> None:
        """Load every model's configured config."""
        await self.apply({})

    def caller(self, wires: list[_Wire]) -> Callable[[Inputs], Any]:
        """A `Call` that takes a free connection of ``wires`` for each request."""
        model = self.pipeline.model
        free = list(wires)

        async def call(inputs: Inputs) -> object:
            wire = free.pop()
            try:
                return await trio.to_thread.run_sync(
                    wire.infer, model, inputs, limiter=self.limiter
                )
            finally:
                free.append(wire)

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


@contextlib.asynccontextmanager
async def open_remote(url: str, pipeline: Pipeline) -> AsyncIterator[RemoteTarget]:
    """The server at ``url``; its models get their configured configs back at the end."""
    target = RemoteTarget(url, pipeline)
    try:
        yield target
    finally:
        with trio.CancelScope(shield=True), trio.move_on_after(LOAD_TIMEOUT_S) as scope:
            try:
                await target.restore()
            except RemoteError as exc:
                _log.warning("tune: the server keeps a candidate's config: %s", exc)
        if scope.cancelled_caught:
            _log.warning("tune: restoring the configured configs on %s timed out", url)


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
    wires: list[_Wire] = []
    try:
        wires.extend(target.wire() for _ in range(max(settings.concurrency)))
        target.limiter.total_tokens = len(wires)
        await measure(target.caller(wires), pool, settings, on_point)
    except OrchestrionError as exc:
        result.status, result.error = Status.FAILED, str(exc)
    finally:
        for wire in wires:
            wire.close()
