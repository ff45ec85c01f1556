"""What the LLMEngine tests (and the AsyncEngine ones, around it) share: greedy sampling
params, an engine on the tiny model, and its outputs for a batch of prompts."""

from __future__ import annotations

from workers.engine.config import EngineConfig
from workers.engine.llm_engine import LLMEngine
from workers.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def _engine(model_dir, **overrides) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), **{"num_kv_blocks": 256, **overrides}))


def _outputs(engine: LLMEngine, prompts, params=GREEDY) -> list[list[int]]:
    return [s.output_token_ids for s in engine.generate(prompts, params)]
