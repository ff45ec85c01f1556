"""Per-request sampling parameters, validated before anything is scheduled."""

from __future__ import annotations

from dataclasses import dataclass, field

from workers.engine.errors import InvalidRequestError

MAX_LOGPROBS = 20
# Below this, logits / temperature overflows float32; such requests mean greedy.
MIN_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means off
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    logprobs: int | None = None  # top-n alternatives returned with each sampled token
    skip_special_tokens: bool = True

    # Lists are accepted for convenience and frozen into tuples.
    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", _as_tuple(self.stop_token_ids, "stop_token_ids"))
        stop = (self.stop,) if isinstance(self.stop, str) else _as_tuple(self.stop, "stop")
        object.__setattr__(self, "stop", stop)
        for name in ("temperature", "top_p"):
            if not _is_number(getattr(self, name)):
                raise InvalidRequestError(f"{name} must be a number, got {getattr(self, name)!r}")
        for name in ("max_tokens", "top_k", "seed", "logprobs"):
            if isinstance(getattr(self, name), bool):
                raise InvalidRequestError(f"{name} must be an integer, got {getattr(self, name)!r}")
        self._validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE or self.top_k == 1

    def _validate(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequestError(
                f"max_tokens must be an integer >= 1, got {self.max_tokens!r}"
            )
        if not self.temperature >= 0.0:  # also rejects NaN
            raise InvalidRequestError(
                f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequestError(
                f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}"
            )
        if self.seed is not None and not (isinstance(self.seed, int) and 0 <= self.seed < 2**63):
            raise InvalidRequestError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        if self.logprobs is not None and not (
            isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise InvalidRequestError(
                f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}"
            )
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequestError(
                f"stop must be a list of non-empty strings, got {list(self.stop)!r}"
            )
        if any(not isinstance(t, int) for t in self.stop_token_ids):
            raise InvalidRequestError(
                f"stop_token_ids must be integers, got {list(self.stop_token_ids)!r}"
            )

    def check_against(self, vocab_size: int) -> None:
        """Checks that need the model: token ids must exist in its vocabulary."""
        bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidRequestError(f"stop_token_ids must be in [0, {vocab_size}), got {bad}")


def check_request(
    prompt_token_ids: list[int], params: SamplingParams, vocab_size: int, max_model_len: int
) -> None:
    """What every request must satisfy on this model, wherever it is checked first (the
    router, before it costs a replica anything; the engine, for any other caller)."""
    if not prompt_token_ids:
        raise InvalidRequestError("prompt must contain at least one token")
    bad = [t for t in prompt_token_ids if not (isinstance(t, int) and 0 <= t < vocab_size)]
    if bad:
        raise InvalidRequestError(f"prompt token ids must be in [0, {vocab_size}), got {bad[:5]}")
    params.check_against(vocab_size)
    total = len(prompt_token_ids) + params.max_tokens
    if total > max_model_len:
        raise InvalidRequestError(
            f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({params.max_tokens}) = "
            f"{total} exceeds the context length {max_model_len}; shorten the prompt or "
            "lower max_tokens"
        )


def stops_on_token(token: int, params: SamplingParams, eos_token_ids) -> bool:
    """Whether sampling `token` ends the request by itself (a stop token, or EOS unless
    ignored). Such a token is kept in the output but adds no text."""
    return token in params.stop_token_ids or (not params.ignore_eos and token in eos_token_ids)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _as_tuple(value: object, name: str) -> tuple:
    if isinstance(value, (list, tuple)):
        return tuple(value)
    raise InvalidRequestError(f"{name} must be a list, got {value!r}")


@dataclass(frozen=True)
class TokenLogprob:
    """The sampled token's log-probability and the top alternatives at that step."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = field(default=())
