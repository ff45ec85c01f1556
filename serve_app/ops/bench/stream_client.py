"""One streamed completion against an OpenAI-compatible endpoint, timed token by token.

Plain HTTP and server-sent events (the stdlib's http.client), so it measures any server
that speaks the API (Baton, vLLM, llama.cpp's server) with nothing of its own in the way.
"""

from __future__ import annotations

import http.client
import json
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from serve_app.ops.bench.workload import BenchRequest


@dataclass
class RequestResult:
    """What one request took: `itl` holds the gaps between its content chunks as the
    client saw them (a server that sends several tokens a message shows fewer, longer
    gaps; `tpot`, the mean time per output token after the first, does not depend on it)."""

    ok: bool
    start: float
    end: float = 0.0
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str = ""

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


class Endpoint:
    """The completions URL of a server, with its model and key."""

    def __init__(self, base_url: str, model: str | None, api_key: str | None, timeout_s: float):
        parts = urlsplit(base_url.rstrip("/"))
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(
                f"--base-url {base_url!r}: give the API's root, e.g. http://localhost:8000/v1"
            )
        self.parts, self.api_key, self.timeout_s = parts, api_key, timeout_s
        self.model = model or self._first_model()

    def _connection(self) -> http.client.HTTPConnection:
        cls = (
            http.client.HTTPSConnection
            if self.parts.scheme == "https"
            else http.client.HTTPConnection
        )
        return cls(self.parts.netloc, timeout=self.timeout_s)

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers

    def _first_model(self) -> str:
        conn = self._connection()
        try:
            conn.request("GET", f"{self.parts.path}/models", headers=self._headers())
            reply = conn.getresponse()
            body = reply.read()
            if reply.status != 200:
                raise ValueError(
                    f"GET {self.parts.path}/models answered {reply.status}: "
                    f"{body[:200].decode(errors='replace')}; pass --model"
                )
            return json.loads(body)["data"][0]["id"]
        except OSError as e:
            raise ValueError(f"cannot reach {self.parts.netloc}: {e}") from None
        finally:
            conn.close()

    def complete(self, request: BenchRequest) -> RequestResult:
        """Streams one completion of exactly `max_tokens` tokens (ignore_eos, as vLLM's
        benchmark asks; servers without it stop at EOS and report fewer)."""
        body = {
            "model": self.model,
            "prompt": request.prompt,
            "max_tokens": request.max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
        }
        result = RequestResult(ok=False, start=time.perf_counter())
        conn = self._connection()
        try:
            conn.request(
                "POST", f"{self.parts.path}/completions", json.dumps(body), self._headers()
            )
            reply = conn.getresponse()
            if reply.status != 200:
                result.error = f"HTTP {reply.status}: {reply.read()[:200].decode(errors='replace')}"
                return result
            self._read_events(reply, result)
        except (OSError, http.client.HTTPException, ValueError) as e:
            result.error = f"{type(e).__name__}: {e}"
        finally:
            result.end = time.perf_counter()
            conn.close()
        return result

    @staticmethod
    def _read_events(reply: http.client.HTTPResponse, result: RequestResult) -> None:
        last = result.start
        chunks = 0
        while line := reply.readline():
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                result.ok = True
                break
            event = json.loads(data)
            if "error" in event:
                result.error = str(event["error"])[:200]
                return
            usage = event.get("usage")
            if usage:
                result.prompt_tokens = usage.get("prompt_tokens", 0)
                result.output_tokens = usage.get("completion_tokens", 0)
            if not any(c.get("text") for c in event.get("choices", [])):
                continue
            now = time.perf_counter()
            chunks += 1
            if result.ttft is None:
                result.ttft = now - result.start
            else:
                result.itl.append(now - last)
            last = now
        if not result.ok:
            result.error = "the stream was cut before [DONE]"
            return
        if not result.output_tokens:
            result.output_tokens = chunks  # a server that sends no usage: one token a chunk
        if result.ttft is None:
            result.ok, result.error = False, "the stream ended without a token"
