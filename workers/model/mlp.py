"""The gated MLP the model families share: down(act(gate(x)) * up(x)), gate and up
fused into one column-parallel projection, down row-parallel."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workers.model import kernels
from workers.model.parallel import ColumnParallelLinear, RowParallelLinear, TPGroup
from workers.torch_threads import kernel_threads


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for rows [gate | up]: one pass of Baton's CPU kernel where it runs."""
    out = _kernel_gated(gate_up, "baton_silu_mul")
    if out is None:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
    return out


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up for rows [gate | up] (GeGLU, transformers' gelu_pytorch_tanh):
    one pass of Baton's CPU kernel where it runs."""
    out = _kernel_gated(gate_up, "baton_gelu_tanh_mul")
    if out is None:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up
    return out


def _kernel_gated(gate_up: torch.Tensor, name: str) -> torch.Tensor | None:
    """The kernel `name`'s act(gate) * up; None where it does not run (not float32 on
    the CPU, halves not whole vectors, no compiler)."""
    half = gate_up.shape[-1] // 2
    fits = gate_up.device.type == "cpu" and gate_up.dtype == torch.float32 and half % 8 == 0
    lib = kernels.library() if fits else None
    if lib is None:
        return None
    gate_up = gate_up.contiguous()
    out = gate_up.new_empty(*gate_up.shape[:-1], half)
    rows = gate_up.numel() // gate_up.shape[-1]
    status = getattr(lib, name)(gate_up.data_ptr(), rows, half, out.data_ptr(), kernel_threads())
    if status != 0:
        raise RuntimeError(f"{name} kernel refused rows of {2 * half} (status {status})")
    return out


# Config hidden_act -> the activation of [gate | up].
ACTIVATIONS = {"silu": silu_mul, "gelu_pytorch_tanh": gelu_tanh_mul}


class GatedMLP(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        hidden_act: str,
        tp: TPGroup,
        dtype: torch.dtype,
    ):
        super().__init__()
        self.act = ACTIVATIONS[hidden_act]
        self.gate_up_proj = ColumnParallelLinear(
            hidden_size, {"gate": intermediate_size, "up": intermediate_size}, tp, dtype=dtype
        )
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, tp, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))
