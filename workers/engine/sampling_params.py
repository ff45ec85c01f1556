"""Per-request sampling parameters, validated before anything is scheduled."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from workers.engine.structured_output import StructuredOutput
from workers.errors import CONTEXT_LENGTH_EXCEEDED, InvalidRequestError

MAX_LOGPROBS = 20
# OpenAI's ranges: penalties in [-2, 2], a logit bias in [-100, 100].
MAX_PENALTY = 2.0
MAX_LOGIT_BIAS = 100.0
MAX_REPETITION_PENALTY = 10.0
# Below this a seen token's positive logit, divided by the penalty, can leave float32's
# range, and the distribution turns to NaN.
MIN_REPETITION_PENALTY = 0.01
# Below this, logits / temperature overflows float32; such requests mean greedy.
MIN_TEMPERATURE = 1e-5
# Above this the distribution is as flat as it gets over a model's logits, and far above
# it (past float32's range) logits / temperature would turn banned tokens into NaN.
MAX_TEMPERATURE = 100.0
# A top_k past the vocabulary keeps every token; past int32 it is no count a sampler takes.
MAX_TOP_K = 2**31 - 1
# Bounds on the lists a request carries, each consulted at every token it generates (stop
# strings by the router's text stream, stop ids and biases by the engine step it shares
# with other requests): one request's lists must not slow everyone's streams. OpenAI
# takes 4 stop strings and 300 biased tokens.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS_TOKENS = 1024


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1, as in vLLM) means off
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    logprobs: int | None = None  # top-n alternatives returned with each sampled token
    # The prompt's own tokens' logprobs (from the second on), each with this many top
    # alternatives, in the first output; None: none. Such a prompt is computed whole:
    # a cached prefix has no logits to give.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # Subtracted from a token's logit once if it was generated before (presence) and
    # per time it was (frequency): OpenAI's penalties, on the output so far.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # CTRL's penalty (as in transformers and vLLM) on every token of prompt and output:
    # a positive logit is divided by it, a negative one multiplied; 1 is off.
    repetition_penalty: float = 1.0
    # Drops tokens less likely than min_p times the most likely one; 0 is off.
    min_p: float = 0.0
    # (token id, bias) pairs added to the logits before anything else.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Output tokens before EOS, a stop token id or a stop string may end the request.
    min_tokens: int = 0
    # What the output must match (a JSON schema, a regex...): every token is sampled
    # from those its grammar allows, and the request ends when the grammar is complete.
    structured: StructuredOutput | None = None
    # A migrated request (one resumed on another replica after its first one failed):
    # the last this many prompt tokens are its output so far, which count towards
    # max_tokens and min_tokens, the penalties, the grammar and a seeded generator as the
    # tokens it generated, so it goes on as the lost request would have.
    resumed_tokens: int = 0

    # Lists (and a dict for logit_bias) are accepted for convenience and frozen.
    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", _as_tuple(self.stop_token_ids, "stop_token_ids"))
        stop = (self.stop,) if isinstance(self.stop, str) else _as_tuple(self.stop, "stop")
        object.__setattr__(self, "stop", stop)
        bias = self.logit_bias
        bias = tuple(bias.items()) if isinstance(bias, dict) else _as_tuple(bias, "logit_bias")
        object.__setattr__(self, "logit_bias", bias)
        numbers = ("temperature", "top_p", "presence_penalty", "frequency_penalty")
        for name in (*numbers, "repetition_penalty", "min_p"):
            if not _is_number(getattr(self, name)):
                raise InvalidRequestError(
                    f"{name} must be a number, got {getattr(self, name)!r}", param=name
                )
        for name in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequestError(
                    f"{name} must be true or false, got {getattr(self, name)!r}", param=name
                )
        numbers = ("max_tokens", "top_k", "seed", "logprobs", "prompt_logprobs", "min_tokens")
        for name in (*numbers, "resumed_tokens"):
            if isinstance(getattr(self, name), bool):
                raise InvalidRequestError(
                    f"{name} must be an integer, got {getattr(self, name)!r}", param=name
                )
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise InvalidRequestError(
                f"structured must be a StructuredOutput, got {type(self.structured).__name__}",
                param="structured",
            )
        self._validate()
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        bias = tuple(sorted((t, float(b)) for t, b in self.logit_bias))
        object.__setattr__(self, "logit_bias", bias)

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE or self.top_k == 1

    @property
    def adjusts_logits(self) -> bool:
        """Whether a penalty, a logit bias or min_tokens changes the logits before
        sampling."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.min_tokens
        )

    def _validate(self) -> None:
        for name, limit in (
            ("stop", MAX_STOP_STRINGS),
            ("stop_token_ids", MAX_STOP_TOKEN_IDS),
            ("logit_bias", MAX_LOGIT_BIAS_TOKENS),
        ):
            if len(getattr(self, name)) > limit:
                raise InvalidRequestError(
                    f"{name} takes at most {limit} entries, got {len(getattr(self, name))}",
                    param=name,
                )
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequestError(
                f"max_tokens must be an integer >= 1, got {self.max_tokens!r}", param="max_tokens"
            )
        if not 0.0 <= self.temperature <= MAX_TEMPERATURE:  # also rejects NaN
            raise InvalidRequestError(
                f"temperature must be in [0, {MAX_TEMPERATURE:g}] (0 = greedy), "
                f"got {self.temperature!r}",
                param="temperature",
            )
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}", param="top_p")
        if not isinstance(self.top_k, int) or not -1 <= self.top_k <= MAX_TOP_K:
            raise InvalidRequestError(
                f"top_k must be an integer in [-1, {MAX_TOP_K}] (0 and -1 = off), "
                f"got {self.top_k!r}",
                param="top_k",
            )
        if self.seed is not None and not (isinstance(self.seed, int) and 0 <= self.seed < 2**63):
            raise InvalidRequestError(
                f"seed must be an integer in [0, 2**63), got {self.seed!r}", param="seed"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int) and 0 <= value <= MAX_LOGPROBS):
                raise InvalidRequestError(
                    f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {value!r}",
                    param=name,
                )
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequestError(
                f"stop must be a list of non-empty strings, got {list(self.stop)!r}", param="stop"
            )
        for stop in self.stop:
            check_text(stop, "stop")
            if len(stop) > MAX_STOP_STRING_CHARS:
                raise InvalidRequestError(
                    f"stop strings must be at most {MAX_STOP_STRING_CHARS} characters, got "
                    f"one of {len(stop)}",
                    param="stop",
                )
        if any(not isinstance(t, int) for t in self.stop_token_ids):
            raise InvalidRequestError(
                f"stop_token_ids must be integers, got {list(self.stop_token_ids)!r}",
                param="stop_token_ids",
            )
        for name in ("presence_penalty", "frequency_penalty"):
            if not -MAX_PENALTY <= getattr(self, name) <= MAX_PENALTY:  # also rejects NaN
                raise InvalidRequestError(
                    f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], "
                    f"got {getattr(self, name)!r}",
                    param=name,
                )
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise InvalidRequestError(
                f"repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, "
                f"{MAX_REPETITION_PENALTY:g}] (1 = off), "
                f"got {self.repetition_penalty!r}",
                param="repetition_penalty",
            )
        if not (isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens):
            raise InvalidRequestError(
                f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
                f"got {self.min_tokens!r}",
                param="min_tokens",
            )
        if not (
            isinstance(self.resumed_tokens, int) and 0 <= self.resumed_tokens < self.max_tokens
        ):
            raise InvalidRequestError(
                f"resumed_tokens must be an integer in [0, max_tokens={self.max_tokens}), "
                f"got {self.resumed_tokens!r}",
                param="resumed_tokens",
            )
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError(
                f"min_p must be in [0, 1] (0 = off), got {self.min_p!r}", param="min_p"
            )
        for pair in self.logit_bias:
            ok = isinstance(pair, (tuple, list)) and len(pair) == 2 and _is_int(pair[0])
            if not ok or not _is_number(pair[1]) or not abs(pair[1]) <= MAX_LOGIT_BIAS:
                raise InvalidRequestError(
                    f"logit_bias must map token ids to numbers in [-{MAX_LOGIT_BIAS:g}, "
                    f"{MAX_LOGIT_BIAS:g}], got {pair!r}",
                    param="logit_bias",
                )
        counts = Counter(token for token, _ in self.logit_bias)
        if len(counts) != len(self.logit_bias):  # two biases would add up past the range
            twice = sorted(t for t, n in counts.items() if n > 1)
            raise InvalidRequestError(
                f"logit_bias must name each token id once, got {twice[:5]} more than once",
                param="logit_bias",
            )

    def check_against(self, vocab_size: int) -> None:
        """Checks that need the model: token ids must exist in its vocabulary."""
        bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidRequestError(
                f"stop_token_ids must be in [0, {vocab_size}), got {bad}", param="stop_token_ids"
            )
        bad = [t for t, _ in self.logit_bias if not 0 <= t < vocab_size]
        if bad:
            raise InvalidRequestError(
                f"logit_bias token ids must be in [0, {vocab_size}), got {bad[:5]}",
                param="logit_bias",
            )


