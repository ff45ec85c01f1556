"""Rotary position embeddings (NeoX half-split layout, as Hugging Face Llama uses)."""

from __future__ import annotations

import math

import torch
from torch import nn

from workers.model import kernels
from workers.model.config import AnyRopeScaling, LinearRopeScaling, YarnRopeScaling
from workers.torch_threads import kernel_threads


def rope_inv_freq(head_dim: int, theta: float, scaling: AnyRopeScaling | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if scaling is None:
        return inv_freq
    if isinstance(scaling, LinearRopeScaling):
        return inv_freq / scaling.factor
    if isinstance(scaling, YarnRopeScaling):
        return _yarn_inv_freq(head_dim, theta, scaling)
    # Llama 3: long wavelengths are slowed by `factor`, short ones kept, and the
    # band in between interpolated smoothly.
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    in_band = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(in_band, smoothed, scaled)


def _yarn_inv_freq(head_dim: int, theta: float, scaling: YarnRopeScaling) -> torch.Tensor:
    """Per frequency, the interpolated (slowed by `factor`) and the original one mixed by
    a ramp over the dimensions whose rotations over the original context fall between
    beta_fast and beta_slow, as transformers' YaRN computes it."""
    original = scaling.original_max_position_embeddings

    def dim_of(rotations: float) -> float:
        """The dimension whose frequency turns `rotations` times over the original context."""
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(scaling.beta_fast), dim_of(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    freqs = theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    keep = 1 - ramp  # 1 where the original frequency is kept (fast-turning dimensions)
    return (1.0 / (scaling.factor * freqs)) * (1 - keep) + (1.0 / freqs) * keep


def rope_attention_factor(scaling: AnyRopeScaling | None) -> float:
    """What cos and sin are multiplied by (YaRN's attention scaling; else 1)."""
    return scaling.attention_factor if isinstance(scaling, YarnRopeScaling) else 1.0


# CPU tables grow in chunks of this many positions as longer sequences arrive: a
# 32k-context model serving short prompts holds 4 MB a table, not 64. A chunk's floats
# are those of the same rows of a whole table (its row offset keeps every element in the
# same vector lane, and its length leaves no scalar tail).
_CHUNK_POSITIONS = 4096


class RotaryEmbedding(nn.Module):
    """cos/sin tables for positions up to `max_positions`, over the full head dim.

    Rotating the half-split pair (x1, x2) is x * cos + swap(x) * sin with
    swap(x) = (x2, x1) and sin signed (-sin, +sin), so a step needs one gather
    of the tables, shared by all layers, and one pass per layer (`apply_rope`).
    On CPU the tables cover the positions seen so far, grown a chunk at a time; on
    other devices they are whole from the start (finding a step's largest position
    there would wait for the device).
    """

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: AnyRopeScaling | None = None,
        dtype: torch.dtype = torch.float32,
    ):
        super().__init__()
        self.max_positions = max_positions
        self.dtype = dtype
        self.attention_factor = rope_attention_factor(scaling)
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, theta, scaling), persistent=False)
        self.register_buffer("cos", torch.empty(0, head_dim, dtype=dtype), persistent=False)
        self.register_buffer("sin", torch.empty(0, head_dim, dtype=dtype), persistent=False)
        grows = self.inv_freq.device.type == "cpu"
        self._grow(min(_CHUNK_POSITIONS, max_positions) if grows else max_positions)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed sin) for `positions`, shaped [T, 1, head_dim] to broadcast over heads."""
        if positions.device.type == "cpu" and positions.numel():
            needed = int(positions.max()) + 1
            if needed > self.cos.shape[0]:
                if needed > self.max_positions:
                    raise RuntimeError(f"position {needed - 1} is past {self.max_positions}")
                self._grow(
                    min(-(-needed // _CHUNK_POSITIONS) * _CHUNK_POSITIONS, self.max_positions)
                )
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def _grow(self, positions: int) -> None:
        """Extends the tables to `positions` rows."""
        start = self.cos.shape[0]
        device = self.inv_freq.device
        rows = torch.arange(start, positions, dtype=torch.float32, device=device)
        freqs = torch.outer(rows, self.inv_freq)
        cos, sin = freqs.cos(), freqs.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        self.cos = torch.cat([self.cos, torch.cat((cos, cos), -1).to(self.dtype)])
        self.sin = torch.cat([self.sin, torch.cat((-sin, sin), -1).to(self.dtype)])


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim] (rows may be strided, as views of a fused QKV output are)
    -> rotated copy. One pass of Baton's CPU kernel where it runs, else torch ops; the
    two give the same floats, those of transformers' `q * cos + rotate_half(q) * sin`."""
    tokens, heads, dim = x.shape
    lib = kernels.library() if _kernel_fits(x, cos, sin) else None
    if lib is not None:
        out = torch.empty(x.shape, dtype=x.dtype)
        args = (x.stride(0), cos.data_ptr(), sin.data_ptr(), tokens, heads, dim, out.data_ptr())
        if lib.baton_rope(x.data_ptr(), *args, kernel_threads()) != 0:
            raise RuntimeError(f"rope kernel refused head dim {dim}")
        return out
    half = dim // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    # Not addcmul: it fuses the multiply-add and rounds differently from transformers.
    return x * cos + swapped * sin


def _kernel_fits(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    tables = all(t.is_contiguous() and t.shape == (x.shape[0], 1, x.shape[2]) for t in (cos, sin))
    return (
        x.device.type == "cpu"
        and x.dtype == cos.dtype == sin.dtype == torch.float32
        and x.stride(2) == 1
        and x.stride(1) == x.shape[2]
        and x.shape[2] % 16 == 0
        and tables
    )
