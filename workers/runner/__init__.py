"""The runner package's public face: one forward step on a replica's model, in the
engine's process (`ModelRunner`) or over a tensor-parallel group of Ray actors
(`TPWorkerGroup`), and what serving code needs to reserve a TP replica's ranks."""

from workers.runner.model_runner import ModelRunner
from workers.runner.runner import Runner
from workers.runner.runner_spec import RunnerSpec
from workers.runner.step_io import SeqChunk, StepInput, StepOutput
from workers.runner.tp_group import TP_PLACEMENTS, TPWorkerGroup, rank_bundle

__all__ = [
    "TP_PLACEMENTS",
    "ModelRunner",
    "Runner",
    "RunnerSpec",
    "SeqChunk",
    "StepInput",
    "StepOutput",
    "TPWorkerGroup",
    "rank_bundle",
]
