"""KV handoff lifecycle: held blocks (expiry, release, abort), imports that wait for free
blocks, and handoffs refused (a stale or bad skip, a mismatched handle or data)."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
from handoff_helpers import (
    BLOCK,
    GREEDY,
    _assert_all_free,
    _drain,
    _engine,
    _prefill,
    _single,
    _tokens,
    _tokens_of,
)
from tiny_model import make_tiny_model

from workers.engine import llm_engine
from workers.engine.handoff.handle import StalePrefixError
from workers.engine.outputs import RequestOutput
from workers.engine.sampling_params import SamplingParams
from workers.kv.blocks import KVBlocks
from workers.kv.transport import KVTransferError


def test_a_skip_of_blocks_decode_no_longer_holds_is_refused_and_retried(model_dir):
    prefill, decode = _engine(model_dir), _engine(model_dir)
    prompt = _tokens(3 * BLOCK + 2, seed=40)
    _prefill(prefill, "r", prompt)
    # As if decode had held two blocks when asked and evicted them since.
    handle, parts = prefill.export_kv("r", skip_blocks=2)
    with pytest.raises(StalePrefixError) as refused:
        decode.add_prefilled_request("r", prompt, GREEDY, handle, parts)
    assert refused.value.num_cached_blocks == 0
    _assert_all_free(decode)
    handle, parts = prefill.export_kv("r", skip_blocks=refused.value.num_cached_blocks)
    decode.add_prefilled_request("r", prompt, GREEDY, handle, parts)
    prefill.release_handoff("r")
    assert len(_tokens_of(_drain(decode)["r"])) == GREEDY.max_tokens
    _assert_all_free(prefill, decode)


def test_held_blocks_expire_after_the_timeout(model_dir, monkeypatch):
    now = [1000.0]  # the engine's clock, moved by hand
    monkeypatch.setattr(llm_engine, "time", SimpleNamespace(monotonic=lambda: now[0]))
    prefill = _engine(model_dir, handoff_timeout_s=2.0)
    _prefill(prefill, "r", _tokens(40, seed=50))
    stats = prefill.stats()
    assert stats.handoffs_held == 1 and stats.num_free_blocks == stats.num_total_blocks - 3
    assert not prefill.has_unfinished()  # holding is not work
    prefill.step()
    now[0] += 1.9
    prefill.step()
    assert prefill.stats().handoffs_held == 1
    now[0] += 0.2
    prefill.step()
    assert prefill.stats().handoffs_expired == 1
    with pytest.raises(ValueError, match="holds no KV handoff"):
        prefill.export_kv("r")
    assert not prefill.release_handoff("r")
    _assert_all_free(prefill)


def test_release_and_abort_free_held_blocks(model_dir):
    prefill = _engine(model_dir)
    for rid in ("a", "b"):
        _prefill(prefill, rid, _tokens(3 * BLOCK, seed=51))
    with pytest.raises(ValueError, match="already in use"):
        prefill.add_request("a", [5, 6], GREEDY)
    assert prefill.stats().handoffs_held == 2
    assert prefill.release_handoff("a") and not prefill.release_handoff("a")
    assert prefill.abort("b") and not prefill.abort("b")
    assert prefill.stats().handoffs_expired == 0
    # The released prompt blocks stay in the prefix cache for the next request.
    again = _prefill(prefill, "c", _tokens(3 * BLOCK, seed=51))
    assert again.num_cached_tokens == 2 * BLOCK
    prefill.release_handoff("c")
    _assert_all_free(prefill)


@pytest.mark.parametrize("skip", [-1, 3, 1.0])
def test_export_refuses_a_bad_skip(model_dir, skip):
    prefill = _engine(model_dir)
    _prefill(prefill, "r", _tokens(2 * BLOCK + 3, seed=52))
    with pytest.raises(ValueError, match="skip_blocks"):
        prefill.export_kv("r", skip_blocks=skip)


@pytest.mark.parametrize(
    ("dst_tp", "message"),
    [
        (0, "dst_tp must be a TP degree"),
        (1.0, "dst_tp must be a TP degree"),
        (3, "dst_tp=3: the TP degree 3 neither divides the 2 KV heads nor is a multiple"),
    ],
)
def test_export_refuses_an_importer_tp_that_cannot_hold_the_kv_heads(model_dir, dst_tp, message):
    prefill = _engine(model_dir)
    _prefill(prefill, "r", _tokens(2 * BLOCK + 3, seed=54))
    # The tiny model has 2 KV heads: 1 and 2 split them, 4 replicates each on 2 ranks.
    with pytest.raises(ValueError, match=message):
        prefill.export_kv("r", dst_tp=dst_tp)
    _, parts = prefill.export_kv("r", dst_tp=4)  # the handoff is still there to export
    assert [p.tp_size for p in parts] == [1]


def test_an_import_whose_transfer_fails_goes_on_by_recompute(model_dir, monkeypatch):
    """An export pulled at import time (not prefetched) whose exporter is gone since: the
    request is decoded from its prompt, as one engine would, and no block stays taken."""
    prefill, decode, cold = _engine(model_dir), _engine(model_dir), _engine(model_dir)
    prompt = _tokens(2 * BLOCK + 5, seed=55)
    _prefill(prefill, "r", prompt)
    handle, parts = prefill.export_kv("r")
    prefill.release_handoff("r")

    def gone(*args, **kwargs):
        raise KVTransferError("the exporter died mid-pull")

    monkeypatch.setattr(decode.runner, "import_blocks", gone)
    decode.add_prefilled_request("r", prompt, GREEDY, handle, parts)
    outputs = _drain(decode)
    assert _tokens_of(outputs["r"]) == _tokens_of(_single(cold, prompt))
    assert decode.stats().num_preemptions == 1 and decode.runner_failure() is None
    _assert_all_free(prefill, decode)


def test_an_export_may_name_its_transport_and_a_bad_one_is_refused(model_dir):
    # A nixl engine, whose own exports would be KVRefs (which need Ray): the override
    # alone makes this one an object-store copy.
    prefill = _engine(model_dir, kv_transport="nixl")
    _prefill(prefill, "r", _tokens(2 * BLOCK + 3, seed=53))
    with pytest.raises(ValueError, match="kv_transport must be one of"):
        prefill.export_kv("r", transport="carrier-pigeon")
    _, parts = prefill.export_kv("r", transport="object_store")
    assert [type(p) for p in parts] == [KVBlocks]


def test_an_import_waits_for_free_blocks(model_dir):
    prefill, cold = _engine(model_dir), _engine(model_dir)
    decode = _engine(model_dir, num_kv_blocks=6)
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    decode.add_request("busy", _tokens(3 * BLOCK, seed=60), long)
    decode.step()  # "busy" holds 3 of the 6 blocks, and grows
    prompt = _tokens(3 * BLOCK + 1, seed=61)  # needs 4 blocks
    _prefill(prefill, "r", prompt)
    handle, parts = prefill.export_kv("r")
    decode.add_prefilled_request("r", prompt, GREEDY, handle, parts)
    assert decode.stats().imports_waiting == 1
    outputs = _drain(decode)
    assert len(_tokens_of(outputs["busy"])) == 40 - 1  # the first came before the import
    assert _tokens_of(outputs["r"]) == _tokens_of(_single(cold, prompt))
    prefill.release_handoff("r")
    # A waiting import can be aborted, giving back what it had pinned.
    decode.add_request("busy2", _tokens(3 * BLOCK, seed=60), long)
    decode.step()
    decode.add_prefilled_request("r2", prompt, GREEDY, replace(handle, request_id="r2"), parts)
    assert decode.stats().imports_waiting == 1
    assert decode.abort("r2")
    assert set(_drain(decode)) == {"busy2"}
    _assert_all_free(prefill, decode)


def test_a_waiting_import_goes_in_with_the_step_that_frees_its_blocks(model_dir):
    prefill, cold = _engine(model_dir), _engine(model_dir)
    decode = _engine(model_dir, num_kv_blocks=6)
    short = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    decode.add_request("busy", _tokens(3 * BLOCK, seed=60), short)
    decode.step()  # "busy" holds 3 of the 6 blocks, 4 with its next token
    prompt = _tokens(3 * BLOCK + 1, seed=61)  # needs 4 blocks
    _prefill(prefill, "r", prompt)
    handle, parts = prefill.export_kv("r")
    prefill.release_handoff("r")
    decode.add_prefilled_request("r", prompt, GREEDY, handle, parts)
    assert decode.ready_outputs() == [] and decode.stats().imports_waiting == 1
    (last,) = decode.step()
    assert last.request_id == "busy" and last.finished
    # Admitted in the step that freed the blocks: an engine loop asking `needs_step`
    # would otherwise sleep until its next timer poll with the import's blocks free.
    assert decode.stats().imports_waiting == 0 and decode.needs_step()
    first = decode.ready_outputs()
    assert [o.request_id for o in first] == ["r"]
    rest = _drain(decode)["r"]
    assert _tokens_of(first + rest) == _tokens_of(_single(cold, prompt))
    _assert_all_free(prefill, decode)


def test_a_request_waiting_on_a_held_handoffs_blocks_needs_no_step_until_they_free(model_dir):
    prefill = _engine(model_dir, num_kv_blocks=4)
    _prefill(prefill, "held", _tokens(3 * BLOCK, seed=62))  # holds 3 of the 4 blocks
    prefill.add_request("next", _tokens(2 * BLOCK + 1, seed=63), GREEDY, prefill_only=True)
    assert prefill.needs_step()
    assert prefill.step() == [] and prefill.stats().num_waiting == 1
    # Stepping again would only fail again, so an engine loop sleeps instead of
    # spinning a core until a release, an abort or the handoff's deadline.
    assert not prefill.needs_step() and prefill.has_unfinished()
    assert prefill.release_handoff("held")
    assert prefill.needs_step()
    (out,) = prefill.step()
    assert out.request_id == "next" and out.handoff is not None
    prefill.release_handoff("next")
    _assert_all_free(prefill)


def test_a_waiting_import_that_fits_is_not_blocked_by_an_older_one(model_dir):
    prefill, cold = _engine(model_dir), _engine(model_dir)
    decode = _engine(model_dir, num_kv_blocks=8)
    shared = _tokens(2 * BLOCK, seed=80)
    _single(decode, [*shared, 5])  # decode now caches the two shared blocks
    busy = _tokens(2 * BLOCK + 1, seed=83)
    decode.add_request("busy", busy, SamplingParams(max_tokens=8, temperature=0.0))
    decode.step()  # "busy" holds 3 blocks, so "big" must wait
    big = _tokens(6 * BLOCK + 1, seed=81)  # 7 blocks: more than "small" ever leaves free
    small = shared + _tokens(BLOCK + 1, seed=82)  # pins the 2 cached blocks, needs 2 more
    for rid, prompt in (("big", big), ("small", small)):
        first = _prefill(prefill, rid, prompt)
        skip = decode.cached_prefix_blocks(list(first.handoff.block_hashes), prompt)
        handle, parts = prefill.export_kv(rid, skip_blocks=skip)
        decode.add_prefilled_request(rid, prompt, GREEDY, handle, parts)
        prefill.release_handoff(rid)
    assert decode.stats().imports_waiting >= 1
    outputs: dict[str, list[RequestOutput]] = {}
    for _ in range(200):  # strict FIFO would never admit either: a livelock, not an error
        if not decode.has_unfinished():
            break
        for out in decode.step():
            outputs.setdefault(out.request_id, []).append(out)
    assert _tokens_of(outputs["small"]) == _tokens_of(_single(cold, small))
    assert _tokens_of(outputs["big"]) == _tokens_of(_single(cold, big))
    # "small" was imported past "big", not recomputed by the stuck-imports fallback.
    assert decode.stats().num_preemptions == 0
    _assert_all_free(prefill, decode)


def test_an_import_waits_for_a_sequence_slot_with_blocks_to_spare(model_dir):
    prefill = _engine(model_dir)
    decode = _engine(model_dir, num_kv_blocks=64, max_num_seqs=1)
    busy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    decode.add_request("busy", _tokens(BLOCK + 1, seed=95), busy)
    decode.step()  # the only sequence slot is taken
    prompt = _tokens(2 * BLOCK + 1, seed=96)
    _prefill(prefill, "r", prompt)
    handle, parts = prefill.export_kv("r")
    decode.add_prefilled_request("r", prompt, GREEDY, handle, parts)
    prefill.release_handoff("r")
    decode.step()
    stats = decode.stats()
    assert (stats.imports_waiting, stats.num_running) == (1, 1)
    outputs: dict[str, list[RequestOutput]] = {}
    while decode.has_unfinished():
        for out in decode.step():
            outputs.setdefault(out.request_id, []).append(out)
    assert outputs["r"][-1].finished and decode.stats().num_preemptions == 0
    _assert_all_free(prefill, decode)


def test_imports_whose_pinned_prefixes_block_each_other_go_on_by_recompute(model_dir):
    prefill, cold = _engine(model_dir), _engine(model_dir)
    decode = _engine(model_dir, num_kv_blocks=10, max_num_seqs=1)
    prefixes = [_tokens(3 * BLOCK, seed=90), _tokens(3 * BLOCK, seed=91)]
    for prefix in prefixes:
        _single(decode, [*prefix, 5])  # decode caches each prefix's 3 blocks
    busy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    decode.add_request("busy", _tokens(BLOCK + 1, seed=92), busy)
    decode.step()  # the only sequence slot is taken: the imports queue
    prompts = {
        f"r{i}": [*prefix, *_tokens(4 * BLOCK + 1, seed=93 + i)]
        for i, prefix in enumerate(prefixes)
    }
    for rid, prompt in prompts.items():
        first = _prefill(prefill, rid, prompt)
        skip = decode.cached_prefix_blocks(list(first.handoff.block_hashes), prompt)
        assert skip == 3
        handle, parts = prefill.export_kv(rid, skip_blocks=skip)
        decode.add_prefilled_request(rid, prompt, GREEDY, handle, parts)
        prefill.release_handoff(rid)
    # Each pins its 3 cached blocks and needs 5 more: with the other's pins, never.
    assert decode.stats().imports_waiting == 2
    outputs: dict[str, list[RequestOutput]] = {}
    for _ in range(500):
        if not decode.has_unfinished():
            break
        for out in decode.step():
            outputs.setdefault(out.request_id, []).append(out)
    for rid, prompt in prompts.items():
        assert _tokens_of(outputs[rid]) == _tokens_of(_single(cold, prompt))
    assert decode.stats().num_preemptions == 1  # the younger one, recomputed
    _assert_all_free(prefill, decode)


def test_mismatched_handoffs_are_refused(model_dir, tmp_path):
    prefill = _engine(model_dir)
    prompt = _tokens(2 * BLOCK + 5, seed=70)
    _prefill(prefill, "r", prompt, salt="t")
    handle, parts = prefill.export_kv("r")
    other_model = make_tiny_model(tmp_path / "other", num_kv_heads=4)
    decode = _engine(model_dir)
    refused = [
        (decode, "r", prompt[:-1], handle, parts, "t", "num_tokens"),
        (decode, "x", prompt, handle, parts, "t", "request_id"),
        (decode, "r", prompt, handle, parts, None, "block_hashes"),
        (decode, "r", prompt, handle, parts[0:0], "t", "kv_parts"),
        (decode, "r", prompt, handle, [replace(parts[0], tp_size=2)], "t", "rank"),
        (decode, "r", prompt, replace(handle, tp_size=2), parts * 2, "t", "rank 0 of 1"),
        (decode, "r", prompt, replace(handle, first_token=10_000), parts, "t", "first_token"),
        (decode, "r", prompt, handle, [replace(parts[0], data=parts[0].data[:, :1])], "t", "shape"),
        (_engine(model_dir, model_id="other"), "r", prompt, handle, parts, "t", "model_id"),
        (_engine(model_dir, block_size=8), "r", prompt, handle, parts, "t", "layout"),
        # Same name, other head layout.
        (_engine(other_model, model_id=handle.model_id), "r", prompt, handle, parts, "t", "layout"),
    ]
    for engine, rid, p, h, kv, salt, field in refused:
        with pytest.raises(ValueError, match=field):
            engine.add_prefilled_request(rid, p, GREEDY, h, kv, cache_salt=salt)
        _assert_all_free(engine)
    seeded = SamplingParams(**{**vars(GREEDY), "seed": 1})
    with pytest.raises(ValueError, match="generator_state"):
        bad_state = replace(handle, generator_state=b"x")
        decode.add_prefilled_request("r", prompt, seeded, bad_state, parts, cache_salt="t")
    _assert_all_free(decode)
    # The right request still goes through.
    decode.add_prefilled_request("r", prompt, GREEDY, handle, parts, cache_salt="t")
    assert len(_tokens_of(_drain(decode)["r"])) == GREEDY.max_tokens
