"""Structured output's cost: JSON-schema constrained against unconstrained decoding, and
the grammar engine's compile time, in one run.

Prints JSON lines:
- `structured.c8_tok_s.{constrained,unconstrained}` and
  `ratio.structured_c8_tok_s.constrained_over_unconstrained`: 8 concurrent requests on
  the same prompts, sampled at temperature 1 with the same seeds. Each round runs the
  constrained batch first, then the unconstrained one with every request's max_tokens set
  to the tokens its constrained twin generated (EOS ignored), so both batches have the
  same shape step by step and differ only by the grammar's work. Rounds alternate and
  the median is reported, since absolute speed drifts on a shared machine.
- `structured.compile_ms.{p50,p99,max}`: compiling each realistic schema below (a fresh
  compiler per round, so nothing is cached), and `structured.first_mask_ms.p50`: the
  first mask of each, where llguidance builds its lexer.

    .venv/bin/python bench/structured_output.py [--rounds 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import uuid

import torch
from common import cpu_count, emit, git_commit, log, median

from workers.engine.config import EngineConfig
from workers.engine.grammar_compiler import GrammarCompiler
from workers.engine.llm_engine import LLMEngine
from workers.engine.sampling_params import SamplingParams
from workers.engine.structured_output import StructuredOutput
from workers.model.model_cache import ensure_default_model

STREAMS = 8
MAX_TOKENS = 160

_STR = {"type": "string", "maxLength": 40}
# What applications send: pydantic models' schemas for extraction, function arguments,
# nested objects with $defs and enums, arrays, unions and formats.
SCHEMAS: dict[str, dict] = {
    "person": {
        "type": "object",
        "properties": {
            "name": _STR,
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "city": _STR,
            "hobbies": {"type": "array", "items": _STR, "maxItems": 4},
        },
        "required": ["name", "age", "city", "hobbies"],
        "additionalProperties": False,
    },
    "weather_call": {
        "type": "object",
        "properties": {
            "location": {"type": "string", "description": "City and country"},
            "unit": {"enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 14},
        },
        "required": ["location", "unit"],
    },
    "invoice": {
        "$defs": {
            "Item": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                    "quantity": {"type": "integer", "minimum": 1},
                    "price": {"type": "number", "minimum": 0},
                },
                "required": ["sku", "quantity", "price"],
            },
            "Address": {
                "type": "object",
                "properties": {"street": _STR, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["street", "zip"],
            },
        },
        "type": "object",
        "properties": {
            "id": {"type": "string", "format": "uuid"},
            "date": {"type": "string", "format": "date"},
            "billing": {"$ref": "#/$defs/Address"},
            "shipping": {"anyOf": [{"$ref": "#/$defs/Address"}, {"type": "null"}]},
            "items": {"type": "array", "items": {"$ref": "#/$defs/Item"}, "minItems": 1},
            "status": {"enum": ["draft", "sent", "paid"]},
            "email": {"type": "string", "format": "email"},
        },
        "required": ["id", "date", "billing", "items", "status"],
    },
    "sentiment": {
        "type": "object",
        "properties": {
            "label": {"enum": ["positive", "negative", "neutral"]},
            "score": {"type": "number", "minimum": 0, "maximum": 1},
            "reasons": {"type": "array", "items": {"type": "string"}},
        },
        "required": ["label", "score"],
    },
    "tree": {
        "$defs": {
            "Node": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "children": {"type": "array", "items": {"$ref": "#/$defs/Node"}},
                },
                "required": ["name"],
            }
        },
        "$ref": "#/$defs/Node",
    },
    "wide_form": {
        "type": "object",
        "properties": {
            f"field_{i}": [_STR, {"type": "integer"}, {"type": "boolean"}][i % 3] for i in range(40)
        },
        "required": [f"field_{i}" for i in range(0, 40, 2)],
    },
}
TOPICS = ["a pirate", "a chef in Paris", "an astronaut", "a jazz musician"]
TOPICS += ["a farmer", "a painter", "a doctor in Tokyo", "a sailor"]


def _run(engine: LLMEngine, prompts, params: list[SamplingParams]) -> tuple[float, list[int]]:
    """(aggregate output tokens/s, each request's output length)."""
    ids = [uuid.uuid4().hex for _ in prompts]
    start = time.perf_counter()
    for rid, prompt, p in zip(ids, prompts, params, strict=True):
        engine.add_request(rid, prompt, p)
    lengths = dict.fromkeys(ids, 0)
    while engine.has_unfinished():
        for out in engine.step():
            lengths[out.request_id] += len(out.new_token_ids)
    elapsed = time.perf_counter() - start
    return sum(lengths.values()) / elapsed, [lengths[r] for r in ids]


def throughput(engine: LLMEngine, rounds: int) -> None:
    spec = StructuredOutput.json_schema(SCHEMAS["person"])
    prompts = [
        engine.tokenizer.encode_chat(
            [{"role": "user", "content": f"Invent {t}. Reply in JSON: name, age, city, hobbies."}]
        )
        for t in TOPICS[:STREAMS]
    ]
    engine.grammars.compile(spec)  # compile time is measured below, not here
    constrained_rates, plain_rates = [], []
    for r in range(rounds):
        seeds = [1000 * r + i for i in range(STREAMS)]
        constrained = [
            SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=s, structured=spec)
            for s in seeds
        ]
        rate, lengths = _run(engine, prompts, constrained)
        plain = [
            SamplingParams(max_tokens=n, temperature=1.0, seed=s, ignore_eos=True)
            for s, n in zip(seeds, lengths, strict=True)
        ]
        plain_rate, _ = _run(engine, prompts, plain)
        constrained_rates.append(rate)
        plain_rates.append(plain_rate)
        log(f"round {r}: constrained {rate:.1f} tok/s, unconstrained {plain_rate:.1f} tok/s, "
            f"lengths {lengths}")  # fmt: skip
    context = dict(streams=STREAMS, rounds=rounds, schema="person", commit=git_commit())
    c, u = median(constrained_rates), median(plain_rates)
    emit("structured.c8_tok_s.constrained", c, "tok/s", **context)
    emit("structured.c8_tok_s.unconstrained", u, "tok/s", **context)
    ratios = [a / b for a, b in zip(constrained_rates, plain_rates, strict=True)]
    emit(
        "ratio.structured_c8_tok_s.constrained_over_unconstrained",
        median(ratios),
        "ratio",
        per_round=[round(x, 3) for x in ratios],
        **context,
    )


