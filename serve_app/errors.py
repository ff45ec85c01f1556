"""What a client is told when a request fails: a kind (mapped to a gRPC status or an HTTP
code by each surface) and one clean line, never a traceback. Only an InvalidRequestError
is the client's fault; any other exception, a stray ValueError included, is internal.

Errors raised in a replica reach the router wrapped by Ray (`RayTaskError`, whose text
embeds the remote traceback) over an actor call, or as themselves over Serve's gRPC
channel; the original exception is unwrapped first. A Serve request cancelled with its
parent (`RequestCancelledError`, a `TaskCancelledError`) is a cancellation too.
"""

from __future__ import annotations

import asyncio
import logging

from ray.exceptions import RayActorError, RayTaskError, TaskCancelledError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

from serve_app.api_keys import Unauthenticated
from workers.engine import EngineDeadError, EngineOverloadedError, InvalidRequestError

logger = logging.getLogger(__name__)


class SubscriptionLost(RuntimeError):
    """The router's subscription to a replica ended while it carried this request
    (streaming/output_demux.py); retryable, as a lost replica is."""


def root_cause(exc: BaseException) -> BaseException:
    while isinstance(exc, RayTaskError) and exc.cause is not None and exc.cause is not exc:
        exc = exc.cause
    return exc


def unavailable(exc: BaseException) -> bool:
    """Whether `exc` says the replica serving a request is gone or broken (the request
    may go on elsewhere), rather than that the request itself failed."""
    return isinstance(
        root_cause(exc),
        (EngineDeadError, RayActorError, DeploymentUnavailableError, SubscriptionLost),
    )


def public_error(exc: BaseException) -> tuple[str, str]:
    """(kind, message): kind is invalid | unauthenticated | overloaded | unavailable |
    cancelled | internal."""
    cause = root_cause(exc)
    if isinstance(cause, Unauthenticated):
        return "unauthenticated", _line(cause)
    if isinstance(cause, (EngineOverloadedError, BackPressureError)):
        return "overloaded", f"the service is at capacity; retry later ({_line(cause)})"
    if unavailable(cause):
        # Ray's and Serve's texts (and an engine's failure) name actors, replicas, nodes
        # and internals: logged here, not sent.
        logger.info("a replica could not serve a request: %s", _line(cause))
        return "unavailable", "no healthy replica could serve the request; retry it"
    if isinstance(cause, InvalidRequestError):
        return "invalid", _line(cause)
    if isinstance(cause, (asyncio.CancelledError, TaskCancelledError)):
        return "cancelled", "the request was cancelled"
    logger.error("request failed", exc_info=cause)
    return "internal", f"internal error ({type(cause).__name__}); see the service logs"


def _line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:1000]
