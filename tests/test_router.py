"""The router's HTTP app where no replica is needed: paths and methods it does not serve."""

from __future__ import annotations

from fastapi.testclient import TestClient

from serve_app.router import http_app


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