def check_request(
    prompt_token_ids: list[int],
    params: SamplingParams,
    vocab_size: int,
    max_model_len: int,
    cache_salt: str | None = None,
) -> None:
    """What every request must satisfy on this model, wherever it is checked first (the
    router, before it costs a replica anything; the engine, for any other caller)."""
    if cache_salt is not None:
        if not isinstance(cache_salt, str):
            raise InvalidRequestError(
                f"cache_salt must be a string or None, got {type(cache_salt)}",
                param="cache_salt",
            )
        check_text(cache_salt, "cache_salt")  # hashed as UTF-8 at every prefix lookup
    if not prompt_token_ids:
        raise InvalidRequestError("prompt must contain at least one token", param="prompt")
    check_prompt_fits(len(prompt_token_ids), max_model_len)  # before the scan: it may be long
    bad = [t for t in prompt_token_ids if not (_is_int(t) and 0 <= t < vocab_size)]
    if bad:
        raise InvalidRequestError(
            f"prompt token ids must be integers in [0, {vocab_size}), got {bad[:5]!r}",
            param="prompt",
        )
    params.check_against(vocab_size)
    if params.resumed_tokens >= len(prompt_token_ids):
        raise InvalidRequestError(
            f"resumed_tokens ({params.resumed_tokens}) must be fewer than the prompt's "
            f"{len(prompt_token_ids)} tokens",
            param="resumed_tokens",
        )
    # A resumed request's output so far is in its prompt, and in max_tokens too.
    total = len(prompt_token_ids) - params.resumed_tokens + params.max_tokens
    if total > max_model_len:
        raise InvalidRequestError(
            f"this model's maximum context length is {max_model_len} tokens, and the "
            f"prompt ({len(prompt_token_ids) - params.resumed_tokens} tokens) + max_tokens "
            f"({params.max_tokens}) "
            f"asks for {total}; lower max_tokens or shorten the prompt",
            param="max_tokens",
            code=CONTEXT_LENGTH_EXCEEDED,
        )


