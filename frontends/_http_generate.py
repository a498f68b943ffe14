"""Triton's generate extension over HTTP: ``POST /v2/models/{m}[/versions/{v}]/generate``
(one JSON answer) and ``.../generate_stream`` (server-sent events), for plain, decoupled and
ensemble models.

How this works: the body becomes a `WireRequest` (`orchestrion.protocols.decode_generate_request`,
Triton's mapping and error texts) and runs through `WireInfer` like any infer request. For
``/generate`` a decoupled model's responses are gathered and there must be exactly one. For
``/generate_stream`` the first response is awaited before the answer starts, so that its
status is the answer's (an error before it, in the request, is a JSON error as on every other
route; the model's error as the first response is an SSE error event under its own status);
each later response is one ``data:`` event, sent before the model is asked for the next (a
client that reads slowly holds the model back), and an error mid-stream is a last ``data:``
event holding ``{"error": ...}``. Closing the connection cancels the request.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncGenerator
from typing import Any

import attrs

from .._server import AsyncServer
from ..protocols import (
    InferResponse,
    InvalidRequestError,
    OrchestrionError,
    WireRequest,
    decode_generate_request,
    error_message,
    generate_response,
    http_status,
    parse_version,
)
from ._http_server import Answer, HttpRequest, StreamedAnswer
from ._offload import off_loop
from ._wire_infer import WireInfer

_log = logging.getLogger("orchestrion.http")

EVENT_STREAM = [(b"content-type", b"text/event-stream; charset=utf-8")]
_JSON = [(b"content-type", b"application/json")]
ONE_RESPONSE = (
    "generate expects model to produce exactly 1 response, use generate stream for model that "
    "generates various number of responses"
)


@attrs.define(eq=False)
class Generate:
    """The generate routes of one server."""

    server: AsyncServer
    wire: WireInfer
    max_input_size: int

    async def answer(
        self, name: str, version: str, request: HttpRequest, *, streaming: bool
    ) -> Answer | StreamedAnswer:
        """The answer to a generate (or, ``streaming``, generate_stream) request.

        Raises:
            OrchestrionError: the model is unknown, or the request is malformed (before any
                inference: the caller answers it as JSON).
        """
        number = parse_version(version)
        config = self.server.model_config(name, number)  # 404 before the body
        encoding = request.headers.get(b"content-encoding", b"identity").lower()
        if encoding != b"identity":
            raise InvalidRequestError("Unsupported content-encoding, only 'identity' is supported.")
        body = request.body
        wire = await off_loop(
            len(body), decode_generate_request, config, number, body, self.max_input_size
        )
        traceparent = request.headers.get(b"traceparent")
        responses = self._responses(wire, traceparent.decode("latin-1") if traceparent else None)
        if streaming:
            return await _event_stream(responses, wire.options.request_id)
        return await _one_answer(responses, wire.options.request_id)

    async def _responses(
        self, wire: WireRequest, traceparent: str | None
    ) -> AsyncGenerator[InferResponse, None]:
        """The model's responses to ``wire``: a decoupled model's as it makes them."""
        if not self.server.is_decoupled(wire.model_name):
            yield await self.wire.infer(wire, traceparent)
            return
        options = attrs.evolve(wire.options, traceparent=traceparent)
        async with contextlib.aclosing(self.wire.stream(wire, options)) as responses:
            async for response in responses:
                yield response


async def _one_answer(responses: AsyncGenerator[InferResponse, None], request_id: str) -> Answer:
    """``/generate``: the one response as JSON (a decoupled model that makes more or fewer is
    an error)."""
    gathered: list[InferResponse] = []
    async with contextlib.aclosing(responses) as each:
        async for response in each:
            gathered.append(response)
            if len(gathered) > 1:
                break
    if len(gathered) != 1:
        raise InvalidRequestError(ONE_RESPONSE)
    document = await off_loop(_size(gathered[0]), _json_of, gathered[0], request_id)
    return 200, _JSON, [document]


async def _event_stream(
    responses: AsyncGenerator[InferResponse, None], request_id: str
) -> Answer | StreamedAnswer:
    """``/generate_stream``: the first response decides the status; see the module
    docstring."""
    try:
        first = await anext(responses)
    except StopAsyncIteration:
        return 200, EVENT_STREAM, []  # the model made no response: an empty stream
    except InvalidRequestError:
        await responses.aclose()
        raise  # the request was refused before the model ran: JSON, as everywhere
    except OrchestrionError as exc:
        await responses.aclose()
        return http_status(exc), EVENT_STREAM, [_error_event(exc)]
    except BaseException:
        await responses.aclose()
        raise
    return StreamedAnswer(200, EVENT_STREAM, _events(first, responses, request_id))


async def _events(
    first: InferResponse, responses: AsyncGenerator[InferResponse, None], request_id: str
) -> AsyncGenerator[bytes, None]:
    """Each response as one ``data:`` event; an error ends the stream with an error event."""
    async with contextlib.aclosing(responses) as rest:
        try:
            yield await _event(first, request_id)
            async for response in rest:
                yield await _event(response, request_id)
        except Exception as exc:  # the answer has started: the error is its last event
            if not isinstance(exc, OrchestrionError):
                _log.error("a streamed generate answer failed unexpectedly", exc_info=exc)
            yield _error_event(exc)


async def _event(response: InferResponse, request_id: str) -> bytes:
    document = await off_loop(_size(response), _json_of, response, request_id)
    return b"data: " + document + b"\n\n"


def _json_of(response: InferResponse, request_id: str) -> bytes:
    document: dict[str, Any] = generate_response(response, request_id)
    return json.dumps(document, separators=(",", ":")).encode()


def _error_event(error: BaseException) -> bytes:
    return b"data: " + json.dumps({"error": error_message(error)}).encode() + b"\n\n"


def _size(response: InferResponse) -> int:
    return sum(int(getattr(array, "nbytes", 0)) for array in response.outputs.values())
