"""An OpenAI HTTP request's body before it is a request model (those are `requests.py`):
read as JSON within a byte limit, and its list fields counted before pydantic walks them.

Both bounds keep one client's body from holding the router's event loop, which relays
every other stream: a body is refused as soon as it is known to be too large, its bytes
while they are read, its lists before their entries are validated.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import Request

from serve_app.model_frontend import MAX_MESSAGES
from serve_app.serve_config import MAX_REQUEST_BYTES
from workers.engine import (
    MAX_LOGIT_BIAS_TOKENS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    InvalidRequestError,
)

# An HTTP body over this is refused before it is parsed (gRPC has the same limit).
MAX_BODY_BYTES = MAX_REQUEST_BYTES
# A body past this is parsed on a worker thread (below it the thread hop costs more).
INLINE_PARSE_BYTES = 256 * 2**10
# The most a body may take to arrive once its headers have: the ingress bounds the first
# buffer's worth (serve_app/ingress/), this the rest, so no slow client holds a router
# connection open indefinitely. 16 MiB at 1 MB/s fits.
BODY_TIMEOUT_S = 30.0

# The list fields' bounds, checked before a body is parsed into models: parsing a million
# entries only to refuse them would hold the router's event loop for seconds.
_MAX_ENTRIES = {
    "messages": MAX_MESSAGES,
    "stop": MAX_STOP_STRINGS,
    "stop_token_ids": MAX_STOP_TOKEN_IDS,
    "logit_bias": MAX_LOGIT_BIAS_TOKENS,
}


async def json_body(raw: Request) -> object:
    """An HTTP request's JSON body, read no further than MAX_BODY_BYTES and for no longer
    than BODY_TIMEOUT_S."""
    declared = raw.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise _body_too_large(int(declared))
    chunks, size = [], 0
    try:
        async with asyncio.timeout(BODY_TIMEOUT_S):
            async for chunk in raw.stream():
                size += len(chunk)
                if size > MAX_BODY_BYTES:
                    raise _body_too_large(size)
                chunks.append(chunk)
    except TimeoutError:
        raise InvalidRequestError(
            f"the request body did not arrive within {BODY_TIMEOUT_S:g} s ({size} bytes "
            "came); send it at once",
            code="request_timeout",
        ) from None
    data = b"".join(chunks)
    try:
        if len(data) <= INLINE_PARSE_BYTES:
            return json.loads(data)
        # Megabytes of JSON take the parser a second: the router's other streams go on.
        return await asyncio.to_thread(json.loads, data)
    except RecursionError:
        raise InvalidRequestError("the request body nests JSON too deeply") from None
    except ValueError:  # bad JSON or UTF-8, or an integer past Python's digit limit
        raise InvalidRequestError("the request body must be a JSON object") from None


def _body_too_large(size: int) -> InvalidRequestError:
    return InvalidRequestError(
        f"the request body is {size} bytes or more; at most {MAX_BODY_BYTES} are accepted"
    )


def check_sizes(body: dict[str, Any]) -> None:
    """InvalidRequestError naming the first list field of `body` (a parsed JSON object)
    with more entries than it takes, or chat messages with too many content parts."""
    for name, limit in _MAX_ENTRIES.items():
        value = body.get(name)
        if isinstance(value, (list, dict)) and len(value) > limit:
            raise InvalidRequestError(
                f"{name} takes at most {limit} entries, got {len(value)}", param=name
            )
    messages = body.get("messages")
    if isinstance(messages, list):  # and their content parts, all together
        parts = sum(
            len(m["content"])
            for m in messages
            if isinstance(m, dict) and isinstance(m.get("content"), list)
        )
        if parts > MAX_MESSAGES:
            raise InvalidRequestError(
                f"messages: at most {MAX_MESSAGES} content parts in all, got {parts}",
                param="messages",
            )
