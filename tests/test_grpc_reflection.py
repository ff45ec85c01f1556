"""Server reflection, v1 and v1alpha, on the gRPC server Serve builds from Baton's
servicer functions (serve_app/grpc/reflection.py): Serve's own `start_grpc_server`, as
its proxies and each router replica's direct ingress run it, without a Ray cluster; the
calls Serve would route to the router answer UNIMPLEMENTED here. (A deployed service's
reflection, v1alpha: tests/test_service.py and tests/test_service_auth.py.)"""

from __future__ import annotations

import asyncio
import concurrent.futures
import socket
import threading
from collections.abc import Iterator

import grpc
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)
from ray.serve._private.grpc_util import start_grpc_server
from ray.serve._private.proxy_request_response import gRPCStreamingType
from ray.serve.config import gRPCOptions

from serve_app.grpc.api import baton_pb2 as pb
from serve_app.grpc.api import baton_pb2_grpc
from serve_app.grpc.reflection import V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME, v1_file_descriptor
from serve_app.serve_config import GRPC_SERVICER_FUNCTIONS

BATON = "baton.v1.Baton"
HEALTH = "grpc.health.v1.Health"
LISTED = sorted([BATON, HEALTH, V1ALPHA_SERVICE_NAME, V1_SERVICE_NAME])


def _routed(service_method: str, streaming_type: gRPCStreamingType):
    """Serve's handler factory stand-in: where Serve would call the router."""
    message = f"routed to the application: {service_method}"
    if streaming_type == gRPCStreamingType.UNARY_STREAM:

        async def stream(request, context):
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, message)
            yield  # an async generator, as Serve's streaming handler

        return stream

    async def unary(request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, message)

    return unary


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def channel() -> Iterator[grpc.Channel]:
    port = _free_port()
    options = gRPCOptions(port=port, grpc_servicer_functions=list(GRPC_SERVICER_FUNCTIONS))
    loop = asyncio.new_event_loop()
    started: concurrent.futures.Future = concurrent.futures.Future()

    def serve() -> None:
        asyncio.set_event_loop(loop)
        try:
            start = start_grpc_server(_routed, options, event_loop=loop)
            _, server = loop.run_until_complete(start)
        except BaseException as e:
            started.set_exception(e)
            return
        started.set_result(server)
        loop.run_forever()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    server = started.result(timeout=30)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            grpc.channel_ready_future(ch).result(timeout=10)
            yield ch
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(None), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)


def _v1_messages() -> tuple[type, type]:
    pool = descriptor_pool.Default()
    v1_file_descriptor(pool)
    return tuple(
        message_factory.GetMessageClass(pool.FindMessageTypeByName(f"grpc.reflection.v1.{name}"))
        for name in ("ServerReflectionRequest", "ServerReflectionResponse")
    )


def _v1_ask(channel: grpc.Channel, **request_fields) -> object:
    """One request on v1's ServerReflectionInfo stream, built from v1's own messages."""
    request_type, response_type = _v1_messages()
    call = channel.stream_stream(
        f"/{V1_SERVICE_NAME}/ServerReflectionInfo",
        request_serializer=request_type.SerializeToString,
        response_deserializer=response_type.FromString,
    )
    (response,) = list(call(iter([request_type(**request_fields)]), timeout=10))
    return response


def _files(response) -> list[descriptor_pb2.FileDescriptorProto]:
    """The files a file_descriptor_response holds: the one asked for and its imports."""
    return [
        descriptor_pb2.FileDescriptorProto.FromString(data)
        for data in response.file_descriptor_response.file_descriptor_proto
    ]


def test_v1_lists_the_services_and_describes_baton(channel):
    listed = _v1_ask(channel, list_services="")
    assert sorted(s.name for s in listed.list_services_response.service) == LISTED
    files = _files(_v1_ask(channel, file_containing_symbol=BATON))
    (baton,) = [f for f in files if f.package == "baton.v1"]
    (service,) = baton.service
    assert {m.name for m in service.method} == {
        "Generate",
        "GenerateUnary",
        "Tokenize",
        "GetModelInfo",
    }
    # Every service it lists, reflection v1 itself included, it can describe.
    for name in LISTED:
        response = _v1_ask(channel, file_containing_symbol=name)
        assert response.WhichOneof("message_response") == "file_descriptor_response", name
    unknown = _v1_ask(channel, file_containing_symbol="no.such.Service")
    assert unknown.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]


def test_v1alpha_still_answers_and_lists_the_same(channel):
    database = ProtoReflectionDescriptorDatabase(channel)
    assert sorted(database.get_services()) == LISTED
    pool = descriptor_pool.DescriptorPool(database)
    methods = {m.name for m in pool.FindServiceByName(BATON).methods}
    assert methods == {"Generate", "GenerateUnary", "Tokenize", "GetModelInfo"}
    v1 = pool.FindServiceByName(V1_SERVICE_NAME)
    assert v1.methods_by_name["ServerReflectionInfo"].input_type.full_name == (
        "grpc.reflection.v1.ServerReflectionRequest"
    )


def test_baton_and_health_are_still_routed_to_the_application(channel):
    stub = baton_pb2_grpc.BatonStub(channel)
    with pytest.raises(grpc.RpcError) as err:
        stub.Tokenize(pb.TokenizeRequest(text="hi"), timeout=10)
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert err.value.details() == f"routed to the application: /{BATON}/Tokenize"
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(pb.GenerateRequest(text="hi"), timeout=10))
    assert err.value.details() == f"routed to the application: /{BATON}/Generate"


def test_v1s_descriptor_is_v1alphas_renamed():
    from grpc_reflection.v1alpha import reflection_pb2 as v1alpha_pb2

    v1 = descriptor_pb2.FileDescriptorProto()
    v1_file_descriptor().CopyToProto(v1)
    alpha = descriptor_pb2.FileDescriptorProto()
    v1alpha_pb2.DESCRIPTOR.CopyToProto(alpha)
    assert v1.package == "grpc.reflection.v1"
    assert [(m.name, [(f.name, f.number, f.type) for f in m.field]) for m in v1.message_type] == [
        (m.name, [(f.name, f.number, f.type) for f in m.field]) for m in alpha.message_type
    ]
    assert v1_file_descriptor() is v1_file_descriptor()  # added once


def test_a_client_with_no_stubs_calls_baton_from_what_v1_describes(channel):
    protos = _files(_v1_ask(channel, file_containing_symbol=BATON))
    pool = descriptor_pool.DescriptorPool()
    while protos:  # each file after the ones it imports
        ready = [p for p in protos if all(_has_file(pool, d) for d in p.dependency)]
        assert ready, [p.name for p in protos]
        for proto in ready:
            pool.Add(proto)
            protos.remove(proto)
    method = pool.FindServiceByName(BATON).methods_by_name["Tokenize"]
    request_type = message_factory.GetMessageClass(method.input_type)
    call = channel.unary_unary(
        f"/{BATON}/Tokenize", request_serializer=lambda m: m.SerializeToString()
    )
    with pytest.raises(grpc.RpcError) as err:
        call(request_type(text="hi"), timeout=10)
    # Past reflection, the call is the application's, as any client's.
    assert err.value.details() == f"routed to the application: /{BATON}/Tokenize"


def _has_file(pool, name: str) -> bool:
    try:
        pool.FindFileByName(name)
    except KeyError:
        return False
    return True
