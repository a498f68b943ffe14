"""How a transport calls the servicer: each method of ``GRPCInferenceService`` as the
generated code would register it, with three differences. Messages that protobuf cannot
decode become that request's INVALID_ARGUMENT (not grpcio's UNKNOWN for the whole call); a
method of a restricted group refuses calls without the group's metadata
(`frontends._restricted`); and a response already serialized (`serialized_grpc_response`)
passes through as bytes. `methods` is that table, which both transports use: grpcio's
(`method_handlers`) and the native front end's (`frontends._native`).
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import attrs
import grpc
from google.protobuf.message import DecodeError
from tritonclient.grpc import service_pb2

from ._grpc_streams import Undecodable
from ._restricted import GRPC_METHODS, Restrictions


def _lenient(parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def deserialize(data: bytes) -> Any:
        try:
            return parse(data)
        except DecodeError as exc:
            return Undecodable(f"the request message cannot be decoded: {exc}")

    return deserialize


def _guarded(
    behaviour: Callable[..., Any], category: str, restrictions: Restrictions
) -> Callable[..., Awaitable[Any]]:
    """A unary method that refuses requests protobuf could not decode (INVALID_ARGUMENT)
    and, when its category is restricted, those without the header (UNAVAILABLE)."""

    async def unary(request: Any, context: Any) -> Any:
        refusal = restrictions.refusal(category, _metadata_of(context))
        if refusal is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, refusal)
        if isinstance(request, Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.error)
        result = behaviour(request, context)
        return await result if inspect.isawaitable(result) else result

    return unary


def _guarded_stream(
    behaviour: Callable[..., AsyncIterator[Any]], category: str, restrictions: Restrictions
) -> Callable[..., AsyncIterator[Any]]:
    """A streaming method that, when its category is restricted, ends a stream opened
    without the header (UNAVAILABLE) before reading from it."""
    if category not in restrictions.rules:
        return behaviour

    async def stream(request_iterator: Any, context: Any) -> AsyncIterator[Any]:
        refusal = restrictions.refusal(category, _metadata_of(context))
        if refusal is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, refusal)
        async for response in behaviour(request_iterator, context):
            yield response

    return stream


def _metadata_of(context: Any) -> Callable[[str], str | None]:
    def header(name: str) -> str | None:
        for key, value in context.invocation_metadata() or ():
            if key == name:
                return str(value)
        return None

    return header


def _serializer(message_type: Any) -> Callable[[Any], bytes]:
    """The message's own serializer, passing through what is serialized already
    (`serialized_grpc_response`)."""
    serialize = message_type.SerializeToString

    def serializer(message: Any) -> bytes:
        return message if isinstance(message, bytes) else serialize(message)

    return serializer


@attrs.frozen
class Method:
    """One method of ``GRPCInferenceService`` as a transport calls it."""

    name: str
    streaming: bool
    """Client and server streaming (ModelStreamInfer); else unary."""
    category: str
    """Its restricted-protocol group (``--grpc-restricted-protocol``)."""
    deserialize: Callable[[bytes], Any]
    """The request message, or `Undecodable`."""
    serialize: Callable[[Any], bytes]
    behaviour: Callable[..., Any]
    """``(request, context)``: unary methods refuse undecodable or restricted calls."""


SERVICE_NAME = "inference.GRPCInferenceService"


def methods(service: Any) -> dict[str, Method]:
    """The servicer's methods (an `InferenceService`), by name, with lenient decoding,
    restrictions and pass-through serialization."""
    descriptor = service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    table = {}
    for method in descriptor.methods:
        request_type = getattr(service_pb2, method.input_type.name)
        response_type = getattr(service_pb2, method.output_type.name)
        behaviour = getattr(service, method.name)
        category = GRPC_METHODS.get(method.name, "")
        table[method.name] = Method(
            name=method.name,
            streaming=method.client_streaming,
            category=category,
            deserialize=_lenient(request_type.FromString),
            serialize=_serializer(response_type),
            behaviour=_guarded_stream(behaviour, category, service.restrictions)
            if method.client_streaming
            else _guarded(behaviour, category, service.restrictions),
        )
    return table


def method_handlers(service: Any) -> grpc.GenericRpcHandler:
    """The servicer's methods as grpcio's handlers."""
    handlers = {}
    for name, method in methods(service).items():
        coding = {
            "request_deserializer": method.deserialize,
            "response_serializer": method.serialize,
        }
        if method.streaming:
            handlers[name] = grpc.stream_stream_rpc_method_handler(method.behaviour, **coding)
        else:
            handlers[name] = grpc.unary_unary_rpc_method_handler(method.behaviour, **coding)
    return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)