def compile_times(engine: LLMEngine, rounds: int) -> None:
    compile_ms, mask_ms = [], []
    for _ in range(rounds):
        compiler = GrammarCompiler(
            engine.tokenizer.hf, engine.model_config.vocab_size, engine.eos_token_ids
        )
        compiler.compile(StructuredOutput("json_object"))  # builds the tokenizer once
        for schema in SCHEMAS.values():
            spec = StructuredOutput.json_schema(json.dumps(schema))
            start = time.perf_counter()
            matcher = compiler.matcher(spec)
            compile_ms.append((time.perf_counter() - start) * 1e3)
            bits = torch.zeros(1, (compiler.vocab_size + 31) // 32, dtype=torch.int32)
            start = time.perf_counter()
            matcher.fill(bits, 0)
            mask_ms.append((time.perf_counter() - start) * 1e3)
    compile_ms.sort()
    context = dict(schemas=len(SCHEMAS), samples=len(compile_ms), commit=git_commit())
    emit("structured.compile_ms.p50", statistics.median(compile_ms), "ms", **context)
    p99 = compile_ms[min(len(compile_ms) - 1, round(0.99 * (len(compile_ms) - 1)))]
    emit("structured.compile_ms.p99", p99, "ms", **context)
    emit("structured.compile_ms.max", compile_ms[-1], "ms", **context)
    emit("structured.first_mask_ms.p50", statistics.median(mask_ms), "ms", **context)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=min(2, cpu_count()))
    args = parser.parse_args()
    engine = LLMEngine(EngineConfig(model=str(ensure_default_model()), num_threads=args.threads))
    compile_times(engine, max(args.rounds, 5))
    throughput(engine, args.rounds)


if __name__ == "__main__":
    main()
