"""serve_app/grpc/servicer.py: the Baton service as Serve's ingress registers it, with
request decoders that hand malformed bytes to the router instead of failing in grpc
(the router's answer, INVALID_ARGUMENT, runs end to end in test_service_lifecycle.py)."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest

from serve_app.grpc.api import baton_pb2 as pb
from serve_app.grpc.api import baton_pb2_grpc
from serve_app.grpc.servicer import MalformedRequest, add_baton_servicer_to_server, decoded
from workers.errors import InvalidRequestError

NOT_UTF8 = b"\x12\x02\xff\xfe"  # GenerateRequest.text (field 2) holding invalid UTF-8


class _Refusing(baton_pb2_grpc.BatonServicer):
    """Answers as the router does: a request that did not decode is INVALID_ARGUMENT."""

    def _check(self, request, context):
        try:
            return decoded(request)
        except InvalidRequestError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    def Generate(self, request, context):
        request = self._check(request, context)
        yield pb.GenerateResponse(request_id=request.request_id, text=request.text)

    def GenerateUnary(self, request, context):
        request = self._check(request, context)
        return pb.GenerateResponse(request_id=request.request_id, text=request.text)

    def Tokenize(self, request, context):
        request = self._check(request, context)
        return pb.TokenizeResponse(count=len(request.text))

    def GetModelInfo(self, request, context):
        return pb.ModelInfo(model_id="m")


@pytest.fixture(scope="module")
def channel() -> Iterator[grpc.Channel]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    add_baton_servicer_to_server(_Refusing(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            yield ch
    finally:
        server.stop(grace=None)


def test_well_formed_requests_reach_every_method_as_the_generated_stubs_send_them(channel):
    stub = baton_pb2_grpc.BatonStub(channel)
    request = pb.GenerateRequest(request_id="r", text="hi")
    assert [r.text for r in stub.Generate(request, timeout=5)] == ["hi"]
    assert stub.GenerateUnary(request, timeout=5).request_id == "r"
    assert stub.Tokenize(pb.TokenizeRequest(text="abc"), timeout=5).count == 3
    assert stub.GetModelInfo(pb.ModelInfoRequest(), timeout=5).model_id == "m"


@pytest.mark.parametrize(
    ("method", "kind", "message"),
    [
        ("Generate", "unary_stream", "GenerateRequest"),
        ("GenerateUnary", "unary_unary", "GenerateRequest"),
        ("Tokenize", "unary_unary", "TokenizeRequest"),
    ],
)
def test_bytes_that_do_not_decode_are_invalid_argument_naming_the_message(
    channel, method, kind, message
):
    send = getattr(channel, kind)(f"/baton.v1.Baton/{method}")
    with pytest.raises(grpc.RpcError) as err:
        reply = send(NOT_UTF8, timeout=5)  # a unary call raises here, a stream below
        list(reply)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"not a valid baton.v1.{message}" in err.value.details()


def test_decoded_passes_messages_through_and_names_the_field_of_a_malformed_one():
    request = pb.GenerateRequest(text="x")
    assert decoded(request) is request
    with pytest.raises(InvalidRequestError, match="not a valid baton.v1.GenerateRequest") as e:
        decoded(MalformedRequest("baton.v1.GenerateRequest", "Error parsing message"))
    assert e.value.param == "request"
