"""The service end to end: real Ray, real Serve proxies, the real SmolLM2 model.

Two applications share one Serve instance: "disagg" (prefill TP 3 -> decode TP 1, so
KV heads are re-split on every handoff; KV over nixl) and "agg" (one
aggregated pool). Clients are the ones users run: grpcio stubs through Serve's gRPC
proxy and the `openai` library through Serve's HTTP proxy. The last test checks that
every request of the module, cancelled ones included, gave all its KV blocks back on
every pool.

The service is conftest.py's module-scoped `service` fixture (with its `disagg` and `agg`
clients): one deployment for all of this module's tests, which run in file order and rely
on it (the last test sees every request of the module).
"""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.error
import urllib.request

import grpc
import openai
import pytest
import ray
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from ray import serve
from service_helpers import (
    KV,
    MAX_TOKENS,
    PROMPTS,
    _decode_stats,
    _greedy,
    _holds,
    _scrape,
    _snapshots,
    _wait_idle,
    _wait_prefill_exports_freed,
    _wait_until_known,
    baton,
    wait_for,
)

from serve_app import service_ops
from serve_app.client import BatonClient, generate_request
from serve_app.config import AppConfig, PoolConfig
from serve_app.grpc_api import baton_pb2 as pb
from serve_app.prefix_registry import REGISTRY_NAMESPACE, app_registry_name
from serve_app.prompts import ModelFrontend, PromptInput
from workers.engine.config import EngineConfig
from workers.engine.engine import LLMEngine
from workers.engine.sampling_params import SamplingParams
from workers.engine.sequence import FinishReason
from workers.model.loader import model_identity

pytestmark = pytest.mark.slow


def test_greedy_output_is_identical_in_process_aggregated_and_disaggregated(
    disagg, agg, smollm2_dir
):
    engine = LLMEngine(EngineConfig(model=str(smollm2_dir), kv_cache_bytes=KV))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    drafts_before = _decode_stats()["engine"]["num_accepted_draft_tokens"]
    expected = engine.generate([engine.tokenizer.encode(p) for p in PROMPTS], params)
    for prompt, seq in zip(PROMPTS, expected, strict=True):
        want, want_text = seq.output_token_ids, seq.detokenizer.text
        agg_unary = agg.generate_unary(_greedy(prompt))
        assert (list(agg_unary.token_ids), agg_unary.text) == (want, want_text), prompt
        unary = disagg.generate_unary(_greedy(prompt))
        assert (list(unary.token_ids), unary.text) == (want, want_text), prompt
        streamed = list(disagg.generate(_greedy(prompt)))
        assert [t for m in streamed for t in m.token_ids] == want
        assert "".join(m.text for m in streamed) == want_text
        last = streamed[-1]
        assert last.finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH)
        assert last.usage.completion_tokens == len(want)
        assert last.usage.prompt_tokens == len(engine.tokenizer.encode(prompt))
    # The decode pool speculates (conftest): its drafts were checked and some taken.
    assert _decode_stats()["engine"]["num_accepted_draft_tokens"] > drafts_before

    # A stop string (applied by the router, not the engines) cuts the output where the
    # in-process engine does: the same tokens, text and usage.
    prompt, text = PROMPTS[0], expected[0].detokenizer.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    (seq,) = engine.generate(
        [engine.tokenizer.encode(prompt)], SamplingParams(**{**vars(params), "stop": [stop]})
    )
    assert seq.finish_reason is FinishReason.STOP and len(seq.output_token_ids) < MAX_TOKENS
    for client in (agg, disagg):
        streamed = list(client.generate(_greedy(prompt, stop=[stop])))
        assert [t for m in streamed for t in m.token_ids] == seq.output_token_ids
        assert "".join(m.text for m in streamed) == seq.detokenizer.text
        assert streamed[-1].finish_reason == pb.FINISH_REASON_STOP
        assert streamed[-1].usage.completion_tokens == len(seq.output_token_ids)

    # The agg app streams with stream_interval 3: messages of at least 3 tokens between
    # the first and the last. (Its first message holds more than the first token if the
    # replica fell behind the engine; test_async_engine_streams checks that rule alone.)
    sizes = [len(m.token_ids) for m in agg.generate(_greedy(PROMPTS[1]))]
    assert all(n >= 3 for n in sizes[1:-1]), sizes
    assert len(sizes) < len(expected[1].output_token_ids)


