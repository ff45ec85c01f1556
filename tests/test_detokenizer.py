"""IncrementalDetokenizer on a byte-level tokenizer (one token per UTF-8 byte).

Multi-byte characters ("é" is 2 bytes, "日" 3, "🙂" 4) therefore span several
tokens, which is exactly where streaming detokenization goes wrong.
"""

from __future__ import annotations

import random

import pytest
from tiny_model import SPECIALS, _byte_tokenizer

from workers.engine.detokenizer import IncrementalDetokenizer

TOK = _byte_tokenizer()
PROMPT = "Q: say something\nA:"
TEXTS = [
    "plain ascii text",
    "héllo wörld",
    "日本語のテキスト",
    "emoji 🙂🙃 and more 🙂",
    "mixé日🙂x",
]


def _ids(text: str) -> list[int]:
    return TOK.encode(text, add_special_tokens=False).ids


def _detok(stop: tuple[str, ...] = (), skip_special_tokens: bool = True) -> IncrementalDetokenizer:
    return IncrementalDetokenizer(TOK, _ids(PROMPT), stop, skip_special_tokens)


def _stream(detok: IncrementalDetokenizer, token_ids: list[int]) -> tuple[list[str], bool]:
    """Feeds tokens one at a time like the engine: release after each, all at the end."""
    pieces, stopped = [], False
    for i, token in enumerate(token_ids):
        stopped = detok.add_token(token)
        last = stopped or i == len(token_ids) - 1
        pieces.append(detok.release(finished=last))
        if stopped:
            break
    return pieces, stopped


def test_multibyte_characters_really_span_several_tokens():
    assert len(_ids("é")) == 2
    assert len(_ids("日")) == 3
    assert len(_ids("🙂")) == 4
    assert TOK.decode(_ids(TEXTS[-1])) == TEXTS[-1]


@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time_never_releases_a_broken_character(text):
    detok = _detok()
    pieces, stopped = _stream(detok, _ids(text))
    assert not stopped
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) == text
    assert detok.text == text


def test_a_character_appears_only_with_its_last_byte():
    detok = _detok()
    first, second, third = _ids("日")
    assert not detok.add_token(first)
    assert detok.release(finished=False) == ""
    assert not detok.add_token(second)
    assert detok.release(finished=False) == ""
    assert not detok.add_token(third)
    assert detok.release(finished=False) == "日"
    assert detok.text == "日"


def test_prompt_text_is_not_part_of_the_output():
    detok = _detok()
    pieces, _ = _stream(detok, _ids(" ok"))
    assert "".join(pieces) == " ok"


def test_without_stop_strings_nothing_is_held_back():
    detok = _detok()
    for char in "abc日":
        for token in _ids(char):
            detok.add_token(token)
        assert detok.release(finished=False) == char


@pytest.mark.parametrize(
    ("text", "stop", "expected", "stopped_on"),
    [
        ("Hello, world! STOP and more", ("STOP",), "Hello, world! ", "STOP"),
        ("a line\n\nthe next", ("\n\n",), "a line", "\n\n"),
        ("price: 5日本円 ok", ("日本",), "price: 5", "日本"),  # stop made of multi-byte chars
        ("smile 🙂 end", ("🙂",), "smile ", "🙂"),
        ("STOP at once", ("STOP",), "", "STOP"),
    ],
)
def test_stop_string_across_token_boundaries_truncates_before_it(text, stop, expected, stopped_on):
    detok = _detok(stop)
    ids = _ids(text)
    pieces, stopped = _stream(detok, ids)
    assert stopped
    assert detok.stopped_on == stopped_on
    assert detok.text == expected
    assert "".join(pieces) == expected
    # It stops on the very token that completes the stop string, not later.
    end = text.index(stopped_on) + len(stopped_on)
    assert len(pieces) == len(_ids(text[:end]))


@pytest.mark.parametrize(
    ("text", "stop", "expected", "stopped_on"),
    [
        # Completed at the same token, the one starting earlier wins, whatever the order.
        ("say hello there", ("lo", "hello"), "say ", "hello"),
        ("say hello there", ("hello", "lo"), "say ", "hello"),
        # Otherwise the first to complete wins.
        ("one, two, three", ("three", "two"), "one, ", "two"),
        ("one, two, three", ("three", "o, t"), "one, tw", "o, t"),
    ],
)
def test_with_several_stop_strings_the_earliest_match_wins(text, stop, expected, stopped_on):
    detok = _detok(stop)
    pieces, stopped = _stream(detok, _ids(text))
    assert stopped
    assert detok.stopped_on == stopped_on
    assert detok.text == expected
    assert "".join(pieces) == expected


def test_no_stop_match_means_the_whole_text_is_released_at_the_end():
    text = "STO ST S STOPPED? no: STOp"
    detok = _detok(("STOP!",))
    pieces, stopped = _stream(detok, _ids(text))
    assert not stopped
    assert detok.stopped_on is None
    assert "".join(pieces) == text


def test_hold_back_is_at_most_the_longest_stop_minus_one():
    stop = ("END", "<stop>")  # longest is 6 characters: hold back at most 5
    text = "some <sto text, an EN, then <stop> after"
    detok = _detok(stop)
    released = ""
    for token in _ids(text):
        if detok.add_token(token):
            break
        released += detok.release(finished=False)
        assert detok.text.startswith(released)
        assert len(detok.text) - len(released) <= 5
    # Once the text has moved 5 characters past a near miss, the near miss is out.
    assert "some <sto text, an EN," in released
    final = released + detok.release(finished=True)
    assert final == detok.text == "some <sto text, an EN, then "


@pytest.mark.parametrize("seed", range(5))
def test_released_text_is_never_retracted(seed):
    rng = random.Random(seed)
    alphabet = ["a", "b", "c", "é", "日", "🙂", " "]
    stop = ("abc", "日🙂", "é é")
    text = "".join(rng.choice(alphabet) for _ in range(300))
    detok = _detok(stop)
    pieces, stopped = _stream(detok, _ids(text))
    final = detok.text
    released = ""
    for piece in pieces:
        released += piece
        assert final.startswith(released)
        assert "\ufffd" not in piece
    assert released == final
    assert all(s not in final for s in stop)
    if stopped:
        assert text.startswith(final + detok.stopped_on)
    else:
        assert final == text


def test_release_finished_hands_out_the_held_tail():
    detok = _detok(("STOP",))
    for token in _ids("abcdef"):
        detok.add_token(token)
    assert detok.release(finished=False) == "abc"
    assert detok.release(finished=False) == ""
    assert detok.release(finished=True) == "def"
    assert detok.release(finished=True) == ""


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_are_skipped_only_when_asked(skip):
    special_ids = [TOK.token_to_id(s) for s in SPECIALS]
    assert None not in special_ids
    ids = [special_ids[1], *_ids("hi"), special_ids[2], *_ids("!"), special_ids[0]]
    detok = _detok(skip_special_tokens=skip)
    pieces, _ = _stream(detok, ids)
    if skip:
        assert "".join(pieces) == "hi!"
    else:
        assert "".join(pieces) == "<|im_start|>hi<|im_end|>!<|endoftext|>"


def test_prompt_ending_inside_a_character_does_not_leak_into_the_output():
    tok = _byte_tokenizer()
    prompt = tok.encode("hello日", add_special_tokens=False).ids[:-1]  # cut inside 日
    detok = IncrementalDetokenizer(tok, prompt)
    detok.add_token(tok.encode("a", add_special_tokens=False).ids[0])
    assert detok.text == "a"
