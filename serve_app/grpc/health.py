"""`grpc.health.v1.Health` as the router answers it (Serve's gRPC ingress calls the
router's method of each RPC's name).

The router serves `baton.v1.Baton` and the overall status (""). Both are SERVING while
the pool that streams outputs (decode, or aggregated) has a running replica, and
NOT_SERVING while it has none, so that a load balancer can act (`_serving`, from Serve's
controller). A prefill pool with none leaves them SERVING: decode prefills itself then.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
from grpc_health.v1 import health_pb2
from ray.serve.grpc_util import RayServegRPCContext

from serve_app.api_keys import authorization
from serve_app.grpc.service import set_status
from serve_app.grpc.servicer import SERVICE, MalformedRequest, decoded

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICES = ("", SERVICE.full_name)


class HealthService:
    """The Health methods, mixed into the router, which provides `_authorize`."""

    def _authorize(self, header: str | None) -> None:
        raise NotImplementedError

    async def _serving(self) -> bool:
        """Whether the pool that streams outputs has a running replica."""
        raise NotImplementedError

    async def _status(self) -> int:
        return SERVING if await self._serving() else NOT_SERVING

    async def Check(
        self,
        request: health_pb2.HealthCheckRequest | MalformedRequest,
        grpc_context: RayServegRPCContext,
    ) -> health_pb2.HealthCheckResponse:
        # A probe's: no key asked for, as load balancers and kubelets carry none.
        try:
            service = decoded(request).service
        except Exception as e:
            set_status(grpc_context, e)
            return health_pb2.HealthCheckResponse()
        if service not in SERVICES:
            grpc_context.set_code(grpc.StatusCode.NOT_FOUND)
            grpc_context.set_details(f"unknown service {service!r}; known: {list(SERVICES)}")
            return health_pb2.HealthCheckResponse()
        return health_pb2.HealthCheckResponse(status=await self._status())

    async def List(
        self,
        request: health_pb2.HealthListRequest | MalformedRequest,
        grpc_context: RayServegRPCContext,
    ) -> health_pb2.HealthListResponse:
        try:
            decoded(request)
        except Exception as e:
            set_status(grpc_context, e)
            return health_pb2.HealthListResponse()
        status = await self._status()
        return health_pb2.HealthListResponse(
            statuses={name: health_pb2.HealthCheckResponse(status=status) for name in SERVICES}
        )

    async def Watch(
        self,
        request: health_pb2.HealthCheckRequest | MalformedRequest,
        grpc_context: RayServegRPCContext,
    ) -> AsyncIterator[health_pb2.HealthCheckResponse]:
        # The status when the watch began; the stream ends when the client leaves.
        # Unlike Check (a probe's), it holds one of the router's request slots for as long
        # as it stays open, so a service with keys asks for one.
        try:
            self._authorize(authorization(grpc_context.invocation_metadata()))
            service = decoded(request).service
        except Exception as e:
            set_status(grpc_context, e)
            raise
        known = service in SERVICES
        yield health_pb2.HealthCheckResponse(
            status=await self._status() if known else health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
        )
        while True:
            await asyncio.sleep(3600)
