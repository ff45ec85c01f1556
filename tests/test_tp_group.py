"""Tensor parallelism across Ray worker processes on small random-weight Llamas."""

from __future__ import annotations

import time

import pytest
import torch
from tiny_model import make_tiny_model

from workers.errors import EngineDeadError
from workers.runner.model_runner import ModelRunner
from workers.runner.runner_spec import RunnerSpec
from workers.runner.step_io import SeqChunk, StepInput
from workers.runner.tp_group import TPWorkerGroup

pytestmark = pytest.mark.slow  # starts Ray worker processes

BLOCK = 16


def _spec(model_dir, dtype=torch.float32) -> RunnerSpec:
    return RunnerSpec(str(model_dir), 32, BLOCK, 512, dtype, "cpu")


def _steps() -> list[StepInput]:
    """A prefill of two prompts, a chunk with prompt logprobs, then a mixed step: a decode,
    a decode with two speculated tokens (logits at all three) and a chunk on a cached
    prefix."""
    g = torch.Generator().manual_seed(0)
    a = torch.randint(0, 320, (37,), generator=g).tolist()
    b = torch.randint(0, 320, (20,), generator=g).tolist()
    c = torch.randint(0, 320, (50,), generator=g).tolist()
    return [
        StepInput([SeqChunk(a, 0, [[0, 1, 2]], True), SeqChunk(b, 0, [[3, 4]], True)]),
        # With prompt logprobs from its 4th position on (of the tokens after them, 2 top).
        StepInput(
            [
                SeqChunk(
                    c[:30],
                    0,
                    [[5, 6, 7, 8]],
                    False,
                    prompt_targets=c[4:31],
                    prompt_from=3,
                    prompt_top_n=2,
                )
            ]
        ),
        StepInput(
            [
                SeqChunk([7], 37, [[0, 1, 2]], True),
                SeqChunk([9, 4, 5], 20, [[3, 4]], True, num_drafts=2),
                SeqChunk(c[30:], 30, [[5, 6, 7, 8]], True),
            ]
        ),
    ]


def _logits(runner, ranks: bool = True) -> list[torch.Tensor]:
    """Every step's sampling logits, then the prompt logprobs (targets', top-n's), then
    the targets' ranks (which bf16's ties may reorder)."""
    outputs = [runner.execute(step) for step in _steps()]
    prompt = [r for o in outputs for r in o.prompt_logprobs.values()]
    assert len(prompt) == 1 and prompt[0].top_ids.shape == (27, 2)
    scores = [prompt[0].logprobs, prompt[0].top_logprobs]
    return [o.logits for o in outputs] + scores + ([prompt[0].ranks.float()] if ranks else [])


@pytest.mark.parametrize(("tp", "heads", "kv_heads"), [(2, 4, 2), (4, 4, 4), (4, 8, 4)])
def test_tp_logits_match_tp1(ray_cluster, tmp_path, tp, heads, kv_heads):
    model_dir = make_tiny_model(tmp_path, num_heads=heads, num_kv_heads=kv_heads, hidden_size=64)
    spec = _spec(model_dir)
    single = ModelRunner(spec.model_dir, spec.num_blocks, BLOCK, spec.max_model_len)
    group = TPWorkerGroup(tp, spec)
    try:
        for expected, got in zip(_logits(single), _logits(group), strict=True):
            torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    finally:
        group.shutdown()


def test_tp_runs_in_bfloat16(ray_cluster, tmp_path):
    # gloo all-reduces bf16 partial sums: equal to one rank's logits up to bf16 rounding.
    model_dir = make_tiny_model(tmp_path, num_heads=4, num_kv_heads=2, hidden_size=64)
    spec = _spec(model_dir, torch.bfloat16)
    single = ModelRunner(spec.model_dir, spec.num_blocks, BLOCK, spec.max_model_len, spec.dtype)
    group = TPWorkerGroup(2, spec)
    try:
        pairs = zip(_logits(single, ranks=False), _logits(group, ranks=False), strict=True)
        for expected, got in pairs:
            torch.testing.assert_close(got, expected, atol=5e-2, rtol=2e-2)
    finally:
        group.shutdown()


def test_each_rank_holds_its_share_of_the_weights(ray_cluster, tmp_path):
    # Every column-parallel width, whole and a rank's, is a multiple of 48: the dense
    # panels (dense_panels.py) pad a weight's output columns to one, and padding a
    # quarter's last panel is not a quarter of padding the whole's.
    model_dir = make_tiny_model(
        tmp_path,
        num_heads=4,
        num_kv_heads=4,
        hidden_size=128,
        intermediate_size=576,
        vocab_size=384,
    )
    spec = _spec(model_dir)
    full = TPWorkerGroup(1, spec)
    split = TPWorkerGroup(4, spec)
    try:
        (whole,) = full.weight_bytes()
        shares = split.weight_bytes()
        assert len(shares) == 4
        for rank_bytes in shares:
            # Only the RMSNorm weights are replicated; everything else is a 1/4 shard.
            assert abs(rank_bytes - whole / 4) / (whole / 4) < 0.02
        assert split.visible_devices() == ""  # CPU ranks: Ray gives them no GPU
    finally:
        full.shutdown()
        split.shutdown()


