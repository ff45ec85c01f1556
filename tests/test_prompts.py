"""ModelFrontend: the router's tokenization, request checks and block hashing."""

from __future__ import annotations

import json

import pytest
from tiny_model import make_tiny_model

from serve_app.model_frontend import ModelFrontend, PromptInput
from workers.engine.block_hash import hash_full_blocks, root_hash
from workers.engine.config import EngineConfig
from workers.engine.llm_engine import LLMEngine
from workers.engine.sampling_params import SamplingParams
from workers.errors import InvalidRequestError


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def frontend(model_dir):
    return ModelFrontend(model_dir, "tiny-id", block_size=4, max_model_len=256)


def test_prompts_tokenize_as_the_engine_tokenizes(frontend, model_dir):
    engine = LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=8))
    assert frontend.tokenize(PromptInput(text="hello")) == engine.tokenizer.encode("hello")
    messages = [{"role": "user", "content": "hi"}]
    chat = frontend.tokenize(PromptInput(messages=(("user", "hi"),)))
    assert chat == engine.tokenizer.encode_chat(messages)
    assert frontend.tokenize(PromptInput(token_ids=(1, 2, 3))) == [1, 2, 3]


def test_block_hashes_are_the_engines_hashes_under_the_salt(frontend):
    ids = list(range(1, 11))
    request = frontend.build_request("r", ids, SamplingParams(max_tokens=2), "tenant")
    assert list(request.block_hashes) == hash_full_blocks(ids, 4, root_hash("tiny-id", "tenant"))
    assert len(request.block_hashes) == 2  # the trailing partial block has no hash
    other = frontend.build_request("r", ids, SamplingParams(max_tokens=2), None)
    assert other.block_hashes[0] != request.block_hashes[0]


def test_out_of_vocabulary_token_ids_are_refused(frontend):
    ids = frontend.tokenize(PromptInput(token_ids=(1, 999)))
    with pytest.raises(InvalidRequestError, match="prompt token ids must be integers in"):
        frontend.build_request("r", ids, SamplingParams(max_tokens=2), None)


@pytest.mark.parametrize(
    ("prompt", "named"),
    [
        (PromptInput(messages=()), "messages"),
        (PromptInput(messages=(("wizard", "x"),)), "messages[0].role"),
    ],
)
def test_bad_prompts_name_the_field(frontend, prompt, named):
    with pytest.raises(InvalidRequestError, match=named.replace("[", r"\[")):
        frontend.tokenize(prompt)


def test_the_room_after_a_prompt_and_a_prompt_that_leaves_none(frontend):
    assert frontend.room_after([1] * 200) == 56
    with pytest.raises(InvalidRequestError, match="the prompt is 256 tokens") as err:
        frontend.room_after([1] * 256)
    assert (err.value.param, err.value.code) == ("prompt", "context_length_exceeded")


def test_requests_beyond_the_context_or_vocabulary_are_refused(frontend):
    with pytest.raises(InvalidRequestError, match="maximum context length is 256"):
        frontend.build_request("r", [1] * 200, SamplingParams(max_tokens=100), None)
    with pytest.raises(InvalidRequestError, match="stop_token_ids"):
        frontend.build_request("r", [1], SamplingParams(stop_token_ids=(5000,)), None)
    with pytest.raises(InvalidRequestError, match="at least one token"):
        frontend.build_request("r", [], SamplingParams(), None)


@pytest.mark.parametrize(
    ("prompt", "stop", "salt", "param"),
    [
        (PromptInput(text="a\ud800b"), (), None, "prompt"),
        (
            PromptInput(messages=(("user", "ok"), ("user", "\udfff"))),
            (),
            None,
            "messages.1.content",
        ),
        (PromptInput(text="ok"), ("\ud800",), None, "stop"),
        (PromptInput(text="ok"), (), "\ud800", "cache_salt"),
    ],
)
def test_a_lone_surrogate_is_the_clients_error_naming_the_field(
    frontend, prompt, stop, salt, param
):
    # JSON can spell one ("\ud800"); no tokenizer or hash takes it.
    with pytest.raises(InvalidRequestError, match="not valid Unicode") as err:
        ids = frontend.tokenize(prompt)
        frontend.build_request("r", ids, SamplingParams(max_tokens=2, stop=stop), salt)
    assert err.value.param == param


def test_a_prompts_length_counts_every_message():
    assert PromptInput(text="abc").num_chars() == 3
    assert PromptInput(messages=(("system", "ab"), ("user", "cde"))).num_chars() == 5 + 2 * 16
    assert PromptInput(token_ids=(1, 2)).num_chars() == 0


