"""RMSNorm with the residual add, through Baton's CPU kernel where it runs.

`RMSNorm` is the Llama family's (weight times the normalized input, in the model's
dtype); a family whose norm differs (Gemma 3's 1 + weight in float32) keeps its own
module and shares `fused_rms_norm`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workers.model import kernels
from workers.torch_threads import kernel_threads


def fused_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(x / rms(x) * weight, None); given the residual stream, the same of x + residual
    and the sum: one pass of Baton's CPU kernel. None where the kernel does not run
    (not float32 on the CPU, rows not whole vectors, no compiler)."""
    fits = (
        x.device.type == "cpu" and x.dtype == weight.dtype == torch.float32 and x.shape[-1] % 8 == 0
    )
    lib = kernels.library() if fits else None
    if lib is None:
        return None
    # Bound to names: a temporary's memory could go before the kernel reads it.
    x = x.contiguous()
    residual = None if residual is None else residual.contiguous()
    out = torch.empty_like(x)
    summed = None if residual is None else torch.empty_like(x)
    status = lib.baton_rms_norm(
        x.data_ptr(),
        None if residual is None else residual.data_ptr(),
        weight.data_ptr(),
        x.numel() // x.shape[-1],
        x.shape[-1],
        eps,
        out.data_ptr(),
        None if summed is None else summed.data_ptr(),
        kernel_threads(),
    )
    if status != 0:
        raise RuntimeError(f"rms_norm kernel refused rows of {x.shape[-1]} (status {status})")
    return out, summed


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """rms_norm(x); given the residual stream, (rms_norm(x + residual), x + residual):
        the add and the norm are one pass of Baton's CPU kernel where it runs."""
        fused = fused_rms_norm(x, self.weight, self.eps, residual)
        if fused is not None:
            out, summed = fused
            return out if residual is None else (out, summed)
        if residual is None:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        summed = x + residual
        return F.rms_norm(summed, (x.shape[-1],), self.weight, self.eps), summed
