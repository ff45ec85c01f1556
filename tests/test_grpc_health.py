"""serve_app/grpc/health.py: the router's grpc.health.v1.Health methods, served here by
a plain grpc.aio server registered as Serve's ingress registers them (the same methods
behind Serve's ingress run in test_service.py and test_service_auth.py)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from serve_app.api_keys import Unauthenticated
from serve_app.grpc.health import HealthService
from serve_app.grpc.servicer import add_health_servicer_to_server

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_UTF8 = b"\x0a\x02\xff\xfe"  # HealthCheckRequest.service (field 1) holding invalid UTF-8


class _Router(HealthService):
    def __init__(self, serving: bool = True):
        self.serving = serving  # whether the pool that streams outputs has a replica

    def _authorize(self, header: str | None) -> None:
        if header != "Bearer key":
            raise Unauthenticated("invalid API key")

    async def _serving(self) -> bool:
        return self.serving


def _with_server(check, router: _Router | None = None) -> None:
    """Runs `check(channel)` against a server answering with `_Router`'s methods."""

    async def run() -> None:
        server = grpc.aio.server()
        add_health_servicer_to_server(router or _Router(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                await check(channel)
        finally:
            await server.stop(grace=None)

    asyncio.run(run())


def test_check_serves_the_overall_status_and_baton_and_refuses_other_services():
    async def check(channel):
        health = health_pb2_grpc.HealthStub(channel)
        for name in ("", "baton.v1.Baton"):
            reply = await health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
            assert reply.status == SERVING
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await health.Check(health_pb2.HealthCheckRequest(service="nope.Svc"), timeout=5)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert "'nope.Svc'" in err.value.details() and "baton.v1.Baton" in err.value.details()

    _with_server(check)


def test_check_and_list_say_not_serving_while_the_streaming_pool_has_no_replica():
    async def check(channel):
        health = health_pb2_grpc.HealthStub(channel)
        for name in ("", "baton.v1.Baton"):
            reply = await health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
        listed = await health.List(health_pb2.HealthListRequest(), timeout=5)
        assert {s.status for s in listed.statuses.values()} == {
            health_pb2.HealthCheckResponse.NOT_SERVING
        }

    _with_server(check, _Router(serving=False))


def test_list_names_every_service_the_router_answers_for():
    async def check(channel):
        reply = await health_pb2_grpc.HealthStub(channel).List(
            health_pb2.HealthListRequest(), timeout=5
        )
        assert {name: s.status for name, s in reply.statuses.items()} == {
            "": SERVING,
            "baton.v1.Baton": SERVING,
        }

    _with_server(check)


def test_watch_needs_a_key_and_then_reports_serving_or_unknown():
    async def check(channel):
        watch = health_pb2_grpc.HealthStub(channel).Watch
        known = watch(
            health_pb2.HealthCheckRequest(service="baton.v1.Baton"),
            metadata=(("authorization", "Bearer key"),),
        )
        assert (await known.read()).status == SERVING
        known.cancel()
        unknown = watch(
            health_pb2.HealthCheckRequest(service="nope.Svc"),
            metadata=(("authorization", "Bearer key"),),
        )
        assert (await unknown.read()).status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
        unknown.cancel()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await watch(health_pb2.HealthCheckRequest(), timeout=5).read()
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED

    _with_server(check)


@pytest.mark.parametrize(("method", "kind"), [("Check", "unary_unary"), ("Watch", "unary_stream")])
def test_bytes_that_do_not_decode_are_invalid_argument_naming_the_message(method, kind):
    async def check(channel):
        send = getattr(channel, kind)(f"/grpc.health.v1.Health/{method}")
        metadata = (("authorization", "Bearer key"),)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            call = send(NOT_UTF8, metadata=metadata, timeout=5)
            await (call if kind == "unary_unary" else call.read())
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not a valid grpc.health.v1.HealthCheckRequest" in err.value.details()

    _with_server(check)
