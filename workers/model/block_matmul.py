"""Small-batch matmuls straight from a GGUF's quantized weight blocks.

A model converted from a GGUF (gguf_import.py) keeps the file's blocks, repacked into
Q4_1, Q8_0 or Q8_16 (gguf_repack.py), beside its float32 weights. Decoding a few
sequences streams every weight once per step, so its speed is memory bandwidth: float32
weights cost 4 bytes each, Q4_1 0.625, Q8_0 1.06 and Q8_16 (Q8_0's bytes with a scale
per 16 weights, Q6_K's form) 1.125. `csrc/block_matmul.c` reads the blocks and
multiplies in float32 in registers, which is the same arithmetic as on the dequantized
weights up to rounding order (the blocks *are* the model: the float32 copy was made
from them). Batches of over 8 rows are compute-bound; the kernel then dequantizes a
few weight rows at a time into cache and runs an outer-product micro-kernel over all
rows at once (16 rows a vector where the CPU has AVX-512, 8 on AVX2), which beats
oneDNN's float32 GEMM up to 128 rows where oneDNN has AVX2 alone and up to 64 where it
has AVX-512 (`block_rows_limit`); larger batches take the float32 copy (dense_panels.py
on AVX-512, oneDNN's elsewhere). A one-row call may
first round x to 16 or 8 bits per block and multiply in integers
(`csrc/rounded_matmul.c`, `EngineConfig.activations`): faster, and no longer the
float32 arithmetic.

The kernel is one of Baton's CPU kernels (kernels.py); without a compiler or AVX2 the
model runs on its float32 weights alone, as every non-GGUF model does.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from workers.model import kernels
from workers.torch_threads import kernel_threads

BLOCK_SIZE = 32
# Where a converted folder keeps its blocks: in a folder of its own, so that loaders
# globbing the model folder's *.safetensors for weights never take it for one.
BLOCKS_FILE = "gguf_blocks/blocks.safetensors"
# The file's metadata key for a digest of the float32 weights it was written beside
# (loader.weights_digest): blocks of replaced weights must not be used.
WEIGHTS_DIGEST_KEY = "weights_digest"
# And for the block kinds its writer knew: a file written before a kind existed lacks
# the tensors repacked into it, so it is written again.
BLOCK_KINDS_KEY = "block_kinds"
# Bytes of one block of 32 weights in `qs` (the scales and minimums are kept apart).
QS_BYTES = {"q4_1": 16, "q8_0": 32, "q8_16": 32}
# Scales per block of 32: q8_16 has one per 16 weights.
SCALES_PER_BLOCK = {"q4_1": 1, "q8_0": 1, "q8_16": 2}
KIND_IDS = {"q4_1": 0, "q8_0": 1, "q8_16": 2}  # csrc/block_kinds.h's enum
KNOWN_KINDS = ",".join(sorted(QS_BYTES))
# Rows up to which the block kernel beats oneDNN's float32 one over a whole model's
# weights (not cached), by the vector width oneDNN has (torch's CPU capability): past
# it, the float32 matmul's better reuse of each weight wins. On AVX-512 both run at
# that width, and the block kernel wins to 64 rows (1.2x at 32, even at 128;
# bench/RESULTS.md, "Model kernels").
BLOCK_ROWS_BY_CAPABILITY = {"AVX512": 64}
BLOCK_ROWS_DEFAULT = 128
# How a one-row matmul takes its input (EngineConfig.activations): float32 as it is, or
# rounded to 16 or 8 bits per block of 32 (csrc/rounded_matmul.c); the value is the bits.
ACTIVATION_BITS = {"exact": 32, "int16": 16, "int8": 8}
_BITS = frozenset(ACTIVATION_BITS.values())


@functools.cache
def block_rows_limit(capability: str | None = None) -> int:
    """Rows up to which a matmul takes the block kernel, on a CPU of this capability
    (torch.backends.cpu.get_cpu_capability(), this one's by default)."""
    if capability is None:
        capability = torch.backends.cpu.get_cpu_capability()
    return BLOCK_ROWS_BY_CAPABILITY.get(capability, BLOCK_ROWS_DEFAULT)


@dataclass(frozen=True)
class WeightBlocks:
    """A weight [N, K] as GGUF blocks of 32 along K: `qs` uint8 [N, K / 32 * QS_BYTES],
    `scale` float32 [N, K / 32 * SCALES_PER_BLOCK] and (Q4_1) `min` float32 [N, K / 32]."""

    kind: str
    qs: torch.Tensor
    scale: torch.Tensor
    min: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.kind not in QS_BYTES:
            raise ValueError(f"block kind {self.kind!r} is not one of {sorted(QS_BYTES)}")
        rows, blocks = self.shape[0], self.shape[1] // BLOCK_SIZE
        assert self.qs.dtype == torch.uint8 and self.scale.dtype == torch.float32
        assert self.scale.shape[1] % SCALES_PER_BLOCK[self.kind] == 0
        assert tuple(self.qs.shape) == (rows, blocks * QS_BYTES[self.kind])
        assert (self.min is None) == (self.kind != "q4_1")

    @property
    def shape(self) -> tuple[int, int]:
        rows, scales = self.scale.shape
        return rows, scales // SCALES_PER_BLOCK[self.kind] * BLOCK_SIZE

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors())

    def padded_rows(self, rows: int) -> WeightBlocks:
        """With zero rows (zero weights) appended up to `rows`."""
        extra = rows - self.shape[0]
        return WeightBlocks(
            self.kind,
            *(
                None if t is None else torch.cat([t, t.new_zeros(extra, t.shape[1])])
                for t in (self.qs, self.scale, self.min)
            ),
        )

    @staticmethod
    def cat_rows(parts: list[WeightBlocks]) -> WeightBlocks:
        assert len({p.kind for p in parts}) == 1, "blocks of one weight share a kind"
        mins = None if parts[0].min is None else torch.cat([p.min for p in parts])
        return WeightBlocks(
            parts[0].kind,
            torch.cat([p.qs for p in parts]),
            torch.cat([p.scale for p in parts]),
            mins,
        )

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K], as GGUF's reference dequantizes it."""
        rows, scales = self.scale.shape
        if self.kind != "q4_1":  # int8 q, one scale per run of 32 (q8_0) or 16 (q8_16)
            q = self.qs.view(torch.int8).view(rows, scales, -1).float()
            return (q * self.scale[..., None]).view(self.shape)
        qs = self.qs.view(rows, scales, QS_BYTES[self.kind])
        q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).float()
        return (q * self.scale[..., None] + self.min[..., None]).view(self.shape)

    @functools.cached_property
    def _kernel_args(self) -> tuple[int, int, int, int, int, int | None]:
        """(kind id, N, K, then the qs, scale and min addresses): what every call passes,
        worked out once (a decode step makes ~120 calls; the tensors never move)."""
        mins = None if self.min is None else self.min.data_ptr()
        n, k = self.shape
        return KIND_IDS[self.kind], n, k, self.qs.data_ptr(), self.scale.data_ptr(), mins

    def __getstate__(self) -> dict:
        # Addresses are this process's: a copy or another process works them out anew.
        return {k: v for k, v in self.__dict__.items() if k != "_kernel_args"}

    def matmul(self, x: torch.Tensor, activation_bits: int = 32) -> torch.Tensor:
        """x [M, K] float32 @ weight.T -> [M, N]; with `activation_bits` 16 or 8 a single
        row's blocks are rounded to that many bits first (csrc/rounded_matmul.c; more
        rows stay exact), with 32 none are."""
        lib = kernels.required_library()
        kind, n, k, qs, scale, mins = self._kernel_args
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != k:
            raise RuntimeError(f"block matmul takes float32 [M, {k}], got {x.shape}")
        x = x.contiguous()
        out = torch.empty(x.shape[0], n, dtype=torch.float32)
        if activation_bits not in _BITS:
            raise ValueError(
                f"activation_bits must be one of {sorted(ACTIVATION_BITS.values())}, "
                f"got {activation_bits}"
            )
        rounded = () if activation_bits == 32 else (activation_bits,)
        fn = lib.baton_block_matmul_rounded if rounded else lib.baton_block_matmul
        status = fn(
            *rounded,
            kind,
            x.data_ptr(),
            x.shape[0],
            k,
            qs,
            scale,
            mins,
            out.data_ptr(),
            n,
            kernel_threads(),
        )
        if status != 0:
            raise RuntimeError(f"block matmul failed (status {status}) for x {tuple(x.shape)}")
        return out

    def _tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.qs, self.scale, self.min) if t is not None]


