"""The service end to end: real Ray, Serve's ingress, the real SmolLM2 model.

Two applications share one Serve instance: "disagg" (prefill TP 3 -> decode TP 1, so
KV heads are re-split on every handoff; KV over nixl) and "agg" (one
aggregated pool). Clients are the ones users run: grpcio stubs and the `openai` library.
This module checks what the APIs answer (the same tokens as the in-process engine, chat,
health and reflection, logprobs, 400s naming the field); test_service_lifecycle.py puts
"disagg" alone under load and faults. The last test checks that every request of the
module gave all its KV blocks back on every pool.

The service is conftest.py's module-scoped `service` fixture (with its `disagg` and `agg`
clients): one deployment for all of this module's tests, which run in file order and rely
on it (the last test sees every request of the module).
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from typing import Annotated

import grpc
import jsonschema
import openai
import pydantic
import pytest
import ray
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from ray import serve
from service_helpers import (
    KV,
    MAX_TOKENS,
    PROMPTS,
    _cached_prompt_hashes,
    _decode_stats,
    _greedy,
    _registry,
    _wait_idle,
    baton,
)

from serve_app.config import AppConfig, PoolConfig
from serve_app.grpc.api import baton_pb2 as pb
from serve_app.ops import service_ops
from serve_app.ops.client import BatonClient, generate_request
from workers.engine import StructuredOutput
from workers.engine.config import EngineConfig
from workers.engine.llm_engine import LLMEngine
from workers.engine.sampling_params import SamplingParams
from workers.engine.sequence import FinishReason

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
    # Prefill TP 1: "disagg" covers the re-split of KV heads between TP degrees.
    config = AppConfig(
        mode="disaggregated",
        transport="object_store",
        prefill=PoolConfig(kv_cache_bytes=KV),
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
    from serve_app.ops.cli import main

    args = ["generate", "--app", "agg", "--address", service["grpc"], "--max-tokens", "8"]
    assert main([*args, PROMPTS[0]]) == 0
    assert capsys.readouterr().out == agg.generate_unary(_greedy(PROMPTS[0], 8)).text + "\n"
    # --model without --local names the model expected to be served: checked, not switched.
    served = agg.model_info().model_id
    assert main([*args, "--model", served.upper(), PROMPTS[0]]) == 0
    assert main([*args, "--model", "gemma3-270m", PROMPTS[0]]) == 2
    assert f"serves {served!r}" in capsys.readouterr().err


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


def test_status_shows_each_replicas_role_dtype_and_tp(service):
    shown = baton("status", "--app", "disagg")
    assert shown.returncode == 0, shown.stderr
    text = shown.stdout
    assert "application disagg: RUNNING" in text
    assert re.search(r"^  prefill +\S+ +float32 tp3 ", text, re.MULTILINE), text
    assert re.search(r"^  decode +\S+ +float32 tp1 ", text, re.MULTILINE), text
    assert "aggregated" not in text  # the other application's replica


def test_each_application_routes_by_a_prefix_registry_of_its_own(disagg, smollm2_dir):
    """Two applications on one cluster: "agg" never hears of "disagg"'s replicas or
    blocks (their ids would mean nothing to its request router)."""
    text = "A prompt only the disaggregated application caches. " * 4
    hashes = _cached_prompt_hashes(disagg, smollm2_dir, text)
    own = ray.get(_registry("disagg").longest_prefixes.remote(hashes))
    other = ray.get(_registry("agg").longest_prefixes.remote(hashes))
    assert own and not set(own) & set(other), (own, other)
    assert len(hashes) not in other.values()


class _Person(pydantic.BaseModel):
    """What an extraction pipeline asks for: bounded fields, so that every sample ends
    within its budget and validity rests on the grammar alone. The strings hold at most
    120 characters; at up to 6 byte tokens a character (a JSON escape) and some 30
    tokens of structure, every sample ends inside `_PERSON_TOKENS`."""

    name: str = pydantic.Field(max_length=30)
    age: int = pydantic.Field(ge=0, le=120)
    city: str = pydantic.Field(max_length=30)
    hobbies: list[Annotated[str, pydantic.Field(max_length=20)]] = pydantic.Field(max_length=3)


_PERSON_TOKENS = 768


_TOPICS = [
    "a pirate", "a chef in Paris", "a retired teacher", "an astronaut", "a child who loves dogs",
    "a jazz musician", "a farmer", "a software engineer", "a marathon runner", "a painter",
    "a librarian", "a doctor in Tokyo", "a student", "a baker", "a sailor", "a gardener",
    "a poet", "a pilot", "a nurse", "a carpenter",
]  # fmt: skip


def _langchain_model(
    service, app: str, temperature: float, max_tokens: int, seed: int | None = None
):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        base_url=f"{service['http']}/{app}/v1",
        api_key="unused",
        model="SmolLM2-135M-Instruct",
        temperature=temperature,
        max_tokens=max_tokens,
        seed=seed,
    )


def _person_prompt(topic: str) -> str:
    return f"Invent {topic}. Give their name, age, city and hobbies."


def test_langchain_and_the_openai_sdk_get_schema_valid_output_at_temperature_1(service):
    schema = _Person.model_json_schema()
    llm = _langchain_model(service, "disagg", temperature=1.0, max_tokens=_PERSON_TOKENS)
    people = llm.with_structured_output(_Person).batch(
        [_person_prompt(t) for t in _TOPICS], config={"max_concurrency": 8}
    )
    assert len(people) == 20 and all(isinstance(p, _Person) for p in people)
    for person in people:
        jsonschema.validate(person.model_dump(), schema)
    assert len({p.name for p in people}) > 10  # sampled, not one answer

    client = openai.OpenAI(base_url=f"{service['http']}/agg/v1", api_key="unused")
    for topic in _TOPICS[:4]:
        done = client.chat.completions.parse(
            model="SmolLM2-135M-Instruct",
            messages=[{"role": "user", "content": _person_prompt(topic)}],
            response_format=_Person,
            temperature=1.0,
            max_tokens=_PERSON_TOKENS,
        )
        assert isinstance(done.choices[0].message.parsed, _Person)
        assert done.choices[0].finish_reason == "stop"


def test_regex_and_choice_constraints_hold_on_every_sample(service):
    client = openai.OpenAI(base_url=f"{service['http']}/agg/v1", api_key="unused")
    for constraint, check in [
        ({"regex": r"[A-Z][a-z]{2,8} [0-9]{2}"}, re.compile(r"[A-Z][a-z]{2,8} [0-9]{2}").fullmatch),
        ({"choice": ["red", "green", "blue"]}, {"red", "green", "blue"}.__contains__),
    ]:
        done = client.completions.create(
            model="SmolLM2-135M-Instruct",
            prompt="My favourite colour is",
            n=8,
            temperature=1.0,
            max_tokens=20,
            extra_body={"structured_outputs": constraint},
        )
        texts = [c.text for c in done.choices]
        assert all(check(t) for t in texts), texts
        assert all(c.finish_reason == "stop" for c in done.choices)


def test_constrained_greedy_output_is_identical_aggregated_and_disaggregated(
    service, disagg, agg, smollm2_dir
):
    schema = json.dumps(_Person.model_json_schema())
    engine = LLMEngine(EngineConfig(model=str(smollm2_dir), kv_cache_bytes=KV))
    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": _person_prompt("a poet")}])
    params = SamplingParams(
        max_tokens=120, temperature=0.0, structured=StructuredOutput.json_schema(schema)
    )
    (expected,) = engine.generate([prompt], params)
    request = generate_request(prompt, max_tokens=120, temperature=0.0)
    request.structured_output.json_schema = schema
    texts = {
        name: client.generate_unary(request).text
        for name, client in [("disagg", disagg), ("agg", agg)]
    }
    assert texts["disagg"] == texts["agg"] == engine.tokenizer.decode(expected.output_token_ids)
    _Person.model_validate_json(texts["agg"])
    # Streamed, the same text; unconstrained requests alongside are unchanged.
    client = openai.OpenAI(base_url=f"{service['http']}/disagg/v1", api_key="unused")
    body = {
        "model": "SmolLM2-135M-Instruct",
        "messages": [{"role": "user", "content": _person_prompt("a poet")}],
        "max_tokens": 120,
        "temperature": 0,
        "extra_body": {"guided_json": json.loads(schema)},
    }
    chunks = client.chat.completions.create(stream=True, **body)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == texts["agg"]


_WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather forecast for a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}


def test_bound_tools_with_a_required_choice_give_calls_whose_arguments_validate(service):
    from langchain_core.messages import ToolMessage

    # Seeded: an unseeded sample at temperature 1 may spend the token budget inside the
    # call (a long city name) and leave no complete call to parse.
    llm = _langchain_model(service, "disagg", temperature=1.0, max_tokens=120, seed=11).bind_tools(
        [_WEATHER], tool_choice="required", parallel_tool_calls=False
    )
    questions = [f"What is the weather in {c}?" for c in ("Paris", "Lima", "Oslo", "Cairo")]
    replies = llm.batch(questions, config={"max_concurrency": 4})
    for reply in replies:
        (call,) = reply.tool_calls
        assert call["name"] == "get_weather"
        jsonschema.validate(call["args"], _WEATHER["function"]["parameters"])
    # The calls and their results go back in the history; the model answers in text.
    answer = _langchain_model(service, "agg", temperature=0.0, max_tokens=24).invoke(
        [
            ("user", questions[0]),
            replies[0],
            ToolMessage("Sunny, 21 degrees", tool_call_id=replies[0].tool_calls[0]["id"]),
        ]
    )
    assert isinstance(answer.content, str) and answer.content


def test_streamed_tool_call_deltas_reassemble_to_the_unstreamed_call(service):
    for app in ("agg", "disagg"):
        client = openai.OpenAI(base_url=f"{service['http']}/{app}/v1", api_key="unused")
        body = {
            "model": "SmolLM2-135M-Instruct",
            "messages": [{"role": "user", "content": "Weather in Rome and in Madrid?"}],
            "tools": [_WEATHER],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "temperature": 0,
            "max_tokens": 120,
        }
        done = client.chat.completions.create(**body)
        calls = [
            (c.function.name, c.function.arguments) for c in done.choices[0].message.tool_calls
        ]
        assert done.choices[0].finish_reason == "tool_calls" and calls
        streamed: dict[int, list[str]] = {}
        finish = None
        for chunk in client.chat.completions.create(stream=True, **body):
            delta = chunk.choices[0].delta
            for call in delta.tool_calls or []:
                name, args = streamed.setdefault(call.index, ["", ""])
                streamed[call.index] = [
                    name + (call.function.name or ""),
                    args + (call.function.arguments or ""),
                ]
            finish = chunk.choices[0].finish_reason or finish
        assert [tuple(streamed[i]) for i in sorted(streamed)] == calls
        assert finish == "tool_calls"
        for _, arguments in calls:
            jsonschema.validate(json.loads(arguments), _WEATHER["function"]["parameters"])


def test_a_bad_schema_or_contradictory_constraints_are_refused_naming_the_field(service, agg):
    client = openai.OpenAI(base_url=f"{service['http']}/agg/v1", api_key="unused")
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strng"}}}
    for kwargs, param in [
        ({"response_format": bad}, "response_format.json_schema.schema"),
        (
            {"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a"}},
            "guided_regex",
        ),
        ({"extra_body": {"structured_outputs": {"regex": "(a"}}}, "structured_outputs.regex"),
        (
            {"tools": [_WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice.function.name",
        ),
    ]:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(
                model="SmolLM2-135M-Instruct",
                messages=[{"role": "user", "content": "Hi"}],
                max_tokens=5,
                **kwargs,
            )
        assert err.value.param == param and param in err.value.message
    request = generate_request("Hi", max_tokens=4)
    request.structured_output.regex = "[a-"
    with pytest.raises(grpc.RpcError) as refused:
        agg.generate_unary(request)
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "structured_output.regex" in refused.value.details()


def test_a_batch_of_prompts_gets_n_choices_each_in_prompt_order(service):
    client = openai.OpenAI(base_url=f"{service['http']}/agg/v1", api_key="unused")
    common = {"model": "SmolLM2-135M-Instruct", "max_tokens": 6, "seed": 9}
    batch = client.completions.create(prompt=PROMPTS[:2], n=2, **common)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    for k, prompt in enumerate(PROMPTS[:2]):
        alone = client.completions.create(prompt=prompt, n=2, **common)
        assert [c.text for c in batch.choices[2 * k : 2 * k + 2]] == [c.text for c in alone.choices]
    single = [
        client.completions.create(prompt=p, max_tokens=1, model=common["model"])
        for p in PROMPTS[:2]
    ]
    assert batch.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in single)


def test_the_responses_api_answers_text_structured_output_and_tools(service):
    client = openai.OpenAI(base_url=f"{service['http']}/disagg/v1", api_key="unused")
    model = "SmolLM2-135M-Instruct"
    question = [{"role": "user", "content": "Name a color."}]
    chat = client.chat.completions.create(
        model=model, messages=question, max_tokens=12, temperature=0
    )
    done = client.responses.create(model=model, input=question, max_output_tokens=12, temperature=0)
    assert done.output_text == chat.choices[0].message.content
    assert done.usage.output_tokens == chat.usage.completion_tokens
    streamed = client.responses.create(
        model=model, input=question, max_output_tokens=12, temperature=0, stream=True
    )
    events = list(streamed)
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == done.output_text and events[-1].type in (
        "response.completed",
        "response.incomplete",
    )

    parsed = client.responses.parse(
        model=model, input=_person_prompt("a gardener"), text_format=_Person, temperature=1.0,
        max_output_tokens=_PERSON_TOKENS,
    )  # fmt: skip
    assert isinstance(parsed.output_parsed, _Person)
    flat = {"type": "function", **_WEATHER["function"]}
    called = client.responses.create(
        model=model, input="Weather in Lima?", tools=[flat], tool_choice="required",
        parallel_tool_calls=False, temperature=1.0, max_output_tokens=120,
    )  # fmt: skip
    (call,) = [item for item in called.output if item.type == "function_call"]
    assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), _WEATHER["function"]["parameters"])


def test_tokenize_detokenize_and_version_in_vllms_shapes(service, agg):
    base = f"{service['http']}/agg"

    def post(path: str, body: dict) -> dict:
        request = urllib.request.Request(
            base + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request) as response:
            return json.loads(response.read())

    model = "SmolLM2-135M-Instruct"
    done = post("/tokenize", {"model": model, "prompt": PROMPTS[0], "return_token_strs": True})
    assert done["tokens"] == agg.tokenize(PROMPTS[0]) and done["count"] == len(done["tokens"])
    assert done["max_model_len"] > 0 and "".join(done["token_strs"]).strip()
    chat = post("/tokenize", {"model": model, "messages": [{"role": "user", "content": "Hi"}]})
    assert chat["count"] > done["count"] // 10  # the template's markup and the message
    text = post("/detokenize", {"model": model, "tokens": done["tokens"]})["prompt"]
    assert text.endswith(PROMPTS[0])  # after any BOS the tokenizer adds
    with urllib.request.urlopen(base + "/version") as response:
        assert json.loads(response.read())["version"]
    with pytest.raises(urllib.error.HTTPError) as refused:
        post("/detokenize", {"model": model, "tokens": [10**9]})
    assert refused.value.code == 400
    assert json.loads(refused.value.read())["error"]["param"] == "tokens"
    # Counting stops at the context: a text past it is refused, on its head if long.
    for text in ["x" * 9_000_000, "7" * 20_000, "word " * 10_000]:
        with pytest.raises(urllib.error.HTTPError) as refused:
            post("/tokenize", {"model": model, "prompt": text})
        assert refused.value.code == 400
        error = json.loads(refused.value.read())["error"]
        assert error["param"] == "prompt" and error["code"] == "context_length_exceeded"
    with pytest.raises(grpc.RpcError) as refused:
        agg.tokenize("7" * 20_000)  # past the head probes' 8 characters per token
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "Tokenize counts at most" in refused.value.details()


def test_every_pool_gets_all_its_blocks_back(service):
    """Last: after every request of the module, cancelled and refused ones too."""
    snaps = _wait_idle()
    assert {s["role"] for s in snaps} == {"prefill", "decode", "aggregated"}
    assert {s["dtype"] for s in snaps} == {"float32"}  # auto, on CPU
    assert {(s["role"], s["tensor_parallel_size"]) for s in snaps if s["app"] == "disagg"} == {
        ("prefill", 3),
        ("decode", 1),
    }