def test_a_dead_rank_fails_the_step_loudly(ray_cluster, tmp_path):
    import ray

    group = TPWorkerGroup(2, _spec(make_tiny_model(tmp_path)))
    ray.kill(group.workers[1])
    with pytest.raises(EngineDeadError, match="TP rank 1 of 2 failed"):
        group.execute(_steps()[0])
    # The group stays failed: later calls say so instead of hanging or misbehaving.
    with pytest.raises(EngineDeadError, match="TP rank 1 of 2 failed"):
        group.execute(_steps()[0])
    group.shutdown()  # idempotent


def test_a_rank_method_that_raises_outside_a_collective_fails_only_that_call(ray_cluster, tmp_path):
    """A handoff's export, pull or import that raises in the ranks (a bad argument, a
    transfer error) is that call's error, as its own type; the ranks are fine, and the
    group keeps computing. (In a step, a raising rank would leave the others waiting in
    an all-reduce: that ends the group, as a dead rank does.)"""
    model_dir = make_tiny_model(tmp_path)  # 2 KV heads
    group = TPWorkerGroup(2, _spec(model_dir))
    local = ModelRunner.from_spec(_spec(model_dir))
    try:
        with pytest.raises(ValueError, match="dst_tp must divide the 2 KV heads, got 3"):
            group.export_blocks([0, 1], 0, "object_store", dst_tp=3)
        assert group.failure is None
        torch.testing.assert_close(
            group.execute(_steps()[0]).logits, local.execute(_steps()[0]).logits
        )
    finally:
        group.shutdown()


def test_current_placement_puts_the_ranks_in_the_placement_group_the_caller_runs_in(
    ray_cluster, tmp_path
):
    """How a Serve TP replica runs: placed in bundle 0 of a placement group reserved with
    its ranks (placement_group_bundles), which take bundles 1..tp; shutting the group
    down leaves that placement group to its owner."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    spec = _spec(make_tiny_model(tmp_path))
    # One bundle more than the replica and its 2 ranks take: it must stay free.
    pg = placement_group([{"CPU": 1.0}] * 4, strategy="STRICT_PACK")
    ray.get(pg.ready())
    used = [f"CPU_group_{i}_{pg.id.hex()}" for i in range(4)]

    def bundles_in_use() -> list[bool]:
        # Ray lists a bundle's free CPU as a resource of its own (none once taken); its
        # view lags the actors' start, so wait for the ranks' bundles to show as taken.
        deadline = time.monotonic() + 30
        while True:
            free = ray.available_resources()
            taken = [free.get(name, 0.0) == 0.0 for name in used]
            if taken[:3] == [True] * 3 or time.monotonic() > deadline:
                return taken
            time.sleep(0.2)

    @ray.remote(num_cpus=1)
    class Replica:
        def run(self, spec: RunnerSpec, step: StepInput) -> tuple[list, torch.Tensor, str]:
            group = TPWorkerGroup(2, spec, placement="current")
            try:
                logits = group.execute(step).logits
                taken = bundles_in_use()
            finally:
                group.shutdown()
            return taken, logits, ray.util.placement_group_table(pg)["state"]

    strategy = PlacementGroupSchedulingStrategy(
        pg, placement_group_bundle_index=0, placement_group_capture_child_tasks=True
    )
    replica = Replica.options(scheduling_strategy=strategy).remote()
    try:
        taken, logits, state = ray.get(replica.run.remote(spec, _steps()[0]), timeout=300)
        assert taken == [True, True, True, False]  # the replica's, then ranks 0 and 1
        local = ModelRunner.from_spec(spec)
        torch.testing.assert_close(logits, local.execute(_steps()[0]).logits, atol=1e-4, rtol=0)
        assert state == "CREATED"  # not removed with the group: it is the replica's
    finally:
        ray.kill(replica)
        remove_placement_group(pg)


def test_current_placement_outside_a_placement_group_says_how_to_fix_it(ray_cluster, tmp_path):
    hint = r"bundles 1\.\.2 hold \{'CPU': 1.0\} each; it runs in none.*tp_placement 'own'"
    with pytest.raises(RuntimeError, match=hint):
        TPWorkerGroup(2, _spec(make_tiny_model(tmp_path)), placement="current")