def test_the_object_store_fallback_gives_the_same_output(service, disagg, smollm2_dir, serve_ports):
    # Its own app, deleted at the end so the later tests share the machine with two only.
    config = AppConfig(
        mode="disaggregated",
        transport="object_store",
        prefill=PoolConfig(tensor_parallel_size=3, kv_cache_bytes=KV),
        decode=PoolConfig(kv_cache_bytes=KV),
    )
    service_ops.deploy(config, app_name="disagg_os", route_prefix="/disagg_os", **serve_ports)
    try:
        engine = LLMEngine(EngineConfig(model=str(smollm2_dir), kv_cache_bytes=KV))
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
        prompts = PROMPTS[:3]
        expected = engine.generate([engine.tokenizer.encode(p) for p in prompts], params)
        before = _decode_stats("disagg_os")["handoff"]
        with BatonClient(service["grpc"], application="disagg_os") as client:
            for prompt, want in zip(prompts, expected, strict=True):
                got = client.generate_unary(_greedy(prompt))
                assert list(got.token_ids) == want.output_token_ids, prompt
        after = _decode_stats("disagg_os")["handoff"]
        assert after["num_handoffs"] - before["num_handoffs"] == len(prompts)
        assert after["num_direct"] == before["num_direct"] == 0
    finally:
        serve.delete("disagg_os")
    # The main app's transport, nixl, pulls every handoff straight from the prefill ranks.
    before = _decode_stats()["handoff"]
    disagg.generate_unary(_greedy(PROMPTS[3]))
    after = _decode_stats()["handoff"]
    assert (
        after["num_direct"] - before["num_direct"]
        == 1
        == after["num_handoffs"] - before["num_handoffs"]
    )


def test_chat_and_token_id_prompts_and_tokenize(disagg, agg):
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    chat = disagg.generate_unary(generate_request(messages=messages, max_tokens=8, temperature=0))
    assert chat.text and chat.usage.completion_tokens == len(chat.token_ids)
    ids = agg.tokenize(PROMPTS[0])
    by_ids = agg.generate_unary(_greedy(ids))
    assert by_ids.text == agg.generate_unary(_greedy(PROMPTS[0])).text
    info = disagg.model_info()
    assert info.mode == "disaggregated" and info.prefill_tensor_parallel_size == 3
    assert info.vocab_size == 49152 and info.num_decode_replicas >= 1
    assert info.prefill_dtype == info.decode_dtype == "float32"  # auto, on CPU
    assert agg.model_info().decode_dtype == "float32"
    # A logit bias reaches prefill's first token and every decode step after the handoff.
    forced = disagg.generate_unary(_greedy(PROMPTS[0], max_tokens=5, logit_bias={1000: 100.0}))
    assert list(forced.token_ids) == [1000] * 5


def test_baton_generate_streams_the_services_completion(service, agg, capsys):
    # The README's main job asks the service this way.
    from serve_app.cli import main

    args = ["generate", "--app", "agg", "--address", service["grpc"], "--max-tokens", "8"]
    assert main([*args, PROMPTS[0]]) == 0
    assert capsys.readouterr().out == agg.generate_unary(_greedy(PROMPTS[0], 8)).text + "\n"


