"""Small random-weight Gemma 3 text folders for fast tests, written by transformers
itself (`Gemma3ForCausalLM.save_pretrained`), saved as tiny_model.py saves a Llama."""

from __future__ import annotations

from pathlib import Path

import torch
from tiny_model import save_folder


def make_tiny_gemma3(
    out_dir: Path,
    *,
    hidden_size: int = 64,
    num_layers: int = 3,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    intermediate_size: int = 128,
    vocab_size: int = 320,
    sliding_window: int = 8,
    sliding_window_pattern: int = 3,
    layer_types: list[str] | None = None,
    query_pre_attn_scalar: float = 24,
    max_position_embeddings: int = 1024,
    eos_token_id: int = 0,
    seed: int = 0,
    **extra_config,
) -> Path:
    """Every `sliding_window_pattern`-th layer full, the others sliding (or
    `layer_types`); a query_pre_attn_scalar other than head_dim, so the scale is
    tested; rope bases of 10k (sliding) and 1M (full), Gemma 3's own."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate_size,
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        sliding_window=sliding_window,
        sliding_window_pattern=sliding_window_pattern,
        layer_types=layer_types,
        query_pre_attn_scalar=query_pre_attn_scalar,
        bos_token_id=None,
        eos_token_id=eos_token_id,
        pad_token_id=0,
        **extra_config,
    )
    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(config).float()
    # Default init gives near-uniform logits and zero norm weights (1 + 0); larger weights
    # make greedy choices decisive and give every norm a weight of its own.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
            elif name.endswith("norm.weight"):
                p.normal_(0.0, 0.3)
    return save_folder(model, out_dir)


def tp_rank_prefill_logits(
    rank: int, world: int, init_file: str, model_dir: str, ids: list[int], out: str
) -> None:
    """One rank of a TP group (gloo, in its own process): loads its shards of the model
    in `model_dir`, prefills `ids` and, on rank 0, saves the logits to `out`."""
    import torch.distributed as dist

    from workers.model.attention_metadata import AttentionMetadata, PrefillChunk
    from workers.model.loader import load_model
    from workers.model.parallel import TPGroup

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        model = load_model(model_dir, TPGroup(rank, world, dist.group.WORLD))
        n = len(ids)
        for attn in model.attention_layers():
            assert attn.num_kv_heads == model.config.kv_heads_per_rank(world)
            shape = (attn.num_kv_heads, n, attn.head_dim)
            attn.bind_cache(torch.zeros(shape), torch.zeros(shape))
        meta = AttentionMetadata(slot_mapping=torch.arange(n), prefills=[PrefillChunk(0, n)])
        with torch.inference_mode():
            logits = model.compute_logits(model(torch.tensor(ids), torch.arange(n), [meta]))
        if rank == 0:
            torch.save(logits, out)
    finally:
        dist.destroy_process_group()