def test_a_prompt_that_cannot_fit_the_context_is_refused_before_tokenizing(frontend):
    longest = max(len(t) for t in frontend.tokenizer.hf.get_vocab(with_added_tokens=True))
    assert frontend.max_prompt_chars == 256 * longest
    # The bound is sound: even a text of nothing but the longest entry fits its count.
    token = max(frontend.tokenizer.hf.get_vocab(), key=len)
    assert len(frontend.tokenize(PromptInput(text=token * 8))) <= 8 * len(token)
    frontend.check_size(PromptInput(text="x" * frontend.max_prompt_chars))
    too_long = {
        "prompt": PromptInput(text="x" * (frontend.max_prompt_chars + 1)),
        "messages": PromptInput(messages=(("user", "x" * frontend.max_prompt_chars),)),
    }
    for field, prompt in too_long.items():
        with pytest.raises(InvalidRequestError, match="cannot fit this model's context") as err:
            frontend.check_size(prompt)
        assert err.value.param == field and err.value.code == "context_length_exceeded"
    frontend.check_size(PromptInput(token_ids=range(255)))
    with pytest.raises(InvalidRequestError, match="the prompt is 256 tokens") as err:
        frontend.check_size(PromptInput(token_ids=range(256)))
    assert err.value.param == "prompt"


def test_a_chat_prompt_is_bounded_in_messages():
    PromptInput(messages=(("user", ""),) * 2048)
    with pytest.raises(InvalidRequestError, match="at most 2048 messages, got 2049") as err:
        PromptInput(messages=(("user", ""),) * 2049)
    assert err.value.param == "messages"


def test_a_prompt_is_exactly_one_kind():
    with pytest.raises(InvalidRequestError, match="exactly one"):
        PromptInput(text="a", token_ids=(1,))
    with pytest.raises(InvalidRequestError, match="exactly one"):
        PromptInput()


def test_a_chat_template_that_refuses_the_messages_is_the_clients_error(tmp_path):
    model_dir = make_tiny_model(tmp_path)
    template = (
        "{% if messages[0]['role'] != 'user' %}"
        "{{ raise_exception('Conversations must start with a user message') }}{% endif %}"
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    config = {"chat_template": template, "eos_token": "<|endoftext|>"}
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    frontend = ModelFrontend(model_dir, "tiny-id", block_size=4, max_model_len=256)
    assert frontend.tokenize(PromptInput(messages=(("user", "hi"),)))
    refusal = "^messages: .*must start with a user message"
    with pytest.raises(InvalidRequestError, match=refusal) as e:
        frontend.tokenize(PromptInput(messages=(("assistant", "hi"),)))
    assert e.value.param == "messages"
    with pytest.raises(InvalidRequestError, match="at least one message") as e:
        frontend.tokenize(PromptInput(messages=()))
    assert e.value.param == "messages"


def test_a_prompt_whose_head_fills_the_context_is_refused_on_the_head_alone(model_dir):
    frontend = ModelFrontend(model_dir, "tiny-id", block_size=4, max_model_len=256)
    encoded: list[int] = []
    encode = frontend.tokenizer.encode

    def counting(text, add_special_tokens=True):
        encoded.append(len(text))
        return encode(text, add_special_tokens=add_special_tokens)

    frontend.tokenizer.encode = counting  # the real tokenizer, its inputs' sizes noted
    words = "word " * 40_000  # 200k characters, one token each on the byte tokenizer
    for prompt, field in [
        (PromptInput(text=words), "prompt"),
        (PromptInput(messages=(("user", words),)), "messages"),
    ]:
        for to_generate, limit in [(True, "maximum context length"), (False, "Tokenize counts")]:
            encoded.clear()
            refusal = f"first .* characters alone.*{limit}"
            with pytest.raises(InvalidRequestError, match=refusal) as err:
                frontend.tokenize(prompt, to_generate=to_generate)
            assert err.value.param == field and err.value.code == "context_length_exceeded"
            assert encoded and max(encoded) <= 8 * 256  # the heads only
    # A dense text with no whitespace to cut at is cut inside its word, and refused too.
    encoded.clear()
    with pytest.raises(InvalidRequestError, match="first 2048 characters alone are 2048 tokens"):
        frontend.tokenize(PromptInput(text="x" * 3000), to_generate=True)
    assert encoded == [256, 2048]  # within the slack on the short head, past it on the long
    assert len(frontend.tokenize(PromptInput(text="word " * 40), to_generate=True)) == 200
    # Up to 8 characters per context token, the whole text is tokenized: within the limit
    # it is counted, past it refused naming its count.
    assert len(frontend.tokenize(PromptInput(text="x" * 255, add_special_tokens=False))) == 255
    with pytest.raises(InvalidRequestError, match="the text is 300 tokens; Tokenize counts"):
        frontend.tokenize(PromptInput(text="x" * 300, add_special_tokens=False))


def test_a_compressible_long_text_is_tokenized_whole_and_counted_exactly(model_dir):
    # Runs of a character that a vocabulary entry spells many of: heads hold few tokens,
    # so nothing is refused on a head and the whole text's count decides.
    frontend = ModelFrontend(model_dir, "tiny-id", block_size=4, max_model_len=256)
    token = max(frontend.tokenizer.hf.get_vocab(), key=len)
    run = token * (9 * 256 // len(token) + 1)
    ids = frontend.tokenize(PromptInput(text=run, add_special_tokens=False))
    assert ids == frontend.tokenizer.encode(run, add_special_tokens=False)
