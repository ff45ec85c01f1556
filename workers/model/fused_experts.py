"""A mixture-of-experts layer's experts: every expert's gated MLP, its fused gate/up
projection `gate_up[e]` [2 * I, hidden] and its `down[e]` [hidden, I], each a
PackableLinear, so that on CPU an expert's matmul runs from the same re-laid-out copies
as a dense layer's (F.linear would repack the weight on every call). With tensor
parallelism every rank holds its slice of every expert (I split as the dense MLP's is:
gate/up rows column-parallel, down columns row-parallel) and loads only that slice; the
caller sums the ranks' partial outputs.

A step's tokens are grouped by expert: each expert that some token picked runs its rows
as one matmul, weighted by the router, and adds them back into place (index_add), experts
in ascending order, as transformers' own loop does, so the sums round alike.
"""

from __future__ import annotations

import torch
from torch import nn

from workers.model.mlp import ACTIVATIONS
from workers.model.parallel import PackableLinear, TensorSlice, TPGroup

# Checkpoint projection names (Qwen-MoE's and Mixtral's) -> the part of an expert.
_PARTS = {
    "gate_proj": "gate",
    "w1": "gate",
    "up_proj": "up",
    "w3": "up",
    "down_proj": "down",
    "w2": "down",
}


class FusedExperts(nn.Module):
    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        hidden_act: str,
        tp: TPGroup,
        dtype: torch.dtype,
    ):
        super().__init__()
        self.num_experts = num_experts
        self.act = ACTIVATIONS[hidden_act]
        self.start, self.size = tp.split(intermediate_size, "moe_intermediate_size")
        self.gate_up = nn.ModuleList(
            _linear(2 * self.size, hidden_size, dtype) for _ in range(num_experts)
        )
        self.down = nn.ModuleList(
            _linear(hidden_size, self.size, dtype) for _ in range(num_experts)
        )
        self._loaded: set[tuple[int, str]] = set()

    def load_subtensor(self, name: str, src: TensorSlice) -> None:
        """Loads checkpoint tensor `<expert>.<projection>.weight` (relative to this module):
        this rank's slice of it."""
        expert, proj, param = name.split(".")
        part = _PARTS.get(proj)
        e = int(expert) if expert.isdigit() else -1
        if part is None or param != "weight" or not 0 <= e < self.num_experts:
            raise ValueError(f"checkpoint tensor experts.{name} has no place in the experts")
        rows = slice(self.start, self.start + self.size)
        if part == "down":
            _copy(self.down[e].weight.data, src[:, rows])
        else:
            half = slice(0, self.size) if part == "gate" else slice(self.size, 2 * self.size)
            _copy(self.gate_up[e].weight.data[half], src[rows, :])
        self._loaded.add((e, part))

    def loaded_params(self) -> set[str]:
        """The parameters (relative names) every part was loaded into."""
        done = set()
        for e in range(self.num_experts):
            if (e, "gate") in self._loaded and (e, "up") in self._loaded:
                done.add(f"gate_up.{e}.weight")
            if (e, "down") in self._loaded:
                done.add(f"down.{e}.weight")
        return done

    def forward(
        self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """x [T, hidden]; expert_ids, weights [T, k] (the router's picks) -> [T, hidden],
        this rank's partial sum."""
        k = expert_ids.shape[1]
        flat = expert_ids.reshape(-1)
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        flat_weights = weights.reshape(-1)
        out = torch.zeros_like(x)
        first = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            picks = order[first : first + n]
            first += n
            tokens = picks // k
            h = self.act(self.gate_up[e].matmul(x[tokens]))
            h = self.down[e].matmul(h) * flat_weights[picks, None]
            out.index_add_(0, tokens, h)
        return out


def _linear(out_features: int, in_features: int, dtype: torch.dtype) -> PackableLinear:
    layer = PackableLinear()
    layer.weight = nn.Parameter(
        torch.empty(out_features, in_features, dtype=dtype), requires_grad=False
    )
    return layer


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    if tuple(src.shape) != tuple(dst.shape):
        raise RuntimeError(f"expert shard shape {tuple(src.shape)} != {tuple(dst.shape)}")
    dst.copy_(src.to(dst.dtype))
