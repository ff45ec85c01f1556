"""What the OpenAI API (and vLLM's extensions of it) offers that Baton's engine cannot do.

A client that sets one of these fields expects its effect, so a request that asks for it
is refused with a 400 naming the field, never served as if the field were absent; the
field's neutral values (those that ask for nothing) and JSON null are accepted.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Collection
from typing import Any

from workers.engine import InvalidRequestError

_TOOLS = "the deprecated function form is not supported; send tools"
# Fields the engine cannot honour: (the values that ask for nothing, why). Absent or null
# is always accepted; anything else is refused, for a client that sets one expects its
# effect.
UNSUPPORTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "best_of": ((1,), "one candidate per request"),
    "echo": ((False,), "the prompt is echoed by /v1/completions only"),
    "suffix": (("",), "insertion (suffix) is not supported"),
    # Served by chat completions, whose request has them as fields.
    "tools": (([],), "tools are offered on /v1/chat/completions"),
    "tool_choice": (("none",), "tools are offered on /v1/chat/completions"),
    "functions": (([],), _TOOLS),  # the deprecated form of tools
    "function_call": (("none",), _TOOLS),
    # Other vLLM extensions that would change the output.
    "guided_whitespace_pattern": ((), "JSON is generated without free whitespace"),
    "use_beam_search": ((False,), "beam search is not supported"),
    "include_stop_str_in_output": ((False,), "a stop string is never part of the output"),
    "allowed_token_ids": ((), "restricting the vocabulary is not supported; use logit_bias"),
    "bad_words": (([],), "bad_words is not supported; use logit_bias"),
    "truncate_prompt_tokens": ((), "prompts are never truncated; shorten the prompt"),
    "add_generation_prompt": ((True,), "the generation prompt is always added"),
    "continue_final_message": ((False,), "a final assistant message is never continued"),
    "chat_template": ((), "a request cannot bring its own chat template"),
    "chat_template_kwargs": (({},), "the chat template takes no arguments"),
    "spaces_between_special_tokens": ((True,), "special tokens are always spaced"),
    "return_tokens_as_token_ids": ((False,), "logprobs name tokens by their text"),
    "documents": (([],), "the chat template is given no documents"),
    "logits_processors": (([],), "a request cannot bring logits processors; use logit_bias"),
    # OpenAI's audio output.
    "modalities": ((["text"],), "only text is generated"),
    "audio": ((), "audio output is not supported"),
}


def check_unsupported(body: dict[str, Any], served: Collection[str] = ()) -> None:
    """InvalidRequestError naming the first field of `body` set to what Baton cannot do;
    `served`: the fields the endpoint at hand does offer."""
    for name, (neutral, why) in UNSUPPORTED.items():
        if name in served:
            continue
        value = body.get(name)
        # True == 1 in Python; a boolean is never an accepted number here.
        if value is None or any(
            value == v and isinstance(value, bool) == isinstance(v, bool) for v in neutral
        ):
            continue
        accepted = " or ".join(json.dumps(v) for v in neutral)
        allowed = f"accepted: {accepted} (or absent)" if accepted else "leave it out"
        got = json.dumps(_excerpt(value), default=repr)
        got = got if len(got) <= 80 else got[:77] + "..."
        raise InvalidRequestError(f"{name}: {why}; {allowed}, got {got}", param=name)


def _excerpt(value: Any, depth: int = 3, items: int = 4) -> Any:
    """A refused value cut to quote: `depth` levels of `items` entries. Whole, it may be
    as large as a body and nest nearly as deep as the parser goes, and quoting it would
    then recurse past Python's limit."""
    if isinstance(value, dict):
        entries = itertools.islice(value.items(), items)
        return {k: _excerpt(v, depth - 1, items) for k, v in entries} if depth else {"...": 0}
    if isinstance(value, list):
        return [_excerpt(v, depth - 1, items) for v in value[:items]] if depth else ["..."]
    return value