def check_prompt_fits(num_prompt_tokens: int, max_model_len: int) -> None:
    """A prompt must leave the context room for at least one generated token. Checked
    before a request's budget is: a prompt that fills the context is the prompt's fault,
    whatever max_tokens or min_tokens say."""
    if num_prompt_tokens >= max_model_len:
        raise InvalidRequestError(
            f"the prompt is {num_prompt_tokens} tokens; this model's maximum context length "
            f"is {max_model_len} tokens, the prompt and at least one generated token; "
            "shorten the prompt",
            param="prompt",
            code=CONTEXT_LENGTH_EXCEEDED,
        )


def default_budget_room(room: int, min_tokens: object) -> int:
    """The room a request that sent no max_tokens may fill: the context's `room` after its
    prompt, at least 1 (a prompt that leaves none is refused by `check_prompt_fits`, as
    the prompt's fault, not a budget the client never sent). A min_tokens past that room
    is refused here, as the context's limit (OpenAI's code), for the same reason."""
    room = max(room, 1)
    if _is_int(min_tokens) and min_tokens > room:
        raise InvalidRequestError(
            f"min_tokens ({min_tokens}) is more than the {room} tokens this model's maximum "
            "context length leaves after the prompt; lower min_tokens or shorten the prompt",
            param="min_tokens",
            code=CONTEXT_LENGTH_EXCEEDED,
        )
    return room


def check_text(text: str, field: str) -> str:
    """`text`, if it is valid Unicode: JSON can spell a lone UTF-16 surrogate ("\\ud800"),
    which no tokenizer, hash or stop-string match takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequestError(
            f"{field}: not valid Unicode text (a lone surrogate at character {e.start})",
            param=field,
        ) from None
    return text


def stops_on_token(token: int, params: SamplingParams, eos_token_ids) -> bool:
    """Whether sampling `token` ends the request by itself (a stop token, or EOS unless
    ignored). Such a token is kept in the output but adds no text."""
    return token in params.stop_token_ids or (not params.ignore_eos and token in eos_token_ids)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _as_tuple(value: object, name: str) -> tuple:
    if isinstance(value, (list, tuple)):
        return tuple(value)
    raise InvalidRequestError(f"{name} must be a list, got {value!r}", param=name)


@dataclass(frozen=True)
class TokenLogprob:
    """The sampled token's log-probability and the top alternatives at that step; for a
    prompt token (`prompt_logprobs`), also its rank in the model's distribution (1: the
    most likely token), which vLLM's API reports."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = field(default=())
    rank: int | None = None
