"""The one-call decode step (fused_decode.py) against the modules it replaces: the same
logits and the same KV cache, bit for bit, on a model converted from a quantized GGUF."""

from __future__ import annotations

import pytest
import torch
from conftest import write_tiny_gguf
from tiny_model import make_tiny_model

from workers.model import kernels
from workers.model.gguf_import import convert_gguf
from workers.runner.model_runner import ModelRunner
from workers.runner.step_io import SeqChunk, StepInput

pytestmark = pytest.mark.skipif(kernels.library() is None, reason="needs Baton's CPU kernels")

BLOCK = 16
PROMPTS = [[5, 9, 14, 77, 3, 41, 8, 19, 60, 2, 33, 90, 17, 11, 4, 6, 70], [7, 8, 9], [120, 64]]


@pytest.fixture(scope="module")
def gguf_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fused")
    write_tiny_gguf(folder / "tiny.gguf", quantized=True)
    return convert_gguf(folder / "tiny.gguf", folder / "model")


def _runner(model_dir) -> ModelRunner:
    return ModelRunner(model_dir, num_blocks=32, block_size=BLOCK, max_model_len=128)


def _tables(seq: int, length: int) -> list[list[int]]:
    """Sequence `seq`'s blocks (seq, seq + 3, ...), interleaved with the others'."""
    return [[seq + 3 * i for i in range(-(-length // BLOCK))]]


class _Sequences:
    """Sequences decoding greedily through a runner, step by step."""

    def __init__(self, prompts: list[list[int]]):
        self.tokens = [list(p) for p in prompts]
        self.cached = [0] * len(prompts)

    def chunk(self, seq: int) -> SeqChunk:
        tokens, start = self.tokens[seq], self.cached[seq]
        return SeqChunk(tokens[start:], start, _tables(seq, len(tokens)), sample=True)

    def advance(self, seqs: list[int], logits: torch.Tensor) -> None:
        for seq, row in zip(seqs, logits, strict=True):
            self.cached[seq] = len(self.tokens[seq])
            self.tokens[seq].append(int(row.argmax()))


def _run(runner: ModelRunner, schedule: list[list[int]]) -> list[torch.Tensor]:
    """Logits of each step; a step is the sequences it advances, each by its uncached
    tokens (its prompt first, one token after)."""
    seqs, out = _Sequences(PROMPTS), []
    for step in schedule:
        logits = runner.execute(StepInput([seqs.chunk(s) for s in step])).logits
        seqs.advance(step, logits)
        out.append(logits)
    return out


# Prefill all, then decode steps of 3, 1 and 2 rows, and a step mixing a late prefill
# (sequence 2 joins) with decodes, which the fused step leaves to the modules.
SCHEDULE = [[0, 1], [0, 1], [1], [0, 1], [2, 0], [0, 1, 2], [2], [1, 2, 0], [0, 1, 2]]


def test_fused_steps_give_the_modules_floats(gguf_model):
    fused, modules = _runner(gguf_model), _runner(gguf_model)
    assert fused.model.fused_decode is not None
    modules.model.fused_decode = None
    got, want = _run(fused, SCHEDULE), _run(modules, SCHEDULE)
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), f"step {step}: logits differ by {(a - b).abs().max()}"
    assert torch.equal(fused.kv_cache, modules.kv_cache)


@pytest.mark.parametrize("bits", [16, 8])
def test_fused_steps_with_rounded_activations_give_the_modules_floats(gguf_model, bits):
    fused = ModelRunner(gguf_model, 32, BLOCK, 128, activation_bits=bits)
    modules = ModelRunner(gguf_model, 32, BLOCK, 128, activation_bits=bits)
    exact = _runner(gguf_model)
    assert fused.model.fused_decode is not None
    assert fused.model.fused_decode._shape.activation_bits == bits
    modules.model.fused_decode = None
    got, want = _run(fused, SCHEDULE), _run(modules, SCHEDULE)
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), f"step {step}: logits differ by {(a - b).abs().max()}"
    assert torch.equal(fused.kv_cache, modules.kv_cache)
    # The first one-row step (the third) is the first to take the rounded input.
    exact_logits = _run(exact, SCHEDULE)
    differ = [not torch.equal(a, b) for a, b in zip(got, exact_logits, strict=True)]
    assert differ[:3] == [False, False, True]


def test_the_engine_option_reaches_every_projection(gguf_model):
    from workers.engine.config import EngineConfig
    from workers.engine.llm_engine import LLMEngine
    from workers.model.parallel import PackableLinear

    for activations, bits in (("int8", 8), ("int16", 16), (None, 32)):
        options = {} if activations is None else {"activations": activations}
        engine = LLMEngine(EngineConfig(model=str(gguf_model), **options))
        model = engine.runner.model
        with_blocks = [
            m for m in model.modules() if isinstance(m, PackableLinear) and m.blocks is not None
        ]
        assert with_blocks and all(m.activation_bits == bits for m in with_blocks)
        assert model.fused_decode is not None and model.fused_decode._shape.activation_bits == bits
    with pytest.raises(ValueError, match="activations must be one of exact, int16, int8"):
        EngineConfig(model=str(gguf_model), activations="int4")


def test_pure_decode_steps_run_without_the_modules(gguf_model):
    runner = _runner(gguf_model)
    seqs = _Sequences(PROMPTS)
    seqs.advance([0, 1, 2], runner.execute(StepInput([seqs.chunk(s) for s in range(3)])).logits)

    def refuse(*args, **kwargs):
        raise AssertionError("a pure-decode step went through the modules")

    runner.model.model.forward = refuse
    logits = runner.execute(StepInput([seqs.chunk(s) for s in range(3)])).logits
    assert logits.shape[0] == 3 and torch.isfinite(logits).all()
    # A step with a prompt in it is the modules'.
    seqs.tokens.append([1, 2, 3])
    seqs.cached.append(0)
    with pytest.raises(AssertionError, match="through the modules"):
        runner.execute(StepInput([seqs.chunk(s) for s in range(4)]))


def test_a_model_without_blocks_runs_on_the_modules(tmp_path):
    runner = _runner(make_tiny_model(tmp_path))
    assert runner.model.fused_decode is None
    assert runner.small_step_rows == 0  # its matmuls are torch's, at torch's threads


def test_small_steps_of_a_model_in_blocks_run_on_the_kernels(gguf_model):
    assert _runner(gguf_model).small_step_rows == kernels.team_max_rows() == 64


def test_a_table_out_of_range_is_refused(gguf_model):
    runner = _runner(gguf_model)
    seqs = _Sequences(PROMPTS[:1])
    seqs.advance([0], runner.execute(StepInput([seqs.chunk(0)])).logits)
    chunk = seqs.chunk(0)
    chunk.block_tables = [[31, 99]]  # block 99 of 32
    with pytest.raises(RuntimeError, match="out of range"):
        runner.execute(StepInput([chunk]))
