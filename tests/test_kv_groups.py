"""KVCacheGroups: how layers share the pool's blocks, and which blocks each group needs."""

from __future__ import annotations

import pytest

from workers.kv.kv_groups import KVCacheGroups
from workers.model.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig

FULL, SLIDING = FULL_ATTENTION, SLIDING_ATTENTION


def _config(layer_types: list[str], window: int | None = 512) -> ModelConfig:
    return ModelConfig(
        model_type="gemma3_text",
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=len(layer_types),
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        qkv_bias=False,
        o_proj_bias=False,
        bos_token_id=2,
        eos_token_ids=(1,),
        layer_types=tuple(layer_types),
        sliding_window=window,
    )


def _pattern(num_layers: int, every: int) -> list[str]:
    return [FULL if (i + 1) % every == 0 else SLIDING for i in range(num_layers)]


def test_gemma3_270m_is_one_full_and_five_sliding_groups_of_three():
    groups = KVCacheGroups.of(_config(_pattern(18, 6)))
    assert groups.group_size == 3 and groups.num_groups == 6
    assert groups.windows == (512,) * 5 + (None,)
    assert groups.layers[-1] == (5, 11, 17)
    assert groups.layers[0] == (0, 1, 2) and groups.layers[1] == (3, 4, 6)
    assert groups.primary == 5 and groups.hybrid


def test_a_bucket_that_does_not_divide_ends_in_a_smaller_group():
    # Gemma 3 1B's shape: 26 layers, 4 full, 22 sliding -> sliding groups 4, 4, 4, 4, 4, 2.
    groups = KVCacheGroups.of(_config(_pattern(26, 6)))
    assert groups.group_size == 4
    sizes = [len(g) for g, w in zip(groups.layers, groups.windows, strict=True) if w]
    assert sizes == [4, 4, 4, 4, 4, 2]
    assert sorted(layer for g in groups.layers for layer in g) == list(range(26))


def test_layers_that_attend_alike_are_one_group():
    groups = KVCacheGroups.of(_config([FULL] * 5, window=None))
    assert groups.layers == (tuple(range(5)),) and groups.windows == (None,)
    assert not groups.hybrid and groups.group_size == 5


def test_placement_puts_each_group_s_layers_on_buffers_in_order():
    groups = KVCacheGroups.of(_config(_pattern(6, 3)))  # S S F S S F
    assert groups.layers == ((0, 1), (3, 4), (2, 5))
    assert groups.placement() == [(0, 0), (0, 1), (2, 0), (1, 0), (1, 1), (2, 1)]


@pytest.mark.parametrize(
    ("window", "first_query", "block"),
    [(8, 0, 0), (8, 7, 0), (8, 23, 1), (8, 24, 1), (8, 39, 2), (16, 16, 0), (16, 31, 1)],
)
def test_first_block_is_that_of_the_window_s_first_key(window, first_query, block):
    groups = KVCacheGroups(((0,), (1,)), (window, None))
    # A query at p reads keys p - window + 1 .. p; blocks of 16.
    assert groups.first_block(0, first_query, 16) == block
    assert groups.first_block(1, first_query, 16) == 0


def test_spans_are_what_an_importer_lacks_group_by_group():
    groups = KVCacheGroups(((0,), (1,)), (None, 20))
    # 100 tokens in 7 blocks; the next query (position 100) reads keys 81..100: blocks 5, 6.
    assert groups.spans(100, 0, 16) == [(0, 7), (5, 7)]
    assert groups.spans(100, 3, 16) == [(3, 7), (5, 7)]
    assert groups.spans(100, 6, 16) == [(6, 7), (6, 7)]
    assert groups.spans(96, 6, 16) == [(6, 6), (6, 6)]  # whole blocks, all held


def test_blocks_needed_counts_a_window_and_a_step_s_chunk_per_sliding_group():
    groups = KVCacheGroups(((0,), (1,)), (None, 512))
    assert groups.blocks_needed(8192, 1024, 16) == 512 + (-(-(511 + 1024) // 16) + 1)
    assert groups.blocks_needed(100, 1024, 16) == 7 + 7  # shorter than the window


def test_a_window_below_one_is_refused():
    with pytest.raises(ValueError, match="sliding window"):
        KVCacheGroups(((0,),), (0,))
