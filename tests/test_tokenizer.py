"""workers/model/tokenizer.py: the bytes behind each token, for both vocabulary styles."""

from __future__ import annotations

import json
from datetime import datetime

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models

from workers.model.tokenizer import Tokenizer


@pytest.mark.slow
@pytest.mark.parametrize("text", ["👩👩", " héllo wörld", "<|im_start|>user\n", "a\tb  c"])
def test_byte_level_tokens_give_back_the_exact_bytes_of_the_text(smollm2_dir, text):
    tok = Tokenizer(smollm2_dir)
    ids = tok.encode(text, add_special_tokens=False)
    pieces = [tok.token_bytes(i) for i in ids]
    assert b"".join(pieces) == text.encode()
    if text == "👩👩":  # split inside the character: each piece alone is not UTF-8
        assert len(pieces) > 2 and tok.decode(ids[:1]) == "\ufffd"


def test_sentencepiece_style_tokens_map_the_space_mark_and_byte_fallbacks(tmp_path):
    vocab = {"<unk>": 0, "▁hi": 1, "<0xF0>": 2, "<0x9F>": 3, "x": 4}
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    hf.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer(tmp_path)
    assert [tok.token_bytes(i) for i in (1, 2, 3, 4)] == [b" hi", b"\xf0", b"\x9f", b"x"]


@pytest.mark.slow
def test_an_id_the_tokenizer_lacks_stands_for_no_bytes(smollm2_dir):
    # Models pad their vocabulary past the tokenizer's; such ids can be sampled candidates.
    tok = Tokenizer(smollm2_dir)
    assert tok.token_bytes(tok.vocab_size + 5) == b"" == tok.decode([tok.vocab_size + 5]).encode()


def _chat_tokenizer(tmp_path, template: str) -> Tokenizer:
    tmp_path.mkdir()
    vocab = {"<unk>": 0, "a": 1}
    HFTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>")).save(
        str(tmp_path / "tokenizer.json")
    )
    (tmp_path / "chat_template.jinja").write_text(template)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    return Tokenizer(tmp_path)


def test_developer_messages_are_system_messages_unless_the_template_knows_the_role(tmp_path):
    messages = [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "q"}]
    turns = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    plain = _chat_tokenizer(tmp_path / "plain", turns)
    assert plain.apply_chat_template(messages, add_generation_prompt=False) == (
        "<system>be brief<user>q"
    )
    knowing = _chat_tokenizer(tmp_path / "knowing", "{# developer #}" + turns)
    assert knowing.apply_chat_template(messages, add_generation_prompt=False) == (
        "<developer>be brief<user>q"
    )


def test_templates_render_as_under_transformers(tmp_path):
    # Loop controls, a dated system prompt, tojson without HTML escapes, tools as None.
    template = (
        "{% for m in messages %}{% if m.role == 'skip' %}{% continue %}{% endif %}"
        "{{ m.content | tojson }}{% if loop.index == 3 %}{% break %}{% endif %}{% endfor %}"
        "|{{ strftime_now('%Y') }}|{{ 'tools' if tools is not none else 'no tools' }}"
        "|{% generation %}{{ eos_token }}{% endgeneration %}"
        "|{{ 'pad' if pad_token is defined else 'no pad' }}"
    )
    tok = _chat_tokenizer(tmp_path / "t", template)
    messages = [
        {"role": "user", "content": "<a>&'é"},
        {"role": "skip", "content": "x"},
        {"role": "user", "content": "b"},
        {"role": "user", "content": "never"},
    ]
    year = datetime.now().year
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == (
        f'"<a>&\'é""b"|{year}|no tools|</s>|no pad'
    )
