"""N-gram speculative decoding (prompt lookup): drafts from the sequence's own tokens.

Text repeats itself: names, code identifiers, quoted passages, a summary echoing its
source. So the tokens that followed an earlier occurrence of a sequence's last few
tokens are a free guess at what comes next. The engine appends a decoding sequence's
drafts to its step as a short chunk; the model's logits at every position of the chunk
are sampled as if each draft before them had been accepted, and the sequence keeps the
sampled tokens up to the first one that differs from its draft (that one too: it is the
model's own choice there). A step thus yields 1 to `num_tokens + 1` tokens per sequence
for about the price of one while a step is bound by reading the weights.

Every kept token is sampled from the model's distribution given the tokens before it,
with the request's own parameters and history, so greedy output is what it is without
speculation (up to float rounding: the rows are computed by multi-row kernels). A seeded
request's generator is rewound past the rows it did not keep, so its tokens are the ones
it gets without speculation too.
"""

from __future__ import annotations

from array import array
from collections.abc import Collection
from collections.abc import Sequence as Tokens

import torch

from workers.engine.config import SpeculativeConfig
from workers.engine.sampler import sample, skip_draws
from workers.engine.sampling_params import TokenLogprob
from workers.engine.sequence import Sequence

_INT32 = 4  # bytes per token in the search buffer
# Steps a sequence skips drafting after its 1st, 2nd, ... check in a row in which every
# draft was wrong (the last entry for all later ones): text that does not repeat itself
# then pays for about one check in 16 steps (a check of 4 drafts costs a single stream
# ~18% more than a plain step), and text that starts repeating is drafted again soon.
_PAUSES = (0, 1, 3, 7, 15)


def ngram_drafts(
    tokens: Tokens[int], num_tokens: int, lookup_min: int, lookup_max: int
) -> list[int]:
    """`num_tokens` tokens that followed the latest earlier occurrence of the longest
    suffix of `tokens` of `lookup_max` down to `lookup_min` tokens; [] if none."""
    n_total = len(tokens)
    if n_total < 2:
        return []
    # bytes.rfind is a C substring search; a match must start on a token boundary.
    buf = array("i", tokens).tobytes()
    for n in range(min(lookup_max, n_total - 1), lookup_min - 1, -1):
        suffix = buf[-n * _INT32 :]
        # An occurrence must end before the last token, so that a token follows it.
        end = (n_total - 1) * _INT32
        pos = buf.rfind(suffix, 0, end)
        while pos > 0 and pos % _INT32:
            pos = buf.rfind(suffix, 0, pos + len(suffix) - 1)
        if pos >= 0 and pos % _INT32 == 0:
            # What followed the occurrence, continued past the known tokens by the same
            # copy rule (token x is token x - period), so that a loop drafts in full.
            start = pos // _INT32 + n
            drafts: list[int] = []
            for x in range(start, start + num_tokens):
                drafts.append(tokens[x] if x < n_total else drafts[x - n_total])
            return drafts
    return []


class NgramSpeculator:
    """Proposes each decoding sequence's drafts for the coming step."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int):
        self.config = config
        self.max_model_len = max_model_len
        self.num_draft_tokens = 0  # drafts the model checked
        self.num_accepted_tokens = 0  # of those, the ones it agreed with

    def propose(self, running: list[Sequence]) -> dict[Sequence, list[int]]:
        cfg = self.config
        if len(running) > cfg.max_running:
            return {}
        drafts = {}
        for seq in running:
            if seq.num_uncomputed_tokens != 1 or seq.prefill_only:
                continue  # prefilling, or a handoff that stops at its first token
            if seq.draft_pause:
                seq.draft_pause -= 1
                continue
            # Room for the drafts and the token sampled after them.
            room = (
                min(
                    seq.params.max_tokens - seq.num_generated,
                    self.max_model_len - seq.num_tokens,
                )
                - 1
            )
            if room < 1:
                continue
            found = ngram_drafts(
                seq.prompt_token_ids + seq.output_token_ids,
                min(cfg.num_tokens, room),
                cfg.lookup_min,
                cfg.lookup_max,
            )
            if found:
                drafts[seq] = found
        return drafts

    def record(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        """Counts a check of `seq`'s drafts, and pauses its drafting after misses."""
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        if num_accepted:
            seq.draft_misses = 0
        else:
            seq.draft_misses += 1
            seq.draft_pause = _PAUSES[min(seq.draft_misses, len(_PAUSES)) - 1]


def sample_with_drafts(
    logits: torch.Tensor,
    sequences: list[tuple[Sequence, tuple[int, ...]]],
    default_generator: torch.Generator,
    eos_token_ids: Collection[int],
    mask: tuple[list[int], torch.Tensor] | None = None,
) -> list[list[tuple[int, TokenLogprob | None]]]:
    """Samples a step's logits: one row per sequence and per draft it carries, each with
    the history its position would have if the drafts before it are accepted. Returns
    each sequence's (token, logprob) picks in position order, up to and including the
    first that differs from its draft. `mask`: the grammar-constrained rows, in that row
    order (token_masks.py).

    A seeded request's generator ends as if only the kept rows had drawn (each random
    row draws once, in order), so its tokens are the ones it gets without speculation,
    in any batch."""
    rows = [(seq, drafts[:j]) for seq, drafts in sequences for j in range(len(drafts) + 1)]
    seeded = {
        id(seq): seq.generator.get_state()
        for seq, drafts in sequences
        if drafts and seq.generator is not None and not seq.params.greedy
    }
    result = sample(
        logits,
        [seq.params for seq, _ in rows],
        [seq.generator for seq, _ in rows],
        default_generator,
        [
            (
                seq.prompt_token_ids,
                seq.sampled_token_ids + list(before) if before else seq.sampled_token_ids,
            )
            for seq, before in rows
        ],
        eos_token_ids,
        mask,
    )
    picked = iter(zip(result.token_ids, result.logprobs, strict=True))
    picks = []
    for seq, drafts in sequences:
        mine = [next(picked) for _ in range(len(drafts) + 1)]
        kept = next((j + 1 for j, d in enumerate(drafts) if mine[j][0] != d), len(mine))
        if id(seq) in seeded and kept < len(mine):
            seq.generator.set_state(seeded[id(seq)])
            skip_draws(seq.generator, kept, logits.shape[1])
        picks.append(mine[:kept])
    return picks
