"""Incremental detokenization with stop strings.

Text is released only as whole UTF-8 characters (the tokenizers library's
`DecodeStream` buffers partial byte sequences), and, while stop strings are
set, the tail that could still grow into a stop string is held back so a
client never sees text that is later retracted.
"""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

# Prompt tokens fed to the stream first so the first output token decodes with
# its real left context (SentencePiece drops a leading space at string start).
_CONTEXT_TOKENS = 4


def _clean_context(tokenizer: Tokenizer, prompt_token_ids: list[int]) -> list[int]:
    """The longest prompt tail (up to _CONTEXT_TOKENS) that decodes to whole characters.

    A tail cut inside a UTF-8 character would make the stream emit those prompt
    bytes, joined with the first output token, as output text.
    """
    for n in range(min(_CONTEXT_TOKENS, len(prompt_token_ids)), 0, -1):
        tail = list(prompt_token_ids[-n:])
        if "\ufffd" not in tokenizer.decode(tail, skip_special_tokens=False):
            return tail
    return []


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        stop: tuple[str, ...] = (),
        skip_special_tokens: bool = True,
    ):
        self._tokenizer = tokenizer
        self._stream = DecodeStream(
            ids=_clean_context(tokenizer, prompt_token_ids), skip_special_tokens=skip_special_tokens
        )
        self._stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self._released = 0
        self._pending: list[int] = []  # tokens the stream holds back (partial UTF-8)
        self.stopped_on: str | None = None

    def add_token(self, token_id: int, check_stop: bool = True) -> bool:
        """Decodes one more token; True when the text now contains a stop string (never
        without `check_stop`: a request short of its min_tokens goes on regardless)."""
        piece = self._stream.step(self._tokenizer, token_id)
        if piece is None:
            self._pending.append(token_id)
            return False
        self._pending.clear()
        searched_from = max(0, len(self.text) - self._hold)
        self.text += piece
        if not check_stop:
            return False
        hits = [
            (at, stop) for stop in self._stop if (at := self.text.find(stop, searched_from)) >= 0
        ]
        if not hits:
            return False
        at, self.stopped_on = min(hits)
        self.text = self.text[:at]
        return True

    def release(self, finished: bool) -> str:
        """Text not yet handed out; at the end, all of it."""
        if finished and self._pending and self.stopped_on is None:
            # Bytes that never completed a character end the text as U+FFFD, as a
            # full decode of the same tokens would.
            self.text += self._tokenizer.decode(self._pending)
            self._pending.clear()
        end = len(self.text) if finished else max(self._released, len(self.text) - self._hold)
        new, self._released = self.text[self._released : end], end
        return new
