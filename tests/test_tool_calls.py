"""workers/model/tool_calls.py with Tokenizer.apply_chat_template: tools, calls and their
results rendered by a template that knows tools, or written into one that does not."""

from __future__ import annotations

import json

import pytest
from tiny_model import make_tiny_model

from workers.model.tokenizer import Tokenizer
from workers.model.tool_calls import CALL_CLOSE, CALL_OPEN, call_text, inline_tools

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
CALL = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
HISTORY = [
    {"role": "user", "content": "1 + 2?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "content": "3"},
]
# A template that renders tools itself, the way Qwen's and others' do.
TOOL_TEMPLATE = (
    "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
    "{% for m in messages %}{{ m.role }}:{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}[{{ c.function.name }} {{ c.function.arguments | tojson }}]"
    "{% endfor %}\n{% endfor %}"
)


def test_a_call_is_a_tagged_json_object():
    text = call_text("add", '{"a": 1}')
    assert text.startswith(CALL_OPEN + "\n") and text.endswith("\n" + CALL_CLOSE)
    assert json.loads(text[len(CALL_OPEN) : -len(CALL_CLOSE)]) == {
        "name": "add",
        "arguments": {"a": 1},
    }


def test_inlined_tools_go_into_the_system_message_and_results_into_a_user_turn():
    inlined = inline_tools([{"role": "system", "content": "Be brief."}, *HISTORY], TOOLS)
    assert [m["role"] for m in inlined] == ["system", "user", "assistant", "user"]
    assert (
        inlined[0]["content"].startswith("Be brief.\n\n")
        and '"name": "add"' in inlined[0]["content"]
    )
    assert inlined[2]["content"] == call_text("add", {"a": 1})
    assert inlined[3]["content"] == "<tool_response>\n3\n</tool_response>"
    assert inline_tools(HISTORY[:1], TOOLS)[0]["role"] == "system"  # one is added
    # Results in a row are one user turn, so turns still alternate.
    two = [*HISTORY, {"role": "tool", "content": "4"}]
    assert [m["role"] for m in inline_tools(two, None)] == ["user", "assistant", "user"]
    assert inline_tools(two, None)[-1]["content"].count("<tool_response>") == 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


def test_a_template_without_tools_gets_them_inlined(model_dir):
    tokenizer = Tokenizer(model_dir)
    assert not tokenizer.renders_tools
    text = tokenizer.apply_chat_template(HISTORY, tools=TOOLS)
    assert "<tools>" in text and call_text("add", {"a": 1}) in text and "<tool_response>" in text
    # Without tools or calls, a conversation renders as before.
    assert "<tools>" not in tokenizer.apply_chat_template(HISTORY[:1])


def test_a_template_that_knows_tools_renders_them_with_arguments_as_objects(model_dir, tmp_path):
    config = {"chat_template": TOOL_TEMPLATE, "eos_token": "<|endoftext|>"}
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = Tokenizer(model_dir)
    assert tokenizer.renders_tools
    text = tokenizer.apply_chat_template(HISTORY, tools=TOOLS, add_generation_prompt=False)
    # (transformers' template environment trims the newline after each block tag)
    assert text == 'TOOLS:add;user:1 + 2?assistant:[add {"a": 1}]tool:3'
