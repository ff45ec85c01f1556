"""The engine package's public face: what serving code (serve_app, bench) may use.

`AsyncEngine` is the way in for a server: the engine is single-threaded, and only its
engine thread touches the `LLMEngine` it wraps. `LLMEngine` itself is for a caller that
owns its thread (`baton generate --local`, benchmarks). The rest is the vocabulary of
requests, outputs, errors and the KV handoff that crosses between processes.
"""

from workers.engine.async_engine import AsyncEngine
from workers.engine.block_hash import BlockHash, hash_full_blocks, root_hash
from workers.engine.config import (
    ACTIVATIONS,
    EngineConfig,
    SpeculativeConfig,
    kv_cache_bytes_per_block,
)
from workers.engine.detokenizer import IncrementalDetokenizer
from workers.engine.grammar_compiler import GrammarCompiler
from workers.engine.handoff.handle import KVHandle, StalePrefixError
from workers.engine.handoff.pull_budget import PullBudget
from workers.engine.llm_engine import LLMEngine
from workers.engine.outputs import EngineStats, RequestOutput, RequestTiming, merge_outputs
from workers.engine.sampling_params import (
    MAX_LOGIT_BIAS_TOKENS,
    MAX_LOGPROBS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
    TokenLogprob,
    check_prompt_fits,
    check_request,
    check_text,
    default_budget_room,
    stops_on_token,
)
from workers.engine.scheduler import SchedulerConfig
from workers.engine.sequence import FinishReason
from workers.engine.structured_output import StructuredOutput
from workers.engine.thread_policy import yield_to_engine_threads
from workers.errors import (
    CONTEXT_LENGTH_EXCEEDED,
    EngineDeadError,
    EngineOverloadedError,
    InvalidRequestError,
)
from workers.kv.transport import KVPart, KVRef, KVTransferError, check_transport

__all__ = [
    "ACTIVATIONS",
    "CONTEXT_LENGTH_EXCEEDED",
    "MAX_LOGIT_BIAS_TOKENS",
    "MAX_LOGPROBS",
    "MAX_STOP_STRINGS",
    "MAX_STOP_TOKEN_IDS",
    "AsyncEngine",
    "BlockHash",
    "EngineConfig",
    "EngineDeadError",
    "EngineOverloadedError",
    "EngineStats",
    "FinishReason",
    "GrammarCompiler",
    "IncrementalDetokenizer",
    "InvalidRequestError",
    "KVHandle",
    "KVPart",
    "KVRef",
    "KVTransferError",
    "LLMEngine",
    "PullBudget",
    "RequestOutput",
    "RequestTiming",
    "SamplingParams",
    "SchedulerConfig",
    "SpeculativeConfig",
    "StalePrefixError",
    "StructuredOutput",
    "TokenLogprob",
    "check_prompt_fits",
    "check_request",
    "check_text",
    "check_transport",
    "default_budget_room",
    "hash_full_blocks",
    "kv_cache_bytes_per_block",
    "merge_outputs",
    "root_hash",
    "stops_on_token",
    "yield_to_engine_threads",
]