class BlockSource:
    """One weight's blocks in an open blocks file, read a slice at a time (a TP rank
    reads only its shard)."""

    def __init__(self, f, name: str, kind: str):
        self.f, self.name, self.kind = f, name, kind
        if kind not in QS_BYTES:
            raise ValueError(f"{name}: block kind {kind!r} is not one of {sorted(QS_BYTES)}")

    @property
    def shape(self) -> tuple[int, int]:
        rows, scales = self.f.get_slice(f"{self.name}.scale").get_shape()
        return rows, scales // SCALES_PER_BLOCK[self.kind] * BLOCK_SIZE

    def read(
        self, rows: slice = slice(None), columns: tuple[int, int] | None = None
    ) -> WeightBlocks:
        """Weight rows `rows` and columns [start, end) (block-aligned; all by default)."""
        start, end = columns or (0, self.shape[1])
        if start % BLOCK_SIZE or end % BLOCK_SIZE:
            raise ValueError(f"columns [{start}, {end}) do not fall on {BLOCK_SIZE}-blocks")
        b0, b1 = start // BLOCK_SIZE, end // BLOCK_SIZE
        size = QS_BYTES[self.kind]

        def part(suffix: str, lo: int, hi: int) -> torch.Tensor:
            return self.f.get_slice(f"{self.name}.{suffix}")[rows, lo:hi].contiguous()

        per = SCALES_PER_BLOCK[self.kind]
        mins = part("min", b0, b1) if self.kind == "q4_1" else None
        return WeightBlocks(
            self.kind, part("qs", b0 * size, b1 * size), part("scale", b0 * per, b1 * per), mins
        )
