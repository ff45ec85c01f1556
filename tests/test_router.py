"""The router where no replica is needed: the HTTP app's paths and methods it does not
serve, and a choice's outputs from a pool call stood in for (the whole path runs in
test_service*.py)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from fastapi.testclient import TestClient
from tiny_model import make_tiny_model

from serve_app.metrics import RouterMetrics
from serve_app.model_frontend import ModelFrontend, PromptInput
from serve_app.protocol import StreamStart
from serve_app.router import Router, http_app
from serve_app.streaming.output_demux import OutputDemux
from workers.engine.outputs import RequestOutput
from workers.engine.sampling_params import SamplingParams


def test_an_unknown_path_or_method_answers_in_openais_error_shape():
    client = TestClient(http_app)
    missing = client.get("/v2/completions")
    assert missing.status_code == 404
    assert missing.json()["error"] == {
        "message": "Not Found: GET /v2/completions",
        "type": "invalid_request_error",
        "param": None,
        "code": None,
    }
    wrong = client.get("/v1/chat/completions")
    assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"
    assert wrong.json()["error"]["message"] == "Method Not Allowed: GET /v1/chat/completions"


def test_no_generated_docs_are_served_past_the_api_key():
    client = TestClient(http_app)
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert client.get(path).status_code == 404, path


class _PoolCall:
    """A pool's generate call answering on the call itself: its StreamStart, then the
    given outputs, then nothing more (the engine still decoding) until cancelled."""

    def __init__(self, outputs: list[RequestOutput]):
        self.items: list = [StreamStart("replica-a", muxed=False), *outputs]
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self.items:
            await asyncio.Event().wait()
        return self.items.pop(0)

    def cancel(self) -> None:
        self.cancelled = True


class _Router(Router):
    def __del__(self) -> None:  # Serve's ingress wrapper awaits one on shutdown; none here
        pass


async def _no_subscription(sub):
    yield "replica-a"
    await asyncio.Event().wait()


def test_a_stop_string_ends_the_choice_and_cancels_its_pool_call(tmp_path):
    # The engine goes on decoding past a stop string (the router applies them): the
    # router must cancel the call there, so the replica aborts the request at once.
    frontend = ModelFrontend(make_tiny_model(tmp_path), "tiny-id", 4, 256)
    ids = frontend.tokenize(PromptInput(text="hello"))
    params = SamplingParams(max_tokens=10, stop=["ll"])
    request = frontend.build_request("r1", ids, params, None)
    outputs = [
        RequestOutput(request.request_id, [t], "", num_output_tokens=i + 1)
        for i, t in enumerate(frontend.tokenize(PromptInput(text="hello hello")))
    ]
    call = _PoolCall(outputs)
    router = _Router.__new__(_Router)  # what _outputs uses, without Serve
    router.pool = SimpleNamespace(generate=SimpleNamespace(remote=lambda r: call))
    router.demux = OutputDemux(_no_subscription)
    router.metrics = RouterMetrics("test", "tiny")

    async def run() -> list[RequestOutput]:
        got = []
        text = frontend.text_stream(ids, params)
        async for out in router._outputs(request, text, "grpc"):
            got.append(out)
        router.demux.close()
        return got

    got = asyncio.run(asyncio.wait_for(run(), 10))
    assert "".join(o.new_text for o in got) == "he"
    assert got[-1].finished and call.cancelled
    assert len(call.items) > 0  # outputs the engine made past the stop were never read