def test_health_check_and_server_reflection(service):
    channel = grpc.insecure_channel(service["grpc"])
    health = health_pb2_grpc.HealthStub(channel)
    meta = (("application", "disagg"),)
    for name in ("", "baton.v1.Baton"):
        reply = health.Check(health_pb2.HealthCheckRequest(service=name), metadata=meta)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.RpcError) as err:
        health.Check(health_pb2.HealthCheckRequest(service="nope.Service"), metadata=meta)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    listed = health.List(health_pb2.HealthListRequest(), metadata=meta).statuses
    assert {name: s.status for name, s in listed.items()} == {
        "": health_pb2.HealthCheckResponse.SERVING,
        "baton.v1.Baton": health_pb2.HealthCheckResponse.SERVING,
    }
    # Bytes that are no HealthCheckRequest (invalid UTF-8 in its service name).
    for method, call in (("Check", "unary_unary"), ("Watch", "unary_stream")):
        send = getattr(channel, call)(f"/grpc.health.v1.Health/{method}")
        with pytest.raises(grpc.RpcError) as err:
            reply = send(b"\x0a\x02\xff\xfe", metadata=meta, timeout=30)  # unary: raises
            next(reply)  # a stream raises at its first message
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
        assert "not a valid grpc.health.v1.HealthCheckRequest" in err.value.details()

    # With one application (`baton serve`'s case) a call needs no metadata; here two share
    # the ingress, which routes every call, reflection's too, by its `application`.
    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    asks = [
        reflection_pb2.ServerReflectionRequest(list_services=""),
        reflection_pb2.ServerReflectionRequest(file_containing_symbol="baton.v1.Baton"),
    ]
    listed, described = list(reflection.ServerReflectionInfo(iter(asks), metadata=meta))
    names = {s.name for s in listed.list_services_response.service}
    assert {"baton.v1.Baton", "grpc.health.v1.Health"} <= names
    assert described.file_descriptor_response.file_descriptor_proto
    channel.close()


def test_openai_client_completions_and_chat(service, agg):
    for app in ("agg", "disagg"):
        client = openai.OpenAI(base_url=f"{service['http']}/{app}/v1", api_key="unused")
        (model,) = [m.id for m in client.models.list()]
        done = client.completions.create(
            model=model, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0
        )
        assert done.choices[0].text == agg.generate_unary(_greedy(PROMPTS[0])).text
        assert done.usage.completion_tokens == MAX_TOKENS
        chunks = client.completions.create(
            model=model, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0, stream=True
        )
        assert "".join(c.choices[0].text for c in chunks) == done.choices[0].text

        messages = [{"role": "user", "content": "Name a color."}]
        chat = client.chat.completions.create(
            model=model, messages=messages, max_tokens=12, temperature=0
        )
        assert chat.choices[0].message.role == "assistant"
        stream = client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        parts = list(stream)
        text = "".join(p.choices[0].delta.content or "" for p in parts if p.choices)
        assert text == chat.choices[0].message.content
        assert parts[-1].usage.completion_tokens == chat.usage.completion_tokens

    # n choices: seeded, choice i is what a lone request seeded seed + i gets.
    seeded = {"model": model, "prompt": PROMPTS[1], "max_tokens": 8, "seed": 5}
    two = client.completions.create(n=2, **seeded)
    assert [c.index for c in two.choices] == [0, 1] and two.usage.completion_tokens == 16
    alone = [client.completions.create(**{**seeded, "seed": 5 + i}) for i in range(2)]
    assert [c.text for c in two.choices] == [a.choices[0].text for a in alone]
    streamed: dict[int, str] = {0: "", 1: ""}
    for chunk in client.completions.create(n=2, stream=True, **seeded):
        streamed[chunk.choices[0].index] += chunk.choices[0].text
    assert list(streamed.values()) == [c.text for c in two.choices]


