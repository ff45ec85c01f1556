"""Engine configuration, validated where it is built."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from workers.engine.scheduler import SchedulerConfig
from workers.kv.kv_groups import KVCacheGroups
from workers.kv.transport import check_transport
from workers.model.block_matmul import ACTIVATION_BITS
from workers.model.config import ModelConfig
from workers.runner.tp_group import TP_PLACEMENTS

# EngineConfig.activations' choices, most exact first.
ACTIVATIONS = tuple(ACTIVATION_BITS)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def kv_cache_bytes_per_block(
    cfg: ModelConfig, block_size: int, dtype: torch.dtype, tp_size: int = 1
) -> int:
    """One KV block's bytes on one device (a TP rank holds its share of the KV heads): a
    block holds one KV-cache group's layers (workers/kv/kv_groups.py)."""
    per_token = 2 * cfg.kv_heads_per_rank(tp_size) * cfg.head_dim * dtype.itemsize
    return per_token * block_size * KVCacheGroups.of(cfg).group_size


@dataclass(frozen=True)
class SpeculativeConfig:
    """N-gram speculative decoding (prompt lookup, workers/engine/speculative.py): each
    decoding sequence drafts up to `num_tokens` tokens that followed the latest earlier
    occurrence of its last `lookup_max`..`lookup_min` tokens, and one step checks them all.
    Greedy and seeded output are unchanged; sampled output keeps its distribution. It
    pays where a step is bound by reading the weights (few sequences), so it runs only
    while at most `max_running` sequences do: past that a step is bound by compute,
    which drafts add to.
    """

    num_tokens: int = 4
    lookup_min: int = 1
    lookup_max: int = 3
    max_running: int = 4

    def __post_init__(self) -> None:
        if not 1 <= self.num_tokens <= 16:
            raise ValueError(f"speculative num_tokens must be in [1, 16], got {self.num_tokens}")
        if not 1 <= self.lookup_min <= self.lookup_max <= 16:
            raise ValueError(
                "speculative lookup_min and lookup_max must satisfy 1 <= lookup_min <= "
                f"lookup_max <= 16, got {self.lookup_min} and {self.lookup_max}"
            )
        if self.max_running < 1:
            raise ValueError(f"speculative max_running must be >= 1, got {self.max_running}")


