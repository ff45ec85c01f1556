"""How handoff KV travels: taking a rank's share of an export, and the transports (nixl
between processes: test_kv_transport_nixl.py)."""

from __future__ import annotations

import pytest
import torch

from workers.engine.config import EngineConfig
from workers.kv.blocks import KVBlocks
from workers.kv.transport import (
    KVRef,
    check_transport,
    fetch,
    fetched_bytes,
    head_cuts,
    materialize,
    publish,
)


def _export(full: torch.Tensor, tp: int, start_block: int = 0) -> list[KVBlocks]:
    """`full` [layers, 2, heads, blocks, block size, dim] as `tp` ranks export it."""
    heads = full.shape[2] // tp
    return [
        KVBlocks(full[:, :, r * heads : (r + 1) * heads].clone(), r, tp, start_block)
        for r in range(tp)
    ]


@pytest.mark.parametrize(("src_tp", "dst_tp"), [(1, 2), (2, 1), (2, 4), (4, 2), (2, 2), (4, 1)])
def test_each_rank_takes_its_heads_in_order(src_tp, dst_tp):
    full = torch.randn(3, 2, 4, 5, 4, 8)
    shares = [materialize(_export(full, src_tp, 2), r, dst_tp) for r in range(dst_tp)]
    assert [(s.tp_rank, s.tp_size, s.start_block) for s in shares] == [
        (r, dst_tp, 2) for r in range(dst_tp)
    ]
    assert all(s.shape == (3, 2, 4 // dst_tp, 5, 4, 8) for s in shares)
    assert torch.equal(torch.cat([s.data for s in shares], dim=2), full)


def test_a_share_holds_the_rows_asked_for_in_their_order():
    full = torch.randn(2, 2, 2, 6, 4, 8)
    export = _export(full, 2, start_block=3)
    share = materialize(export, 0, 1, [2, 3, 4, 5])  # a run: a view of the data
    assert (share.start_block, share.num_blocks) == (3, 4)
    assert torch.equal(share.data, full[:, :, :, 2:])
    # A suffix of each of two groups' runs, as a window-only handoff's importer takes.
    assert torch.equal(materialize(export, 0, 1, [1, 2, 5]).data, full[:, :, :, [1, 2, 5]])
    assert materialize(_export(full, 1, 3), 0, 1, []).num_blocks == 0
    with pytest.raises(ValueError, match="among the 6 exported"):
        materialize(_export(full, 1, 3), 0, 1, [6])


def test_a_rank_fetches_only_the_parts_holding_its_heads():
    full = torch.randn(1, 2, 4, 2, 4, 8)
    local = _export(full, 2)
    # Fetching rank 1's part would fail: its reference is not a Ray object.
    unreachable = KVRef(((0, 2, None),), local[1].shape, full.dtype, 1, 2)
    share = materialize([local[0], unreachable], 0, 2)
    assert torch.equal(share.data, full[:, :, :2])
    with pytest.raises(ValueError, match="cannot take a share"):
        materialize(local, 0, 3)


@pytest.mark.parametrize(
    ("heads", "src_rank", "src_tp", "dst_tp", "cuts"),
    [
        (4, 0, 1, 2, [2]),  # one part, two importing ranks
        (6, 0, 2, 3, [2]),  # heads [0, 3): rank 0 of 3 takes [0, 2), rank 1 [2, 4)
        (6, 1, 2, 3, [1]),  # heads [3, 6): rank 1 of 3 takes [2, 4), rank 2 [4, 6)
        (4, 1, 2, 2, []),  # the same split on both sides: nothing to cut
        (4, 0, 2, 1, []),  # one importing rank takes everything
        (4, 0, 1, None, []),  # the importer is unknown
    ],
)
def test_an_export_is_cut_where_the_importing_ranks_split_the_heads(
    heads, src_rank, src_tp, dst_tp, cuts
):
    assert head_cuts(heads, src_rank, src_tp, dst_tp) == cuts


def test_an_importer_degree_that_does_not_divide_the_heads_is_refused():
    with pytest.raises(ValueError, match="dst_tp must divide the 6 KV heads, got 4"):
        head_cuts(6, 0, 1, 4)


def test_a_fetch_moves_every_piece_it_touches_whole():
    part = KVRef(((0, 1, None), (1, 3, None)), (2, 2, 3, 4, 16, 8), torch.float32, 0, 1)
    per_head = part.nbytes // 3
    assert fetched_bytes(part, 0, 1) == per_head
    assert fetched_bytes(part, 1, 3) == 2 * per_head
    assert fetched_bytes(part, 0, 2) == part.nbytes  # straddles the cut
    assert fetched_bytes(KVBlocks(torch.zeros(1, 2, 1, 1, 4, 8), 0, 1), 0, 1) == 0


def test_transports_are_checked():
    check_transport("object_store")
    with pytest.raises(ValueError, match="kv_transport must be one of"):
        check_transport("gloo")
    with pytest.raises(ValueError, match="^transport must be one of"):  # AppConfig's name
        check_transport("gloo", "transport")
    with pytest.raises(ValueError, match="kv_transport"):
        EngineConfig(model="m", kv_transport="tcp")


def test_the_object_store_transport_hands_back_the_blocks_themselves():
    kv = KVBlocks(torch.randn(1, 2, 1, 2, 4, 8), 0, 1, 1)
    part = publish(kv, "object_store")
    assert isinstance(part, KVBlocks) and torch.equal(part.data, kv.data)
    assert fetch(part) is part and part.nbytes == kv.data.numel() * 4
