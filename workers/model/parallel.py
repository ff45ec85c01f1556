"""Megatron-style tensor-parallel layers.

Each layer owns only its rank's shard and loads that shard straight from a
safetensors slice, so no rank ever holds the full weight. With `TPGroup.single()`
every collective is a no-op and the layers are plain dense layers.

KV heads split evenly where the TP degree divides them; a degree that is a multiple
of their count instead replicates each head on degree / heads ranks (as vLLM does),
so a model with one KV head still runs at TP 2. `kv_shards` is that rule.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from workers.model import kernels
from workers.model.block_matmul import (
    BLOCK_SIZE,
    BlockSource,
    WeightBlocks,
    block_rows_limit,
)
from workers.model.config import kv_shards
from workers.model.dense_panels import DensePanels, dense_panels_usable

log = logging.getLogger(__name__)


class TensorSlice(Protocol):
    """What `safe_open(...).get_slice(name)` returns: lazily read, sliceable."""

    def get_shape(self) -> list[int]: ...

    def __getitem__(self, index: Any) -> torch.Tensor: ...


@dataclass(frozen=True)
class TPGroup:
    """This process's place in a tensor-parallel group."""

    rank: int = 0
    size: int = 1
    group: Any = None  # a torch.distributed ProcessGroup when size > 1

    @classmethod
    def single(cls) -> TPGroup:
        return cls()

    def split(self, total: int, what: str) -> tuple[int, int]:
        """(start, length) of this rank's even share of `total` items."""
        if total % self.size:
            raise ValueError(f"{what}={total} is not divisible by the TP degree {self.size}")
        per_rank = total // self.size
        return self.rank * per_rank, per_rank

    def kv_shard(self, num_kv_heads: int) -> tuple[int, int]:
        """(this rank's KV shard, shards): which share of the KV heads it holds."""
        shards = kv_shards(num_kv_heads, self.size)
        return self.rank // (self.size // shards), shards

    def split_heads(self, num_heads: int, head_dim: int) -> tuple[int, int]:
        """(start, length) in features of this rank's KV heads (replicated by kv_shards)."""
        shard, shards = self.kv_shard(num_heads)
        per_shard = num_heads // shards * head_dim
        return shard * per_shard, per_shard

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


def copy_weight(param: torch.Tensor, src: torch.Tensor) -> None:
    if tuple(src.shape) != tuple(param.shape):
        raise RuntimeError(
            f"weight shard shape {tuple(src.shape)} != parameter {tuple(param.shape)}"
        )
    param.data.copy_(src.to(param.dtype))


def native_bf16_matmul() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX512-BF16 or AMX). Without
    either, oneDNN emulates bf16 and a bf16 model runs far slower than fp32."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in probes)


def _can_pack(weight: torch.Tensor) -> bool:
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.bfloat16:
        return native_bf16_matmul()
    return weight.dtype == torch.float32


