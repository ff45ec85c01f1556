"""One request's state inside the engine."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch
from tokenizers import Tokenizer as HFTokenizer

from workers.engine.block_hash import BlockHash
from workers.engine.detokenizer import IncrementalDetokenizer
from workers.engine.grammar_matcher import GrammarMatcher
from workers.engine.sampler import skip_draws
from workers.engine.sampling_params import SamplingParams, TokenLogprob, stops_on_token


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # end-of-sequence token, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context length
    ABORT = "abort"


@dataclass(eq=False)  # identity: `seq in running` must not compare fields
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None = None
    generator: torch.Generator | None = None
    # Tenant key for prefix caching: only requests with the same salt share blocks.
    cache_salt: str | None = None
    # Stop after the first token and hold the blocks for a KV handoff.
    prefill_only: bool = False
    # Structured output: where the output stands in its grammar (None: unconstrained).
    grammar: GrammarMatcher | None = None
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    # With params.prompt_logprobs: entry i is prompt token i + 1's, from the logits at
    # position i (the first token has none).
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    # Tokens (prompt and output alike) whose K/V are in the cache.
    num_computed_tokens: int = 0
    # One block table per KV-cache group (kv_cache_manager.py); empty until the
    # sequence is first given blocks.
    block_tables: list[list[int]] = field(default_factory=list)
    # Chained hashes of the sequence's full blocks so far; tokens never change, so
    # they outlive preemption.
    block_hashes: list[BlockHash] = field(default_factory=list)
    # Leading entries of the block tables registered in the prefix cache.
    num_committed_blocks: int = 0
    # Prompt tokens whose K/V came from the prefix cache when first scheduled.
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    # Speculative decoding (speculative.py): checks in a row in which every draft was
    # wrong, and steps left before the sequence drafts again.
    draft_misses: int = 0
    draft_pause: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    # When the scheduler first ran it (an import: when its blocks were filled) and when
    # it had its first token: with the end, the request's queue, prefill and decode time.
    first_scheduled_time: float | None = None
    first_token_time: float | None = None

    @classmethod
    def start(
        cls,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None,
        tokenizer: HFTokenizer | None,
        vocab_size: int = 0,
    ) -> Sequence:
        """A new request's sequence: its own generator if seeded, and text (stop strings
        included) made as it goes if given the tokenizer. A resumed request's generator
        is past the draws of its output so far (one row of `vocab_size`, the sampler's,
        per token), so it draws next what the lost request would have."""
        detokenizer = (
            IncrementalDetokenizer(
                tokenizer, prompt_token_ids, params.stop, params.skip_special_tokens
            )
            if tokenizer is not None
            else None
        )
        generator = None
        if params.seed is not None:
            generator = torch.Generator().manual_seed(params.seed)
            if not params.greedy:
                skip_draws(generator, params.resumed_tokens, vocab_size)
        return cls(
            request_id,
            prompt_token_ids,
            params,
            detokenizer=detokenizer,
            generator=generator,
            cache_salt=cache_salt,
        )

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_input_tokens(self) -> int:
        """The client's prompt: the prompt less a resumed request's output so far."""
        return len(self.prompt_token_ids) - self.params.resumed_tokens

    @property
    def num_generated(self) -> int:
        """Output tokens, a resumed request's from before its resumption included."""
        return self.params.resumed_tokens + len(self.output_token_ids)

    @property
    def sampled_token_ids(self) -> list[int]:
        """The output as the penalties and min_tokens see it (a resumed request's earlier
        output is the end of its prompt)."""
        resumed = self.params.resumed_tokens
        if not resumed:
            return self.output_token_ids
        return self.prompt_token_ids[len(self.prompt_token_ids) - resumed :] + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def num_prompt_logprobs_due(self) -> int:
        """Prompt logprobs still to compute: positions from len(prompt_logprobs) on must
        then be computed, not taken from the prefix cache, and yield their logits."""
        if self.params.prompt_logprobs is None:
            return 0
        return max(0, self.num_prompt_tokens - 1 - len(self.prompt_logprobs))

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(
        self,
        token: int,
        logprob: TokenLogprob | None,
        now: float,
        eos_token_ids: frozenset[int],
        max_model_len: int,
    ) -> FinishReason | None:
        """Appends a sampled token; returns why it ends the sequence, if it does (finishing
        it, its blocks and its scheduling, is the engine's)."""
        self.output_token_ids.append(token)
        if logprob is not None:
            self.output_logprobs.append(logprob)
        if self.first_token_time is None:
            self.first_token_time = now
        params = self.params
        # Short of min_tokens the sampler never picks a stop token, and stop strings wait.
        check_stop = self.num_generated >= params.min_tokens
        stop_token = stops_on_token(token, params, eos_token_ids)
        if not stop_token and self.grammar is not None:
            # The sampler took the token from those the grammar allows; a complete
            # grammar (or, never expected, a broken one) takes no more.
            self.grammar.accept(token)
        if (
            stop_token
            or (self.detokenizer is not None and self.detokenizer.add_token(token, check_stop))
            or (self.grammar is not None and self.grammar.done)
        ):
            return FinishReason.STOP
        if self.num_generated >= params.max_tokens or self.num_tokens >= max_model_len:
            return FinishReason.LENGTH
        return None
