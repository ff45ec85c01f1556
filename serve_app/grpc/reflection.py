"""Server reflection's `grpc.reflection.v1` beside Serve's `grpc.reflection.v1alpha`.

Serve's gRPC ingress (its proxies, and each router replica's own server behind HAProxy)
answers reflection itself (`enable_reflection`), with grpcio-reflection's servicer, whose
only version is `v1alpha`; grpcurl and other current tools ask `v1` first. The two are
one protocol: v1 is v1alpha renamed on its way out of alpha, message for message and
field for field, so the bytes on the wire are the same. The v1 service here is therefore
grpcio-reflection's own servicer registered under v1's name, and v1's file descriptor is
v1alpha's renamed, so that reflection describes every service it lists.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection as v1alpha
from grpc_reflection.v1alpha import reflection_pb2 as v1alpha_pb2

V1_SERVICE_NAME = "grpc.reflection.v1.ServerReflection"
V1ALPHA_SERVICE_NAME = v1alpha.SERVICE_NAME
_V1_FILE = "grpc_reflection/v1/reflection.proto"
# Serve's own service on its gRPC servers, which its reflection does not list either.
_SERVE_API_SERVICE = "ray.serve.RayServeAPIService"


def v1_file_descriptor(pool: Any = None) -> Any:
    """v1's reflection.proto in `pool` (the default one): grpcio-reflection's v1 where it
    has one, else v1alpha's renamed, added once."""
    pool = pool or descriptor_pool.Default()
    try:
        return pool.FindFileContainingSymbol(V1_SERVICE_NAME)
    except KeyError:
        pass
    try:  # a grpcio-reflection with v1 registers it on import
        from grpc_reflection.v1 import reflection_pb2  # noqa: F401

        return pool.FindFileContainingSymbol(V1_SERVICE_NAME)
    except (ImportError, KeyError):
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    v1alpha_pb2.DESCRIPTOR.CopyToProto(proto)
    old, new = proto.package, "grpc.reflection.v1"
    proto.name, proto.package = _V1_FILE, new
    proto.options.ClearField("deprecated")
    proto.options.java_package = "io.grpc.reflection.v1"
    proto.options.go_package = "google.golang.org/grpc/reflection/grpc_reflection_v1"
    for message in proto.message_type:
        for field in message.field:
            if field.HasField("type_name"):  # message fields only: an empty one is refused
                field.type_name = field.type_name.replace(f".{old}.", f".{new}.")
    for service in proto.service:
        for method in service.method:
            method.input_type = method.input_type.replace(f".{old}.", f".{new}.")
            method.output_type = method.output_type.replace(f".{old}.", f".{new}.")
    pool.Add(proto)
    return pool.FindFileByName(_V1_FILE)


def enable_reflection_v1(service_names: Iterable[str], server: Any, pool: Any = None) -> None:
    """grpcio-reflection's `enable_server_reflection`, as `grpc.reflection.v1`: lists
    `service_names` and describes what `pool` (the default one) holds."""
    v1_file_descriptor(pool)
    servicer_class = (
        v1alpha.aio.ReflectionServicer
        if isinstance(server, grpc.aio.Server)
        else v1alpha.ReflectionServicer
    )
    servicer = servicer_class(service_names, pool=pool)
    handlers = {
        "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
            servicer.ServerReflectionInfo,
            # v1alpha's messages: v1's bytes, field for field (see the module).
            request_deserializer=v1alpha_pb2.ServerReflectionRequest.FromString,
            response_serializer=v1alpha_pb2.ServerReflectionResponse.SerializeToString,
        )
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(V1_SERVICE_NAME, handlers),)
    )
    server.add_registered_method_handlers(V1_SERVICE_NAME, handlers)


def _registered_services(server: Any) -> set[str]:
    """The services registered so far on Serve's gRPC server (its `generic_rpc_handlers`,
    whose method keys read `/package.Service/Method`)."""
    return {
        key.split("/")[1]
        for handlers in getattr(server, "generic_rpc_handlers", ())
        for key in getattr(handlers[0], "_method_handlers", {})
    }


def add_reflection_v1_to_server(servicer: Any, server: Any) -> None:
    """A servicer function for Serve's gRPC options, after Baton's services: reflection v1
    on the server itself. Serve routes every service's calls to the application's ingress
    deployment, except the ones it marks passthrough, as it does its own reflection, so
    this marks v1 the same way. It lists what v1alpha lists: the services registered
    before it (Serve's own aside) and both reflection versions (Baton's Serve configs keep
    Serve's `enable_reflection` on). `servicer` is Serve's stand-in, unused: the server
    answers reflection, not the router."""
    server.add_passthrough_service(V1_SERVICE_NAME)
    names = _registered_services(server) - {_SERVE_API_SERVICE}
    enable_reflection_v1(sorted(names | {V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME}), server)