class PackableLinear(nn.Module):
    """A weight [out, in] that is re-laid out once for fast CPU matmuls.

    F.linear hands an fp32 weight to MKL's sgemm, which re-packs it into panels on
    every call; at decode batch sizes that repacking costs as much as the math. So fp32
    keeps a many-row copy for 2+ rows: Baton's column panels where the CPU has AVX-512
    (dense_panels.py: as fast as oneDNN's on a quiet machine, and a thread taken away
    mid-call leaves its share to the others), oneDNN's pre-blocked copy elsewhere. For
    a single row (one decoding sequence) the faster kernel depends on the CPU: a plain
    transposed fp32 copy [in, out] streams the weights faster on an AVX-512 Xeon,
    oneDNN on an AVX2 EPYC. So fp32 also keeps the transposed copy, and
    `keep_faster_single_row_copy` times both once the model is loaded, keeping one.
    In bf16 (CPUs with AMX or AVX512-BF16) oneDNN's copy is the fastest at every row
    count, ahead of F.linear in bf16; it is the only copy kept. The plain [out, in]
    weight is released. bench/RESULTS.md ("Model kernels") has the figures.
    """

    weight: nn.Parameter | None
    packed: torch.Tensor | None = None
    panels: DensePanels | None = None
    weight_t: torch.Tensor | None = None
    # The GGUF's own blocks of this weight (block_matmul.py), for batches of up to
    # `block_rows_limit()` rows; they replace the transposed one-row copy.
    blocks: WeightBlocks | None = None
    # The bits `blocks` round a one-row input to per block (16 or 8,
    # EngineConfig.activations; block_matmul.py); 32 runs the exact kernel.
    activation_bits: int = 32

    def pack(self) -> None:
        if self.blocks is not None and kernels.library() is None:
            self.blocks = None
        if self.blocks is not None and self.blocks.shape != tuple(self.weight.shape):
            raise ValueError(
                f"GGUF blocks of shape {self.blocks.shape} do not fit the weight "
                f"{tuple(self.weight.shape)}; delete the model folder to convert it again"
            )
        if self.weight is None or not _can_pack(self.weight):
            return
        weight = self.weight.detach()
        if weight.dtype == torch.float32 and dense_panels_usable():
            self.panels = DensePanels.pack(weight)
        else:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        if weight.dtype == torch.float32 and self.blocks is None:
            self.weight_t = weight.t().contiguous()
        self.weight = None

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.blocks is not None and x.shape[0] <= block_rows_limit():
            out = self.blocks.matmul(x, self.activation_bits)
            return out if bias is None else out + bias
        if x.shape[0] == 1 and self.weight_t is not None:
            out = x @ self.weight_t
            return out if bias is None else out + bias
        return self.many_rows(x, bias)

    def many_rows(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x @ weight.T (+ bias) through the copy kept for batches: the panels, oneDNN's
        blocked copy, or the plain weight where neither was made."""
        if self.panels is not None:
            return self.panels.matmul(x, bias)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")
        return F.linear(x, self.weight, bias)


# Weight bytes a timing of one-row matmuls streams: several times any CPU cache, so it
# measures memory bandwidth as decoding does, and a few passes stay under a second.
_TIMING_BYTES = 256 * 2**20
# The many-row copy replaces the transposed one only when clearly faster: the two round
# differently, so processes of one service (replicas, ranks) that timed alike on a noisy
# machine should not pick differently, and a near tie is not worth the change.
_PACKED_MARGIN = 0.9


def keep_faster_single_row_copy(layers: list[PackableLinear], rounds: int = 3) -> str | None:
    """Times one-row matmuls through the fp32 layers' transposed copies and through
    their many-row ones (oneDNN's or the panels; alternating, best of `rounds`) and keeps
    one for every layer: the many-row one where it is clearly faster, else the
    transposed one. Returns the kept kind, "transposed" or "packed" (the many-row copy);
    None when no layer holds both."""
    both = [
        m
        for m in layers
        if (m.packed is not None or m.panels is not None) and m.weight_t is not None
    ]
    if not both:
        return None
    sample, num_bytes = [], 0
    for m in both:
        sample.append(m)
        num_bytes += m.weight_t.numel() * m.weight_t.element_size()
        if num_bytes >= _TIMING_BYTES:
            break
    transposed_s, packed_s = _time_single_row(sample, rounds)
    keep = "packed" if packed_s < _PACKED_MARGIN * transposed_s else "transposed"
    log.info(
        "one-row matmuls over %d MB of weights: transposed %.1f ms, packed %.1f ms; keeping %s",
        num_bytes // 2**20,
        transposed_s * 1e3,
        packed_s * 1e3,
        keep,
    )
    if keep == "packed":
        for m in both:
            m.weight_t = None
    return keep


@torch.inference_mode()
def _time_single_row(layers: list[PackableLinear], rounds: int) -> tuple[float, float]:
    """Best seconds of a one-row pass over `layers`: (transposed copies, packed copies)."""
    rows = [torch.ones(1, m.weight_t.shape[0], dtype=m.weight_t.dtype) for m in layers]

    def one_pass(packed: bool) -> float:
        start = time.perf_counter()
        for m, x in zip(layers, rows, strict=True):
            if packed:
                m.many_rows(x)
            else:
                x @ m.weight_t
        return time.perf_counter() - start

    one_pass(True), one_pass(False)  # first touches fault pages in
    times = [(one_pass(False), one_pass(True)) for _ in range(rounds)]
    return min(t for t, _ in times), min(p for _, p in times)


class ColumnParallelLinear(PackableLinear):
    """Output features split across ranks; the input is replicated.

    `shard_sizes` lists the global output widths of the checkpoint tensors packed
    into this layer (q/k/v or gate/up), so each rank takes its slice of each part:
    an even split, or the (start, length) given in `ranks_rows` (replicated KV heads).
    """

    def __init__(
        self,
        in_features: int,
        shard_sizes: dict[str, int],
        tp: TPGroup,
        bias: bool = False,
        dtype: torch.dtype = torch.float32,
        ranks_rows: dict[str, tuple[int, int]] | None = None,
    ):
        super().__init__()
        self.tp = tp
        self.starts = {}
        self.local_sizes = {}
        self.offsets = {}
        offset = 0
        for shard_id, size in shard_sizes.items():
            rows = (ranks_rows or {}).get(shard_id)
            start, local = rows or tp.split(size, f"output features of {shard_id}")
            self.starts[shard_id] = start
            self.local_sizes[shard_id] = local
            self.offsets[shard_id] = offset
            offset += local
        self.weight = nn.Parameter(
            torch.empty(offset, in_features, dtype=dtype), requires_grad=False
        )
        self._block_parts: dict[str, WeightBlocks] = {}
        self.bias = (
            nn.Parameter(torch.zeros(offset, dtype=dtype), requires_grad=False) if bias else None
        )

    def load_weight(self, param_name: str, src: TensorSlice, shard_id: str) -> None:
        local, start = self.local_sizes[shard_id], self.starts[shard_id]
        dst = getattr(self, param_name).data
        copy_weight(
            dst[self.offsets[shard_id] : self.offsets[shard_id] + local], src[start : start + local]
        )

    def load_blocks(self, src: BlockSource, shard_id: str) -> None:
        """Takes this rank's rows of one part's blocks; the layer uses blocks once every
        part has some, all of one kind."""
        local, start = self.local_sizes[shard_id], self.starts[shard_id]
        self._block_parts[shard_id] = src.read(slice(start, start + local))
        if len(self._block_parts) < len(self.local_sizes):
            return
        parts = [self._block_parts[s] for s in sorted(self.offsets, key=self.offsets.get)]
        self._block_parts = {}
        if len({p.kind for p in parts}) == 1:
            self.blocks = WeightBlocks.cat_rows(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class RowParallelLinear(PackableLinear):
    """Input features split across ranks; partial outputs are summed by all-reduce."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        tp: TPGroup,
        bias: bool = False,
        dtype: torch.dtype = torch.float32,
    ):
        super().__init__()
        self.tp = tp
        self.in_start, local_in = tp.split(in_features, "input features")
        self.weight = nn.Parameter(
            torch.empty(out_features, local_in, dtype=dtype), requires_grad=False
        )
        self.bias = (
            nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False)
            if bias
            else None
        )

    def load_weight(self, param_name: str, src: TensorSlice, shard_id: str | None = None) -> None:
        if param_name == "bias":
            copy_weight(self.bias, src[:])
            return
        local = self.weight.shape[1]
        copy_weight(self.weight, src[:, self.in_start : self.in_start + local])

    def load_blocks(self, src: BlockSource, shard_id: str | None = None) -> None:
        local = self.weight.shape[1]
        # A rank whose columns would split a block runs on its float32 weights alone.
        if self.in_start % BLOCK_SIZE == 0 and local % BLOCK_SIZE == 0:
            self.blocks = src.read(columns=(self.in_start, self.in_start + local))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.tp.all_reduce(self.matmul(x))
        # The bias is added once, after the sum, not once per rank.
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Module):
    """Vocabulary rows split across ranks (padded so every rank has the same count)."""

    def __init__(self, vocab_size: int, dim: int, tp: TPGroup, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.per_rank = -(-vocab_size // tp.size)
        self.vocab_start = tp.rank * self.per_rank
        self.weight = nn.Parameter(
            torch.zeros(self.per_rank, dim, dtype=dtype), requires_grad=False
        )

    def load_weight(self, param_name: str, src: TensorSlice, shard_id: str | None = None) -> None:
        end = min(self.vocab_start + self.per_rank, self.vocab_size)
        if end > self.vocab_start:
            copy_weight(self.weight[: end - self.vocab_start], src[self.vocab_start : end])

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(token_ids, self.weight)
        local = token_ids - self.vocab_start
        outside = (local < 0) | (local >= self.per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding, PackableLinear):
    """Vocab-parallel output projection; full-vocab logits are gathered on every rank."""

    def load_blocks(self, src: BlockSource, shard_id: str | None = None) -> None:
        end = min(self.vocab_start + self.per_rank, self.vocab_size)
        if end > self.vocab_start:
            self.blocks = src.read(slice(self.vocab_start, end)).padded_rows(self.per_rank)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.tp.all_gather_last_dim(self.matmul(hidden))
        return logits[..., : self.vocab_size]
