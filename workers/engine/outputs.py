"""What an engine reports: each step's output per request, and its running stats."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from workers.engine.handoff.handle import KVHandle
from workers.engine.sampling_params import TokenLogprob
from workers.engine.sequence import FinishReason


@dataclass(frozen=True)
class RequestTiming:
    """Where one request's time went in one engine, in seconds: waiting to be scheduled,
    from then to its first token (prefill), and from that to its end (decode). A decode
    engine's import counts as scheduled when its blocks are filled."""

    queued_s: float
    prefill_s: float
    decode_s: float

    @property
    def inference_s(self) -> float:
        return self.prefill_s + self.decode_s


@dataclass
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[TokenLogprob] = field(default_factory=list)
    finished: bool = False
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # Set when a prefill-only request stops for a KV handoff (finished, with no
    # finish_reason: the request goes on at a decode engine); the K/V: `export_kv`.
    handoff: KVHandle | None = None
    # On a request's first output, if it asked (SamplingParams.prompt_logprobs): prompt
    # token i + 1's logprob at index i.
    prompt_logprobs: list[TokenLogprob] | None = None
    # On the output that ends the request in this engine (its handoff, on prefill).
    timing: RequestTiming | None = None


def merge_outputs(outputs: list[RequestOutput]) -> RequestOutput:
    """Consecutive outputs of one request as one: their tokens, text and logprobs in
    order, the first one's prompt logprobs, the last one's state (finished, finish reason,
    counts, handoff)."""
    return replace(
        outputs[-1],
        new_token_ids=[t for o in outputs for t in o.new_token_ids],
        new_text="".join(o.new_text for o in outputs),
        new_logprobs=[lp for o in outputs for lp in o.new_logprobs],
        prompt_logprobs=outputs[0].prompt_logprobs,
    )


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    num_preemptions: int
    num_steps: int
    num_generated_tokens: int
    prefix_cache_queries: int  # tokens looked up in the prefix cache
    prefix_cache_hits: int  # of those, tokens found
    prefix_cache_hit_rate: float
    handoffs_held: int  # prefill-only requests whose blocks wait for a decode engine
    handoffs_expired: int  # of those, released by handoff_timeout_s rather than by decode
    imports_waiting: int  # prefilled requests waiting for blocks to import into
    kv_blocks_exported: int
    kv_blocks_imported: int
    # What those exports would have moved if every layer kept the whole context: with
    # sliding-window layers, a handoff moves only the blocks their windows reach.
    kv_blocks_exported_all_layers: int
    kv_blocks_reused_for_import: int  # taken from this engine's prefix cache instead
    kv_export_s: float  # seconds copying blocks out for handoffs, in total
    kv_import_s: float  # seconds writing handed-over blocks in, in total
    # Speculative decoding: draft tokens checked, and of those, tokens the model agreed on.
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
