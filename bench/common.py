"""Shared helpers for benchmarks: one JSON object per line on stdout."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent

# stdout carries the JSON lines alone: whatever else prints to sys.stdout (Ray's driver
# relays its workers' error messages there, as at serve.shutdown) goes to stderr.
_JSON_OUT = sys.stdout
sys.stdout = sys.stderr


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=_ROOT, capture_output=True, text=True
        )
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def emit(metric: str, value: float, unit: str, **context) -> None:
    line = {"metric": metric, "value": round(float(value), 6), "unit": unit, **context}
    print(json.dumps(line), file=_JSON_OUT, flush=True)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def median(values: list[float]) -> float:
    return statistics.median(values)


def cpu_count() -> int:
    return len(os.sched_getaffinity(0))


TOPICS = [
    "the history of the printing press",
    "how volcanoes form",
    "the rules of chess",
    "photosynthesis in plants",
    "the life of honey bees",
    "how a compiler works",
    "the water cycle",
    "the French revolution",
    "black holes",
    "the human immune system",
    "how to bake bread",
    "the Roman empire",
    "electric cars",
    "the ocean tides",
    "machine learning",
    "the Great Wall of China",
    "jazz music",
    "the Moon landing",
    "climate change",
    "the internet",
    "ancient Egypt",
    "quantum computing",
    "the Amazon rainforest",
    "the Olympic games",
    "coffee",
    "earthquakes",
    "the stock market",
    "dinosaurs",
    "the solar system",
    "renewable energy",
    "the violin",
    "origami",
]


def topic_prompt(tokenizer, topic: str, length: int) -> list[int]:
    """Natural text about `topic`, cut to exactly `length` tokens."""
    text = f"Here is a long, careful essay about {topic}, its origins, its key facts and why it "
    text += "matters to people today. "
    ids = tokenizer.encode(text * (1 + length // 8))
    if len(ids) < length:
        raise RuntimeError(f"the {topic!r} text has only {len(ids)} tokens")
    return ids[:length]
