"""What an AsyncEngine raises to its callers when it cannot take or finish a request."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request that can never run as given, its message naming the field and the allowed
    range: the client's to fix (gRPC INVALID_ARGUMENT, HTTP 400). Any other exception in
    serving a request is the service's fault, however it is typed. `param` is the field at
    fault, as the client spelled it (the OpenAI error body's `param`); None when no one
    field is. `code` is the OpenAI error body's `code` where clients act on it
    (CONTEXT_LENGTH_EXCEEDED: they trim the conversation and retry)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


class EngineOverloadedError(RuntimeError):
    """Too many requests are waiting for a slot; retry later (gRPC RESOURCE_EXHAUSTED, HTTP 503)."""


class EngineDeadError(RuntimeError):
    """The engine thread failed or was shut down; this replica can serve nothing more."""


def dead_error(error: EngineDeadError) -> EngineDeadError:
    # One exception object per consumer: raising a shared one from several tasks would
    # interleave their tracebacks on it.
    copy = EngineDeadError(*error.args)
    copy.__cause__ = error.__cause__
    return copy
