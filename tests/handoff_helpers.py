"""What the KV handoff tests share: engines on the tiny model, prompts, and the handoff
protocol from a prefill engine to a decode engine, played in process."""

from __future__ import annotations

import torch

from workers.engine.config import EngineConfig
from workers.engine.llm_engine import LLMEngine
from workers.engine.outputs import RequestOutput
from workers.engine.sampling_params import SamplingParams
from workers.kv.blocks import KVBlocks

BLOCK = 16
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)


def _engine(model_dir, **overrides) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), **{"num_kv_blocks": 64, **overrides}))


def _tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 320, (n,), generator=g).tolist()


def _drain(engine: LLMEngine) -> dict[str, list[RequestOutput]]:
    outputs: dict[str, list[RequestOutput]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    return outputs


def _single(engine: LLMEngine, prompt: list[int], params=GREEDY) -> list[RequestOutput]:
    rid = f"single-{engine.stats().num_steps}"
    engine.add_request(rid, prompt, params)
    return _drain(engine)[rid]


def _prefill(prefill: LLMEngine, rid: str, prompt, params=GREEDY, salt=None) -> RequestOutput:
    prefill.add_request(rid, prompt, params, cache_salt=salt, prefill_only=True)
    (out,) = _drain(prefill)[rid]
    return out


def _handoff(
    prefill, decode, rid, prompt, params=GREEDY, salt=None, expect_handoff=True
) -> list[RequestOutput]:
    """The whole protocol; returns prefill's output followed by decode's after the first.

    With `expect_handoff=False` the request must end at prefill (nothing is handed off);
    otherwise prefill must hand it off.
    """
    first = _prefill(prefill, rid, prompt, params, salt)
    if not expect_handoff:
        assert first.handoff is None, f"{rid}: prefill handed off a request meant to end there"
        assert first.finished and first.finish_reason is not None
        return [first]
    assert first.handoff is not None, (
        f"{rid}: prefill ended the request ({first.finish_reason}), nothing was handed off"
    )
    skip = decode.cached_prefix_blocks(list(first.handoff.block_hashes), prompt, salt)
    handle, parts = prefill.export_kv(rid, skip_blocks=skip)
    assert all(isinstance(p, KVBlocks) for p in parts)
    decode.add_prefilled_request(rid, prompt, params, handle, parts, cache_salt=salt)
    assert prefill.release_handoff(rid)
    rest = _drain(decode)[rid]
    # Decode's first output repeats the handed-over token and its text.
    assert (rest[0].new_token_ids, rest[0].new_text) == (first.new_token_ids, first.new_text)
    return [first, *rest[1:]]


def _tokens_of(outputs: list[RequestOutput]) -> list[int]:
    return [t for o in outputs for t in o.new_token_ids]


def _logprobs_of(outputs: list[RequestOutput]) -> list[float]:
    return [lp.logprob for o in outputs for lp in o.new_logprobs]


def _assert_all_free(*engines: LLMEngine) -> None:
    for engine in engines:
        stats = engine.stats()
        assert stats.num_free_blocks == stats.num_total_blocks
        assert stats.handoffs_held == stats.imports_waiting == 0
        assert not engine.has_unfinished()
