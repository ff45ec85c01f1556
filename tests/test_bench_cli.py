"""`baton bench`: its figures from known timings, its SSE client against a small
OpenAI-style server (a vLLM- or llama.cpp-like stream: usage in the last chunk, or none),
and its workloads. A live run against Baton is in test_service_bench.py."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from serve_app.ops.bench import report, workload
from serve_app.ops.bench.stream_client import Endpoint, RequestResult
from serve_app.ops.bench.workload import BenchRequest


def _result(ttft: float, e2e: float, tokens: int, ok: bool = True) -> RequestResult:
    gaps = [(e2e - ttft) / (tokens - 1)] * (tokens - 1)
    return RequestResult(ok, 0.0, e2e, ttft, gaps, 10, tokens, "" if ok else "HTTP 503")


def test_summary_counts_percentiles_and_goodput():
    results = [_result(0.1 * (i + 1), 1.0 + 0.1 * i, 11) for i in range(10)]
    results.append(_result(0, 0, 0, ok=False))
    row = report.summarize(results, 2.0, {"concurrency": 4}, ttft_slo_s=0.5, tpot_slo_s=None)
    assert (row["requests_sent"], row["requests_completed"], row["requests_failed"]) == (11, 10, 1)
    assert row["requests_sent"] == row["requests_completed"] + row["requests_failed"]
    assert row["request_throughput"] == 5.0
    assert row["output_token_throughput"] == 110 / 2.0
    assert row["ttft_p50_ms"] == pytest.approx(550.0)
    assert row["ttft_p99_ms"] == pytest.approx(991.0)
    assert row["e2e_p50_ms"] == pytest.approx(1450.0)
    # TPOT of request i: (1.0 + 0.1 i - 0.1 (i + 1)) / 10 = 90 ms for every one.
    assert row["tpot_p50_ms"] == pytest.approx(90.0)
    assert row["goodput"] == 5 / 2.0  # TTFT <= 0.5 s: the first five
    assert row["errors"] == ["HTTP 503"]
    text = report.table([row])
    assert "c=4" in text.splitlines()[1] and "TTFT p99" in text.splitlines()[0]


class _Server(BaseHTTPRequestHandler):
    """/v1/models and a streamed /v1/completions: `usage` in the last chunk unless the
    prompt says "no usage"; "fail" answers 400 in OpenAI's error shape; "cut" ends the
    stream before its usage and [DONE]."""

    def log_message(self, *args):
        pass

    def do_GET(self):
        self._send(200, {"data": [{"id": "fake-model"}]})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if body["prompt"] == "fail":
            self._send(400, {"error": {"message": "bad", "type": "invalid_request_error"}})
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        n = body["max_tokens"]
        for i in range(n):
            chunk = {"choices": [{"index": 0, "text": f" t{i}"}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
        if body["prompt"] == "cut":
            return  # as a server that dies mid-stream: no usage, no [DONE]
        if body["prompt"] != "no usage":
            usage = {"prompt_tokens": 3, "completion_tokens": n}
            self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")

    def _send(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture(scope="module")
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Server)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    httpd.shutdown()


def test_the_client_times_a_stream_and_reads_its_usage(server):
    endpoint = Endpoint(server, None, None, 10.0)
    assert endpoint.model == "fake-model"  # the first of /v1/models
    result = endpoint.complete(BenchRequest("hello", 5))
    assert result.ok and result.error == ""
    assert (result.prompt_tokens, result.output_tokens) == (3, 5)
    assert result.ttft is not None and len(result.itl) == 4
    assert result.e2e >= result.ttft
    bare = endpoint.complete(BenchRequest("no usage", 4))
    assert bare.ok and bare.output_tokens == 4  # one token a chunk
    failed = endpoint.complete(BenchRequest("fail", 4))
    assert not failed.ok and failed.error.startswith("HTTP 400")
    cut = endpoint.complete(BenchRequest("cut", 4))
    assert not cut.ok and cut.error == "the stream was cut before [DONE]"


def test_a_bench_run_writes_json_lines_a_table_and_a_plot(server, tmp_path, capsys):
    from serve_app.ops.cli import main

    png = tmp_path / "sweep.png"
    args = ["bench", "--base-url", server, "--num-prompts", "6", "--output-len", "3"]
    assert main([*args, "--concurrency", "1,3", "--plot", str(png), "--no-progress"]) == 0
    out, err = capsys.readouterr()
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["concurrency"] for r in rows] == [1, 3]
    assert all(r["requests_completed"] == 6 and r["output_tokens"] == 18 for r in rows)
    assert "c=3" in err and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main([*args, "--request-rate", "50", "--no-progress"]) == 0
    (row,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert row["request_rate"] == 50 and row["requests_sent"] == 6


def test_workloads_are_distinct_and_a_bad_dataset_names_its_line(tmp_path):
    prompts = workload.synthetic(4, 12, 5, seed=1)
    assert len({p.prompt.split()[0] for p in prompts}) == 4
    assert all(len(p.prompt.split()) == 12 and p.max_tokens == 5 for p in prompts)
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "a", "max_tokens": 3}\n\n{"prompt": "b"}\n{"text": "c"}\n')
    with pytest.raises(ValueError, match=r"prompts.jsonl:4: each line must be"):
        workload.from_jsonl(data, 7, None)
    assert workload.from_jsonl(data, 7, 2) == [BenchRequest("a", 3), BenchRequest("b", 7)]
    with pytest.raises(ValueError, match="--input-len"):
        workload.synthetic(4, 0, 5, seed=1)