def test_prompt_logprobs_and_an_echoed_prompt(service, disagg, agg, smollm2_dir):
    # Handed over with the KV from prefill's TP 3 ranks in "disagg", computed in place in
    # "agg": the in-process engine's values either way, the prefix cache not used.
    engine = LLMEngine(EngineConfig(model=str(smollm2_dir), kv_cache_bytes=KV))
    ids = engine.tokenizer.encode(PROMPTS[2])
    engine.add_request("p", ids, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2))
    (want,) = engine.step()
    for client in (disagg, agg, disagg):  # the second "disagg" call finds a cached prefix
        (first, *rest) = client.generate(_greedy(ids, max_tokens=3, prompt_logprobs=2))
        got = first.prompt_logprobs
        assert [lp.token_id for lp in got] == ids[1:] and not any(m.prompt_logprobs for m in rest)
        assert [lp.logprob for lp in got] == pytest.approx(
            [lp.logprob for lp in want.prompt_logprobs], abs=1e-3
        )
        assert [[t.token_id for t in lp.top_logprobs] for lp in got] == [
            [t for t, _ in lp.top] for lp in want.prompt_logprobs
        ]
        # Ranks far down the vocabulary may swap with near-ties in another thread count.
        assert all(
            abs(g.rank - w.rank) <= w.rank // 100
            for g, w in zip(got, want.prompt_logprobs, strict=True)
        ), [(g.rank, w.rank) for g, w in zip(got, want.prompt_logprobs, strict=True)]
        assert rest[-1].usage.cached_prompt_tokens == 0
    # OpenAI's echo: the prompt, then the completion; in logprobs, the prompt's tokens
    # (the first with none) and the completion's.
    client = openai.OpenAI(base_url=f"{service['http']}/agg/v1", api_key="unused")
    (model,) = [m.id for m in client.models.list()]
    args = {"model": model, "prompt": PROMPTS[2], "max_tokens": 2, "temperature": 0}
    (choice,) = client.completions.create(echo=True, logprobs=1, **args).choices
    plain = client.completions.create(**args).choices[0].text
    assert choice.text == PROMPTS[2] + plain
    token_logprobs = choice.logprobs.token_logprobs
    assert len(token_logprobs) == len(ids) + 2 and token_logprobs[0] is None
    assert token_logprobs[1 : len(ids)] == pytest.approx(
        [lp.logprob for lp in want.prompt_logprobs], abs=1e-3
    )
    streamed = client.completions.create(echo=True, stream=True, **args)
    assert "".join(c.choices[0].text for c in streamed) == choice.text
    # max_tokens 0: the prompt alone, scored.
    (alone,) = client.completions.create(echo=True, logprobs=0, **{**args, "max_tokens": 0}).choices
    assert alone.text == PROMPTS[2] and alone.finish_reason == "length"
    assert alone.logprobs.token_logprobs == token_logprobs[: len(ids)]
    # A prompt of token ids echoes as their text.
    by_ids = client.completions.create(echo=True, **{**args, "prompt": ids}).choices[0].text
    assert by_ids == engine.tokenizer.decode(ids, skip_special_tokens=False) + plain
    # vLLM's prompt_logprobs: per prompt token its logprob, rank and alternatives.
    (scored,) = client.completions.create(extra_body={"prompt_logprobs": 2}, **args).choices
    entries = scored.model_extra["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    for token, entry, lp in zip(ids[1:], entries[1:], want.prompt_logprobs, strict=True):
        assert {int(t) for t in entry} == {t for t, _ in lp.top} | {token}
        assert [entry[str(t)]["rank"] for t, _ in lp.top] == [1, 2]
        own = entry[str(token)]
        assert own["logprob"] == pytest.approx(lp.logprob, abs=1e-3)
        assert abs(own["rank"] - lp.rank) <= lp.rank // 100, (own, lp)
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=1,
        extra_body={"prompt_logprobs": 0},
    )
    chat_entries = chat.model_extra["prompt_logprobs"]
    assert chat_entries[0] is None and chat.usage.prompt_tokens == len(chat_entries)
    assert all(len(e) == 1 and next(iter(e.values()))["rank"] >= 1 for e in chat_entries[1:])


