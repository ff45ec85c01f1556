"""How Serve's gRPC ingress registers and decodes the services the router answers.

Serve builds its gRPC servers from servicer functions such as the generated
`add_BatonServicer_to_server`, keeping each method's request decoder. The generated
decoders raise on bytes that are not their message (a buggy client, invalid UTF-8 in a
string field), and grpc then answers UNKNOWN and logs a traceback. The functions here
register `baton.v1.Baton` and `grpc.health.v1.Health` with decoders that hand the router
a `MalformedRequest` instead, which it refuses as INVALID_ARGUMENT naming the message;
everything else is the generated service, method for method.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health_pb2

from serve_app.grpc.api import baton_pb2 as pb
from workers.engine import InvalidRequestError

SERVICE = pb.DESCRIPTOR.services_by_name["Baton"]
HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"]


@dataclass(frozen=True)
class MalformedRequest:
    """Bytes that do not decode as the method's request message."""

    message: str  # its full name, e.g. baton.v1.GenerateRequest
    error: str


def decoded(request: Message | MalformedRequest) -> Message:
    """The request, or InvalidRequestError when its bytes did not decode."""
    if isinstance(request, MalformedRequest):
        raise InvalidRequestError(
            f"the request is not a valid {request.message}: {request.error}", param="request"
        )
    return request


def _lenient(message: type[Message]) -> Callable[[bytes], Message | MalformedRequest]:
    def decode(data: bytes) -> Message | MalformedRequest:
        try:
            return message.FromString(data)
        except DecodeError as e:
            return MalformedRequest(message.DESCRIPTOR.full_name, str(e))

    return decode


def _add_lenient_service(service: Any, messages: ModuleType, servicer: Any, server: Any) -> None:
    """Registers `service` (a ServiceDescriptor whose messages live in `messages`) as its
    generated `add_*Servicer_to_server` would, with lenient request decoders."""
    handlers = {}
    for method in service.methods:
        if method.client_streaming:
            raise RuntimeError(f"{method.full_name}: client streaming is not registered here")
        request = getattr(messages, method.input_type.name)
        response = getattr(messages, method.output_type.name)
        make = (
            grpc.unary_stream_rpc_method_handler
            if method.server_streaming
            else grpc.unary_unary_rpc_method_handler
        )
        handlers[method.name] = make(
            getattr(servicer, method.name),
            request_deserializer=_lenient(request),
            response_serializer=response.SerializeToString,
        )
    generic = grpc.method_handlers_generic_handler(service.full_name, handlers)
    server.add_generic_rpc_handlers((generic,))
    server.add_registered_method_handlers(service.full_name, handlers)


def add_baton_servicer_to_server(servicer: Any, server: Any) -> None:
    """`add_BatonServicer_to_server` with lenient request decoders (see the module)."""
    _add_lenient_service(SERVICE, pb, servicer, server)


def add_health_servicer_to_server(servicer: Any, server: Any) -> None:
    """`add_HealthServicer_to_server` with lenient request decoders (see the module)."""
    _add_lenient_service(HEALTH_SERVICE, health_pb2, servicer, server)
