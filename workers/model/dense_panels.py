"""Float32 matmuls of many rows against a weight laid out once in column panels.

A prefill's projections are float32 matmuls of hundreds of rows, compute-bound. oneDNN's
blocked GEMM runs them as fast on a quiet machine, but splits each call evenly between
its threads up front: on a machine the service shares with its own processes (Ray's,
the router's, a peer's), a thread the OS takes away for a moment holds the whole call
until it is back, and every layer's matmuls pay for every such moment.
`csrc/dense_matmul.c` cuts a call into tasks (48 output columns by up to 256 rows) that
threads take as they come free, so the other thread does the waiting one's share.

Each output is one chain of fused multiply-adds along K, the same whatever the row
count or the split. On a model with GGUF blocks the outputs are those of the block
kernel's outer-product path (`block_matmul.py`, 9 to `block_rows_limit()` rows) bit for
bit, so a prompt's K/V do not change as its chunk crosses that limit.

Used where the kernels are built and torch's CPU capability is AVX-512 (the micro-kernel
is written for 32 zmm registers); elsewhere `PackableLinear` keeps oneDNN's copy.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from workers.model import kernels
from workers.torch_threads import kernel_threads


def dense_panels_usable() -> bool:
    """Whether float32 weights are laid out in panels on this machine."""
    return kernels.library() is not None and _avx512()


@functools.cache
def _avx512() -> bool:
    return torch.backends.cpu.get_cpu_capability() == "AVX512"


@dataclass(frozen=True)
class DensePanels:
    """A float32 weight [N, K] as panels [ceil(N / width), K, width] of `width` output
    columns each, the last padded with zeros."""

    panels: torch.Tensor
    out_features: int

    @classmethod
    def pack(cls, weight: torch.Tensor) -> DensePanels:
        lib = kernels.required_library()
        if weight.dtype != torch.float32 or weight.dim() != 2:
            raise RuntimeError(
                f"dense panels take a float32 [N, K] weight, got {weight.dtype} "
                f"{tuple(weight.shape)}"
            )
        weight = weight.contiguous()
        n, k = weight.shape
        width = lib.baton_dense_panel_width()
        panels = torch.empty(-(-n // width), k, width, dtype=torch.float32)
        lib.baton_pack_dense(weight.data_ptr(), n, k, panels.data_ptr())
        return cls(panels, n)

    @property
    def nbytes(self) -> int:
        return self.panels.numel() * self.panels.element_size()

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., K] float32 @ weight.T (+ bias) -> [..., N]."""
        k = self.panels.shape[1]
        if x.dtype != torch.float32 or x.dim() < 1 or x.shape[-1] != k:
            raise RuntimeError(
                f"dense matmul takes float32 [..., {k}], got {x.dtype} {tuple(x.shape)}"
            )
        if bias is not None and (bias.dtype != torch.float32 or bias.shape != (self.out_features,)):
            raise RuntimeError(f"dense matmul's bias must be float32 [{self.out_features}]")
        rows = x.reshape(-1, k).contiguous()
        bias = None if bias is None else bias.contiguous()
        out = torch.empty(rows.shape[0], self.out_features, dtype=torch.float32)
        kernels.required_library().baton_dense_matmul(
            rows.data_ptr(),
            rows.shape[0],
            k,
            self.panels.data_ptr(),
            self.out_features,
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            kernel_threads(),
        )
        return out.view(*x.shape[:-1], self.out_features)
