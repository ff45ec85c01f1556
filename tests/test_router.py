"""serve_app/router.py's pieces that need no running service (the rest: test_service.py)."""

from __future__ import annotations

import asyncio
import json

import pytest

from serve_app import openai_api
from serve_app.openai_responses import DONE_EVENT, ResponseBuilder
from serve_app.router import _http_error, _sse
from serve_app.stream_merge import merge_streams
from workers.engine.errors import InvalidRequestError
from workers.engine.outputs import RequestOutput


def test_an_error_mid_stream_is_an_openai_error_event_then_done():
    async def rest():
        yield RequestOutput("r", [8], "lo")
        raise InvalidRequestError("stop_token_ids: 99999 is not a token id")

    async def events():
        builder = ResponseBuilder(False, "r", "m", str, bytes)
        first = RequestOutput("r", [7], "Hel")
        return [e async for e in _sse(builder, (0, first), merge_streams([rest()]), True)]

    sent = asyncio.run(events())
    assert len(sent) == 4 and sent[-1] == DONE_EVENT
    error = json.loads(sent[2].removeprefix("data: "))["error"]
    assert error["type"] == "invalid_request_error" and "stop_token_ids" in error["message"]


def test_an_http_error_names_the_field_at_fault_as_its_param():
    with pytest.raises(InvalidRequestError) as refused:
        body = {"model": "m", "prompt": "x", "max_tokens": 0}
        openai_api.parse(openai_api.CompletionRequest, body)
    response = _http_error(refused.value)
    error = json.loads(response.body)["error"]
    assert response.status_code == 400 and error["param"] == "max_tokens"
    assert error["type"] == "invalid_request_error" and "max_tokens" in error["message"]