def test_sixteen_concurrent_streams_all_complete(disagg):
    # One request first: the router then subscribes to the decode replica's outputs, and
    # the sixteen share that subscription (output_mux.py).
    disagg.generate_unary(_greedy("Warm up", max_tokens=2))
    deadline = time.monotonic() + 10
    while not _decode_stats()["mux"]["open_subscriptions"]:
        assert time.monotonic() < deadline, "the router did not subscribe to decode's outputs"
        time.sleep(0.05)
    before = _decode_stats()["mux"]
    results: dict[int, list] = {}

    def run(i: int) -> None:
        request = generate_request(
            f"Story number {i}: once upon a time", max_tokens=16, temperature=0.8, seed=i
        )
        results[i] = list(disagg.generate(request, timeout=300))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == list(range(16))
    for messages in results.values():
        assert messages[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED
        assert sum(len(m.token_ids) for m in messages) == messages[-1].usage.completion_tokens
    after = _decode_stats()["mux"]
    assert after["num_muxed_requests"] - before["num_muxed_requests"] == 16
    sent = {k: after[k] - before[k] for k in ("num_outputs", "num_batches")}
    assert sent["num_outputs"] > sent["num_batches"]  # several streams' tokens per message


def test_a_prefix_decode_holds_is_not_transferred_again(disagg):
    prompt = "Here is a long shared system preamble for every request. " * 8
    num_tokens = len(disagg.tokenize(prompt))
    full_blocks = num_tokens // 16
    assert full_blocks >= 4
    before = _decode_stats()["handoff"]
    disagg.generate_unary(_greedy(prompt, max_tokens=4))
    middle = _decode_stats()["handoff"]
    disagg.generate_unary(_greedy(prompt, max_tokens=4))
    after = _decode_stats()["handoff"]
    cold = middle["blocks_received"] - before["blocks_received"]
    warm = after["blocks_received"] - middle["blocks_received"]
    assert cold == -(-num_tokens // 16)  # every block of the prompt, partial one included
    assert warm == cold - full_blocks  # decode's own prefix cache covered the full blocks
    assert after["num_bytes"] - middle["num_bytes"] < middle["num_bytes"] - before["num_bytes"]
    # A prompt of whole blocks, every one already held by decode: an empty handoff.
    whole_blocks = disagg.tokenize(prompt)[: 2 * 16]
    assert disagg.generate_unary(_greedy(whole_blocks, max_tokens=4)).usage.completion_tokens
    empty = _decode_stats()["handoff"]
    assert empty["blocks_received"] == after["blocks_received"]
    # A handoff all the same (its first token came from prefill), not a recompute.
    assert empty["num_handoffs"] == after["num_handoffs"] + 1
    assert empty["num_recomputed_tokens"] == after["num_recomputed_tokens"]


def _decode_tokens() -> int:
    return _decode_stats()["engine"]["num_generated_tokens"]


def test_a_grpc_stream_cancelled_mid_stream_stops_generating_and_frees_its_blocks(disagg):
    _wait_idle()
    before = _decode_tokens()
    stream = disagg.generate(_greedy("Count to a thousand:", max_tokens=400, ignore_eos=True))
    for _, _ in zip(range(3), stream, strict=False):
        pass
    stream.cancel()
    _wait_idle()
    # Cancelled, not run to max_tokens: the cancel reached the decode engine.
    assert _decode_tokens() - before < 400


def test_exports_free_at_import_and_cancels_and_deadlines_free_the_blocks(service, disagg):
    _wait_idle()
    before = _decode_tokens()
    # Mid-stream, over HTTP: the openai client closes its SSE stream.
    client = openai.OpenAI(base_url=f"{service['http']}/disagg/v1", api_key="unused")
    (model,) = [m.id for m in client.models.list()]
    stream = client.completions.create(
        model=model,
        prompt="Count to a thousand:",
        max_tokens=400,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},  # still running while the export is checked
    )
    for _, _ in zip(range(3), stream, strict=False):
        pass
    # Imported, so the prefill ranks have freed the export though the request goes on.
    _wait_prefill_exports_freed()
    stream.close()
    _wait_idle()
    assert _decode_tokens() - before < 400  # the close reached the decode engine
    before = _decode_tokens()
    with pytest.raises(grpc.RpcError) as err:
        long = _greedy("Tell me a long story.", max_tokens=400, ignore_eos=True)
        disagg.generate_unary(long, timeout=1.5)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    _wait_idle()
    assert _decode_tokens() - before < 400  # so did the deadline


BAD_GRPC = [
    ({"temperature": -1.0}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"logprobs": 99}, "logprobs"),
    ({"stop_token_ids": [10**6]}, "stop_token_ids"),
    ({"max_tokens": 100_000}, "max_tokens"),
    ({"stop": [""]}, "stop"),
]


