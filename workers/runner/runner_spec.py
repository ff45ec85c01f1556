"""What a runner is built from, as plain data."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RunnerSpec:
    """Everything a runner needs, as plain data: the engine builds one and hands it to
    an in-process runner or to every rank of a tensor-parallel group."""

    model_dir: str
    num_blocks: int
    block_size: int
    max_model_len: int
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    # The bits one-row matmuls from GGUF blocks round their input to, 32 for none
    # (EngineConfig.activations).
    activation_bits: int = 32