@dataclass(frozen=True)
class EngineConfig:
    model: str
    block_size: int = 16
    # KV-cache memory per engine; the number of blocks follows from it unless
    # num_kv_blocks pins it (tests use tiny pools to force preemption).
    kv_cache_bytes: int = 512 * 2**20
    num_kv_blocks: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    max_model_len: int | None = None  # defaults to the model's context length
    device: str = "auto"  # "cpu", "cuda", "cuda:N" or "auto"
    # "auto": float32 on CPU, bfloat16 on CUDA. On a CPU with AMX or AVX512-BF16,
    # bfloat16 doubles batched decode and prefill throughput (bench/engine.py --dtype);
    # on one without, it is far slower than float32.
    dtype: str = "auto"
    # torch intra-op threads: of the engine's process when tensor_parallel_size is 1
    # (None leaves torch's setting), else of each rank (None means 1). "auto": the
    # machine's cores, shared step by step with the other engines on it (core_share.py);
    # each TP rank takes an even part of them.
    num_threads: int | Literal["auto"] | None = None
    # Ranks (Ray actors, one device each) the attention and MLP weights are split over.
    tensor_parallel_size: int = 1
    # Where the ranks go: "own", a placement group the engine reserves on its node;
    # "current", bundles 1..tp of the placement group the engine's process was placed
    # in (a Serve replica's `placement_group_bundles`: reserved with the replica, so it
    # lands only where its ranks fit, and an autoscaler sees the whole demand).
    tp_placement: str = "own"
    seed: int = 0
    # Reuse the K/V of prompt blocks computed before (same model, same cache salt).
    enable_prefix_caching: bool = True
    # The model's identity in block hashes; every process that must agree on them
    # (router, replicas) names it alike. None: derived from the folder's name and
    # contents (workers.model.loader.model_identity), the same on every node.
    model_id: str | None = None
    # A prefill-only request's blocks are held this long for a decode engine to
    # import them (unless released sooner), so an abandoned handoff never strands them.
    handoff_timeout_s: float = 30.0
    # How exported blocks leave a prefill engine (workers.kv.transport.TRANSPORTS).
    kv_transport: str = "object_store"
    # False: outputs carry token ids only (empty text) and requests with stop strings
    # are refused; for a front end that detokenizes and applies stop strings itself
    # (Baton's router), so the engine loop spends nothing on text.
    detokenize: bool = True
    # None: one token per sequence and step.
    speculative: SpeculativeConfig | None = None
    # How one sequence's decode matmuls from a GGUF's weight blocks take their input
    # (csrc/rounded_matmul.c). "exact": float32 throughout, the fidelity reference.
    # "int16": rounded to 16 bits per block of 32 (off by at most 1/65534 of the block's
    # largest value) and multiplied in integers: a faster single stream, whose greedy
    # output parts from the exact path's at rare near-ties. "int8": faster still, and it
    # parts at near-ties often (bench/activation_agreement.py measures both).
    activations: str = "exact"

    @property
    def activation_bits(self) -> int:
        """The bits one-row block matmuls round their input to; 32: exact."""
        return ACTIVATION_BITS[self.activations]

    def __post_init__(self) -> None:
        if self.activations not in ACTIVATIONS:
            raise ValueError(
                f"activations must be one of {', '.join(ACTIVATIONS)}, got {self.activations!r}"
            )
        if self.block_size < 1 or self.block_size > 1024:
            raise ValueError(f"block_size must be in [1, 1024], got {self.block_size}")
        if self.kv_cache_bytes < 1:
            raise ValueError(f"kv_cache_bytes must be >= 1, got {self.kv_cache_bytes}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(
                f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {self.dtype!r}"
            )
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.tp_placement not in TP_PLACEMENTS:
            raise ValueError(
                f"tp_placement must be one of {TP_PLACEMENTS}, got {self.tp_placement!r}"
            )
        if self.num_threads not in (None, "auto") and (
            not isinstance(self.num_threads, int) or self.num_threads < 1
        ):
            raise ValueError(f"num_threads must be >= 1 or 'auto', got {self.num_threads!r}")
        if self.model_id is not None and not self.model_id:
            raise ValueError(
                "model_id must be a non-empty name, or None to derive it from the files"
            )
        if not self.handoff_timeout_s > 0:  # also rejects NaN
            raise ValueError(f"handoff_timeout_s must be > 0, got {self.handoff_timeout_s!r}")
        check_transport(self.kv_transport)
        # The scheduler's own limits, refused here already (what builds the engine's).
        SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens)
        if not (self.device in ("auto", "cpu") or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")

    def resolved_device(self) -> str:
        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device

    def resolved_model_id(self) -> str:
        from workers.model.loader import model_identity

        return self.model_id or model_identity(self.model)

    def resolved_dtype(self) -> torch.dtype:
        if self.dtype != "auto":
            return _DTYPES[self.dtype]
        return torch.float32 if self.resolved_device() == "cpu" else torch.bfloat16

    def resolved_dtype_name(self) -> str:
        """ "float32", "bfloat16" or "float16"."""
        return str(self.resolved_dtype()).removeprefix("torch.")

    def num_blocks(self, model: ModelConfig) -> int:
        """KV-cache blocks per device: `num_kv_blocks`, or as many as `kv_cache_bytes`
        holds."""
        if self.num_kv_blocks is not None:
            return self.num_kv_blocks
        tp = self.tensor_parallel_size
        per_block = kv_cache_bytes_per_block(model, self.block_size, self.resolved_dtype(), tp)
        if self.kv_cache_bytes < per_block:
            raise ValueError(
                f"kv_cache_bytes={self.kv_cache_bytes} holds no KV block of this model "
                f"({per_block} bytes per block of {self.block_size} tokens on each device); "
                "raise kv_cache_bytes"
            )
        return self.kv_cache_bytes // per_block

    def context_length(self, model: ModelConfig) -> int:
        """Tokens one request may span, prompt and output: the model's context length, or
        `max_model_len` below it, and never more than the KV cache holds, so that any
        request within it can run. ValueError if `max_model_len` asks for more than the
        cache holds (as vLLM refuses to start)."""
        model_max = model.max_position_embeddings
        limit = min(self.max_model_len or model_max, model_max)
        cache_tokens = self._cache_tokens(model, limit)
        if self.max_model_len is not None and limit > cache_tokens:
            raise ValueError(
                f"max_model_len={self.max_model_len} is more than the KV cache's "
                f"{cache_tokens} tokens (kv_cache_bytes={self.kv_cache_bytes}); raise "
                "kv_cache_bytes or lower max_model_len"
            )
        return min(limit, cache_tokens)

    def _cache_tokens(self, model: ModelConfig, limit: int) -> int:
        """The longest sequence, up to `limit`, whose blocks the whole pool holds at
        once (a sliding group holding its window and a step's tokens)."""
        groups, blocks = KVCacheGroups.of(model), self.num_blocks(model)

        def fits(n: int) -> bool:
            return groups.blocks_needed(n, self.max_num_batched_tokens, self.block_size) <= blocks

        lo, hi = 0, limit  # fits(lo); the answer is in [lo, hi]
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        return lo
