"""OpenAI request bodies before they are models: read within their byte limit, their list
fields bounded before they are parsed (through `openai_api.parse`, as the router sees them)."""

from __future__ import annotations

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient

from serve_app.openai.body import INLINE_PARSE_BYTES, MAX_BODY_BYTES, json_body
from serve_app.openai.requests import ChatCompletionRequest, parse
from workers.errors import InvalidRequestError


def _chat(**fields):
    return {"model": "m", "messages": [{"role": "user", "content": "a"}], **fields}


@pytest.mark.parametrize(
    ("field", "value", "limit"),
    [
        ("messages", _chat()["messages"] * 2049, 2048),
        ("stop", ["x"] * 65, 64),
        ("stop_token_ids", [1] * 1025, 1024),
        ("logit_bias", {str(i): 1.0 for i in range(1025)}, 1024),
    ],
)
def test_list_fields_are_bounded_before_they_are_parsed(field, value, limit):
    with pytest.raises(InvalidRequestError, match=f"^{field} takes at most {limit} entries") as e:
        parse(ChatCompletionRequest, _chat(**{field: value}))
    assert e.value.param == field


def test_content_parts_are_bounded_across_all_messages_before_they_are_parsed():
    part = {"type": "text", "text": ""}
    parse(ChatCompletionRequest, _chat(messages=[{"role": "user", "content": [part] * 2048}]))
    split = [{"role": "user", "content": [part] * 1025}] * 2
    with pytest.raises(InvalidRequestError, match="at most 2048 content parts in all, got 2050"):
        parse(ChatCompletionRequest, _chat(messages=split))


def test_a_body_is_read_as_json_up_to_its_limit():
    app = FastAPI()

    @app.post("/")
    async def echo(raw: Request):
        try:
            return await json_body(raw)
        except InvalidRequestError as e:
            return JSONResponse({"refused": str(e)}, 400)

    client = TestClient(app)
    assert client.post("/", json={"a": 1}).json() == {"a": 1}
    large = {"text": "x" * INLINE_PARSE_BYTES}  # parsed on a worker thread, as the same
    assert client.post("/", json=large).json() == large
    assert "must be a JSON object" in client.post("/", content=b"{oops").json()["refused"]
    # Python's own limits on JSON are the client's error too, not a 500.
    assert "nests JSON too deeply" in client.post("/", content=b"[" * 100_000).json()["refused"]
    huge_int = b'{"max_tokens": ' + b"9" * 5000 + b"}"
    assert "must be a JSON object" in client.post("/", content=huge_int).json()["refused"]
    big = b'"' + b"x" * MAX_BODY_BYTES + b'"'
    refused = client.post("/", content=big).json()["refused"]
    assert f"at most {MAX_BODY_BYTES}" in refused

    def chunked():  # no Content-Length: the limit holds while reading
        for _ in range(MAX_BODY_BYTES // 2**20 + 1):
            yield b" " * 2**20

    assert f"at most {MAX_BODY_BYTES}" in client.post("/", content=chunked()).json()["refused"]


def test_a_body_that_does_not_arrive_in_time_is_refused(monkeypatch):
    import asyncio

    from serve_app.openai import body

    monkeypatch.setattr(body, "BODY_TIMEOUT_S", 0.2)
    parts = [b'{"model": ', None]  # the rest never comes

    async def receive():
        part = parts.pop(0) if parts else None
        if part is None:
            await asyncio.sleep(3600)
        return {"type": "http.request", "body": part, "more_body": True}

    async def read():
        scope = {"type": "http", "method": "POST", "headers": [], "path": "/"}
        return await json_body(Request(scope, receive))

    with pytest.raises(
        InvalidRequestError, match=r"did not arrive within 0.2 s \(10 bytes came\)"
    ) as e:
        asyncio.run(read())
    assert e.value.code == "request_timeout"
