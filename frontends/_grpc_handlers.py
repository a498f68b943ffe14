"""How grpcio calls the servicer: each method of ``GRPCInferenceService`` registered as the
generated code would, with three differences. Messages that protobuf cannot decode become
that request's INVALID_ARGUMENT (not grpcio's UNKNOWN for the whole call); a method of a
restricted group refuses calls without the group's metadata (`frontends._restricted`); and a
response already serialized (`serialized_grpc_response`) passes through as bytes.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

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


def method_handlers(service: Any) -> grpc.GenericRpcHandler:
    """The servicer's methods (an `InferenceService`), as the generated code registers them,
    with lenient decoding, restrictions and pass-through serialization."""
    descriptor = service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    handlers = {}
    for method in descriptor.methods:
        request_type = getattr(service_pb2, method.input_type.name)
        response_type = getattr(service_pb2, method.output_type.name)
        behaviour = getattr(service, method.name)
        coding = {
            "request_deserializer": _lenient(request_type.FromString),
            "response_serializer": _serializer(response_type),
        }
        category = GRPC_METHODS.get(method.name, "")
        if method.client_streaming:
            handlers[method.name] = grpc.stream_stream_rpc_method_handler(
                _guarded_stream(behaviour, category, service.restrictions), **coding
            )
        else:
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(
                _guarded(behaviour, category, service.restrictions), **coding
            )
    return grpc.method_handlers_generic_handler(descriptor.full_name, handlers)