@pytest.mark.parametrize(("fields", "named"), BAD_GRPC)
def test_bad_grpc_input_is_invalid_argument_naming_the_field(disagg, fields, named):
    with pytest.raises(grpc.RpcError) as err:
        disagg.generate_unary(generate_request("Hello", **fields))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert named in err.value.details() and "Traceback" not in err.value.details()
    assert disagg.generate_unary(_greedy("Hello", max_tokens=2)).usage.completion_tokens == 2


def test_bad_grpc_prompts(disagg):
    for request in (pb.GenerateRequest(), generate_request([49152]), generate_request([])):
        with pytest.raises(grpc.RpcError) as err:
            disagg.generate_unary(request)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "prompt" in err.value.details()
    # Bytes that are no GenerateRequest (invalid UTF-8 in its text), streamed or not.
    for method, call in (("GenerateUnary", "unary_unary"), ("Generate", "unary_stream")):
        send = getattr(disagg.channel, call)(f"/baton.v1.Baton/{method}")
        with pytest.raises(grpc.RpcError) as err:
            reply = send(b"\x12\x02\xff\xfe", metadata=disagg.metadata, timeout=30)
            list(reply)  # a unary call raised above already
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
        assert "not a valid baton.v1.GenerateRequest" in err.value.details()
    assert disagg.generate_unary(_greedy("Hello", max_tokens=2)).usage.completion_tokens == 2


def test_bad_http_input_is_400_naming_the_field(service):
    client = openai.OpenAI(base_url=f"{service['http']}/agg/v1", api_key="unused")
    (model,) = [m.id for m in client.models.list()]
    for kwargs, named in [
        ({"temperature": -2}, "temperature"),
        ({"top_p": 7}, "top_p"),
        ({"max_tokens": 10**6}, "max_tokens"),
        ({"n": 17}, "n"),
        ({"extra_body": {"top_k": -2}}, "top_k"),
        ({"extra_body": {"use_beam_search": True}}, "use_beam_search"),
    ]:
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=model, prompt="Hi", **kwargs)
        assert named in err.value.message and err.value.param == named
    body = f'{{"model": "{model}", "prompt": "Hi \\ud800"}}'  # JSON's lone surrogate
    post = urllib.request.Request(f"{service['http']}/agg/v1/completions", body.encode())
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(post, timeout=30)
    assert refused.value.code == 400
    assert json.loads(refused.value.read())["error"]["param"] == "prompt"
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="no-such-model", prompt="Hi")
    assert err.value.code == "model_not_found"
    # Past the context: OpenAI's code, and the fields this client sent (chat names its
    # prompt `messages`), which clients read to trim the conversation.
    for words, kwargs, named in [
        (1200, {}, "messages"),
        (500, {"max_completion_tokens": 1000}, "max_completion_tokens"),
    ]:
        chat = [{"role": "user", "content": "word " * words}]
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=model, messages=chat, **kwargs)
        assert err.value.code == "context_length_exceeded" and err.value.param == named
        assert "maximum context length is 1088 tokens" in err.value.message
    # The KV cache's 68 blocks of 16 tokens (48 MiB at 46080 bytes a token), not SmolLM2's
    # 8192: what any request within it can run in.
    assert client.models.retrieve(model).max_model_len == 1088
    ok = client.completions.create(model=model, prompt="Hi", max_tokens=2)
    assert ok.usage.completion_tokens == 2


