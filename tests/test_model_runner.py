"""The runner's step (model_runner.py): a step that samples only some of its rows runs its
last layer past the K/V for those rows alone. Its logits match the same step computed for
every row, and its KV cache is the same bit for bit."""

from __future__ import annotations

import pytest
import torch
from tiny_gemma3 import make_tiny_gemma3
from tiny_model import make_tiny_model

from workers.runner.model_runner import ModelRunner
from workers.runner.step_io import SeqChunk, StepInput

BLOCK = 4
NUM_BLOCKS = 96
# Token ids of three sequences; the steps below feed them in pieces.
TOKENS = [
    [(7 * i + 3) % 300 + 10 for i in range(26)],
    [(11 * i + 5) % 300 + 10 for i in range(12)],
    [(13 * i + 1) % 300 + 10 for i in range(30)],
]


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def model_dir(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    if request.param == "llama":
        return make_tiny_model(folder, num_layers=3)
    # Sliding layers (window 8) first and last, so the last layer's selected rows read
    # their window as decoding queries do; the middle layer is full.
    types = ["sliding_attention", "full_attention", "sliding_attention"]
    return make_tiny_gemma3(folder, num_layers=3, layer_types=types)


def _chunk(runner: ModelRunner, seq: int, start: int, end: int, **kw) -> SeqChunk:
    """Tokens [start, end) of sequence `seq`, its blocks disjoint from the others' in
    every KV-cache group."""
    groups = runner.groups.num_groups
    tables = [[32 * g + seq + 3 * i for i in range(-(-end // BLOCK))] for g in range(groups)]
    return SeqChunk(TOKENS[seq][start:end], start, tables, **kw)


def _steps(runner: ModelRunner) -> list[StepInput]:
    return [
        # A prompt's first chunk samples nothing; a whole prompt beside it does.
        StepInput([_chunk(runner, 0, 0, 10, sample=False), _chunk(runner, 1, 0, 7, sample=True)]),
        # The prompt's last chunk, over its cached context, beside a decode.
        StepInput([_chunk(runner, 0, 10, 22, sample=True), _chunk(runner, 1, 7, 8, sample=True)]),
        # A chunk of two drafts (three sampled rows), a decode and a fresh prompt.
        StepInput(
            [
                _chunk(runner, 1, 8, 11, sample=True, num_drafts=2),
                _chunk(runner, 0, 22, 23, sample=True),
                _chunk(runner, 2, 0, 30, sample=True),
            ]
        ),
        # Only chunks that sample nothing.
        StepInput(
            [_chunk(runner, 0, 23, 26, sample=False), _chunk(runner, 1, 11, 12, sample=False)]
        ),
    ]


def _run(runner: ModelRunner) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each step's logits, and every layer's K and V cache after the last step."""
    logits = [runner.execute(step).logits for step in _steps(runner)]
    caches = [
        t.clone()
        for layer in runner.model.attention_layers()
        for t in (layer.k_cache, layer.v_cache)
    ]
    return logits, caches


def test_the_sampled_rows_alone_give_the_logits_and_cache_of_every_row(model_dir):
    selecting = ModelRunner(model_dir, NUM_BLOCKS, BLOCK, 128)
    every_row = ModelRunner(model_dir, NUM_BLOCKS, BLOCK, 128)
    every_row._selecting = lambda *args: None  # the last layer computes every row
    logits, caches = _run(selecting)
    ref_logits, ref_caches = _run(every_row)
    assert [t.shape for t in logits] == [(1, 320), (2, 320), (5, 320), (0, 320)]
    for got, want in zip(logits, ref_logits, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    # Every row's K/V was written, in every layer, the last included.
    for got, want in zip(caches, ref_caches, strict=True):
        assert torch.equal(got, want)


def test_the_last_layer_runs_its_mlp_on_the_sampled_rows(model_dir):
    runner = ModelRunner(model_dir, NUM_BLOCKS, BLOCK, 128)
    layers = runner.model.model.layers
    rows: dict[str, list[int]] = {"first": [], "last": []}
    layers[0].mlp.register_forward_hook(lambda m, args, out: rows["first"].append(len(args[0])))
    layers[-1].mlp.register_forward_hook(lambda m, args, out: rows["last"].append(len(args[0])))
    for step in _steps(runner):
        runner.execute(step)
    assert rows["first"] == [17, 13, 34, 4]
    # One row for a step that samples nothing: its K/V are all the step needs.
    assert rows["last"] == [1, 2, 5, 1]


def test_prompt_logprobs_keep_every_row(model_dir):
    runner = ModelRunner(model_dir, NUM_BLOCKS, BLOCK, 128)
    last = runner.model.model.layers[-1]
    rows: list[int] = []
    last.mlp.register_forward_hook(lambda m, args, out: rows.append(len(args[0])))
    chunk = _chunk(runner, 2, 0, 12, sample=True)
    chunk.prompt_targets, chunk.prompt_top_n = TOKENS[2][1:12], 2
    out = runner.execute(StepInput([chunk]))
    assert rows == [12]
    assert out.logits.shape == (1, 320)
    assert out.prompt_logprobs[0].logprobs.shape == (11,)


def test_one_token_chunks_that_sample_nothing_still_write_their_kv(model_dir):
    """A prompt's one-token chunk that does not end it runs as a decode row that samples
    nothing: with no prefill chunk in the step, its K/V are still written."""
    selecting = ModelRunner(model_dir, NUM_BLOCKS, BLOCK, 128)
    every_row = ModelRunner(model_dir, NUM_BLOCKS, BLOCK, 128)
    every_row._selecting = lambda *args: None
    caches = []
    for runner in (selecting, every_row):
        steps = [
            StepInput(
                [_chunk(runner, 0, 0, 1, sample=False), _chunk(runner, 1, 0, 1, sample=False)]
            ),
            StepInput(
                [_chunk(runner, 0, 1, 5, sample=True), _chunk(runner, 1, 1, 2, sample=False)]
            ),
        ]
        logits = [runner.execute(step).logits for step in steps]
        assert [t.shape for t in logits] == [(0, 320), (1, 320)]
        caches.append([layer.k_cache.clone() for layer in runner.model.attention_layers()])
    for got, want in zip(*caches, strict=True):
        assert torch.equal(got, want)