def test_scaling_prefill_during_traffic_fails_nothing_and_the_new_replica_serves(disagg):
    errors: list[BaseException] = []
    done = threading.Event()

    def traffic(i: int) -> None:
        n = 0
        while not done.is_set():
            try:
                out = disagg.generate_unary(
                    generate_request(f"Request {i}.{n}: say something", max_tokens=6, seed=n),
                    timeout=120,
                )
                assert out.usage.completion_tokens >= 1
            except BaseException as e:  # noqa: BLE001 - every failure is the finding
                errors.append(e)
            n += 1

    threads = [threading.Thread(target=traffic, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()

    def prefill_replicas() -> list[dict]:
        return [s for s in _snapshots() if (s["app"], s["role"]) == ("disagg", "prefill")]

    try:
        scaled = baton("scale", "prefill", "2", "--app", "disagg")
        assert scaled.returncode == 0, scaled.stderr
        assert "prefill pool scaled to 2 replicas" in scaled.stderr
        # Traffic goes on until both replicas have computed some of it.
        wait_for(
            lambda: [s["engine"]["num_steps"] > 0 for s in prefill_replicas()] == [True] * 2,
            "the new prefill replica to serve",
            timeout_s=60,
        )
    finally:
        done.set()
        for t in threads:
            t.join()
    assert not errors, errors[:3]
    assert len(prefill_replicas()) == 2


def test_metrics_reach_rays_prometheus_endpoint(disagg, ray_metrics_port):
    disagg.generate_unary(_greedy("Metrics, please.", max_tokens=4))
    with pytest.raises(grpc.RpcError) as err:  # counted as invalid
        disagg.generate_unary(generate_request("Metrics, please.", temperature=-1.0))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    wanted = {
        "ray_baton_time_to_first_token_seconds_count",
        "ray_baton_inter_token_latency_seconds_count",
        "ray_baton_requests_total",
        "ray_baton_running_requests",
        "ray_baton_waiting_requests",
        "ray_baton_kv_cache_usage_ratio",
        "ray_baton_prefix_cache_hit_rate",
        "ray_baton_kv_handoff_bytes_total",
        "ray_baton_kv_handoff_seconds_count",
        "ray_baton_speculative_acceptance_ratio",  # the decode pool speculates (conftest)
    }
    samples: dict = {}

    def total(name: str, label: str = "") -> float:
        # This app's series only: earlier modules' apps record the same names in this Ray.
        ours = [(labels, v) for labels, v in samples.get(name, []) if 'app="disagg"' in labels]
        return sum(v for labels, v in ours if label in labels)

    def exported() -> bool:  # this test's own requests, whatever ran before it
        return (
            wanted <= set(samples)
            and total("ray_baton_requests_total", 'status="ok"') >= 1
            and total("ray_baton_requests_total", 'status="invalid"') >= 1
        )

    deadline = time.monotonic() + 60  # Ray exports on an interval
    while not exported():
        assert time.monotonic() < deadline, f"missing: {sorted(wanted - set(samples))}"
        time.sleep(2)
        samples = _scrape(ray_metrics_port)
    assert total("ray_baton_time_to_first_token_seconds_count") >= 1
    assert total("ray_baton_kv_handoff_bytes_total") > 0
    # Every handoff of this module succeeded: nothing was silently recomputed.
    recomputed = total("ray_baton_handoff_recomputed_prompt_tokens_total")
    assert recomputed == 0, _decode_stats()["handoff"]["last_failure"]
    for name in (
        "ray_baton_kv_cache_usage_ratio",
        "ray_baton_prefix_cache_hit_rate",
        "ray_baton_speculative_acceptance_ratio",
    ):
        assert all(0.0 <= v <= 1.0 for _, v in samples[name]), samples[name]
    assert any('pool="decode"' in labels for labels, _ in samples["ray_baton_running_requests"])


def test_status_shows_each_replicas_role_dtype_and_tp(service):
    shown = baton("status", "--app", "disagg")
    assert shown.returncode == 0, shown.stderr
    text = shown.stdout
    assert "application disagg: RUNNING" in text
    assert re.search(r"^  prefill +\S+ +float32 tp3 ", text, re.MULTILINE), text
    assert re.search(r"^  decode +\S+ +float32 tp1 ", text, re.MULTILINE), text
    assert "aggregated" not in text  # the other application's replica


def _registry(app: str = "disagg"):
    """The application's own prefix registry (neither application names one)."""
    return ray.get_actor(app_registry_name(app), namespace=REGISTRY_NAMESPACE)


def _cached_prompt_hashes(disagg, model_dir, text: str) -> list:
    """The block hashes of a prompt the replicas have just cached, once the registry holds
    them."""
    disagg.generate_unary(_greedy(text, max_tokens=2))
    frontend = ModelFrontend(model_dir, model_identity(model_dir), 16, 1088)
    ids = frontend.tokenize(PromptInput(text=text))
    hashes = frontend.build_request("q", ids, SamplingParams(max_tokens=1), None).block_hashes
    _wait_until_known(_registry(), hashes, "the registry never heard of a cached prompt")
    return hashes


def _wait_until_told_again(disagg, hashes, prompt: str) -> None:
    """Until the registry (a new or restarted one) holds `hashes` again: replicas resend
    their cache with an engine step, so they are given steps to take."""
    deadline = time.monotonic() + 30
    while True:
        registry = _registry()
        try:
            if _holds(registry, hashes):
                return
        except ray.exceptions.ActorUnavailableError:  # while Ray restarts it
            pass
        assert time.monotonic() < deadline, "the registry never heard of the earlier prompt"
        disagg.generate_unary(_greedy(f"{prompt} Again at {time.monotonic()}.", max_tokens=2))
        time.sleep(1)


def test_each_application_routes_by_a_prefix_registry_of_its_own(disagg, smollm2_dir):
    """Two applications on one cluster: "agg" never hears of "disagg"'s replicas or
    blocks (their ids would mean nothing to its request router)."""
    text = "A prompt only the disaggregated application caches. " * 4
    hashes = _cached_prompt_hashes(disagg, smollm2_dir, text)
    own = ray.get(_registry("disagg").longest_prefixes.remote(hashes))
    other = ray.get(_registry("agg").longest_prefixes.remote(hashes))
    assert own and not set(own) & set(other), (own, other)
    assert len(hashes) not in other.values()


def test_losing_the_prefix_registry_costs_routing_hints_not_requests(disagg, smollm2_dir):
    earlier = "A prompt the replicas cache before their prefix registry is lost. " * 4
    hashes = _cached_prompt_hashes(disagg, smollm2_dir, earlier)
    ray.kill(_registry())
    prompt = "A prompt long enough to be hashed and looked up in the registry. " * 4
    assert disagg.generate_unary(_greedy(prompt, max_tokens=4)).usage.completion_tokens == 4
    # The router started a new registry; the replicas, finding theirs gone, publish to it
    # all they hold, the prompt cached before the loss among it.
    _wait_until_told_again(disagg, hashes, prompt)


def test_a_registry_restarted_empty_hears_every_replicas_cache_again(disagg, smollm2_dir):
    """Ray restarts the registry (its node went): calls to it go on succeeding, and the
    replicas learn it forgot them from the new session their next publish returns."""
    earlier = "A prompt the replicas cache before their prefix registry restarts. " * 4
    hashes = _cached_prompt_hashes(disagg, smollm2_dir, earlier)
    ray.kill(_registry(), no_restart=False)
    _wait_until_told_again(disagg, hashes, "Another prompt, to give the replicas steps. " * 4)


def test_every_pool_gets_all_its_blocks_back(service):
    """Last: after every request of the module, cancelled and refused ones too."""
    snaps = _wait_idle()
    assert {s["role"] for s in snaps} == {"prefill", "decode", "aggregated"}
    assert {s["dtype"] for s in snaps} == {"float32"}  # auto, on CPU
    assert {(s["role"], s["tensor_parallel_size"]) for s in snaps if s["app"] == "disagg"} == {
        ("prefill", 3),
        ("decode", 1),
    }
