"""How often rounding one sequence's matmul input to 16 or 8 bits
(EngineConfig.activations "int16" and "int8") changes greedy output against the exact
path (the default), and what it buys, on a bundled GGUF model.

Each prompt is decoded greedily alone (one sequence: the steps the option changes) by an
engine per setting, --new-tokens each. Prompts: the fidelity tests' plain and chat
prompts, then --topics chat questions about TOPICS (as "Question: ... Answer:" text for a
model without a chat template). Printed as JSON lines, per rounded
setting (`path`):
- `identical_share`: the share of prompts whose output is token for token the exact
  path's, and `common_prefix_share`: of all exact output tokens, those before the
  first difference;
- `reference_agreement` (unless --no-reference): teacher-forced, each output token
  against transformers' own argmax after the same tokens (one forward pass per
  output), for every setting: the share of positions that agree;
- `single_stream_decode_tok_s` for every setting and `ratio.single_stream.<path>_over_exact`,
  rounds interleaved, medians.

    .venv/bin/python bench/activation_agreement.py [--model smollm2-135m-instruct|gemma3-270m]
        [--new-tokens 64] [--topics 20] [--rounds 3] [--threads 1] [--no-reference]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import uuid
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from common import TOPICS, emit, git_commit, log, median  # noqa: E402

from workers.engine.config import ACTIVATIONS, EngineConfig  # noqa: E402
from workers.engine.llm_engine import LLMEngine  # noqa: E402
from workers.engine.sampling_params import SamplingParams  # noqa: E402
from workers.model.bundled_model import BUNDLED_MODELS, DEFAULT_MODEL  # noqa: E402
from workers.model.model_cache import ensure_gguf, ensure_model  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from fidelity_helpers import PLAIN  # noqa: E402

CHATS = [
    "What is the boiling point of water?",
    "Write a Python one-liner that reverses a string.",
]
SPEED_PROMPT_TOPIC = "the history of bridges"


def greedy_alone(engine: LLMEngine, prompt: list[int], max_tokens: int, ignore_eos=False):
    """The tokens of one greedy request decoded alone, and the decode tokens/s after its
    first token."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos)
    engine.add_request(uuid.uuid4().hex, prompt, params)
    tokens: list[int] = []
    first = None
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
            if first is None:
                first = time.perf_counter()
    rate = (len(tokens) - 1) / (time.perf_counter() - first) if len(tokens) > 1 else 0.0
    return tokens, rate


def reference_agreement(model, prompt: list[int], output: list[int]) -> tuple[int, int]:
    """(positions where transformers' argmax after prompt + output[:i] is output[i],
    positions)."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + output])).logits[0]
    theirs = logits[len(prompt) - 1 : -1].argmax(-1).tolist()
    return sum(a == b for a, b in zip(output, theirs, strict=True)), len(output)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, choices=sorted(BUNDLED_MODELS))
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--topics", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-reference", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    bundled = BUNDLED_MODELS[args.model]
    model_dir = str(ensure_model(bundled))
    engines = {
        name: LLMEngine(EngineConfig(model=model_dir, num_threads=args.threads, activations=name))
        for name in ACTIVATIONS
    }
    tok = engines["exact"].tokenizer

    def ask(question: str) -> list[int]:
        """A user turn through the chat template, or as plain text where the model has
        none (the bundled Gemma 3 GGUF)."""
        if tok.has_chat_template:
            return tok.encode_chat([{"role": "user", "content": question}])
        return tok.encode(f"Question: {question}\nAnswer:")

    prompts = [tok.encode(p) for p in PLAIN]
    prompts += [ask(c) for c in CHATS]
    prompts += [ask(f"Tell me about {topic}.") for topic in TOPICS[: args.topics]]
    context = {"model": args.model, "new_tokens": args.new_tokens, "prompts": len(prompts)}
    outputs = {
        name: [greedy_alone(e, p, args.new_tokens)[0] for p in prompts]
        for name, e in engines.items()
    }
    rounded = [name for name in ACTIVATIONS if name != "exact"]
    for name in rounded:
        identical, common, total = 0, 0, 0
        for exact, other in zip(outputs["exact"], outputs[name], strict=True):
            identical += exact == other
            if exact == other:
                common += len(exact)
            else:  # up to the first difference, or the shorter one's end
                pairs = enumerate(zip(exact, other, strict=False))
                common += next((i for i, (a, b) in pairs if a != b), min(len(exact), len(other)))
            total += len(exact)
        emit("identical_share", identical / len(prompts), "share", path=name, **context)
        emit("common_prefix_share", common / total, "share", path=name, **context)
    if not args.no_reference:
        from transformers import AutoModelForCausalLM

        gguf = ensure_gguf(bundled)
        reference = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        ).eval()
        for name in engines:
            agree = [
                reference_agreement(reference, p, o)
                for p, o in zip(prompts, outputs[name], strict=True)
            ]
            share = sum(a for a, _ in agree) / sum(n for _, n in agree)
            emit("reference_agreement", share, "share", path=name, **context)
    speed_prompt = ask(f"Tell me about {SPEED_PROMPT_TOPIC}.")
    rates: dict[str, list[float]] = {name: [] for name in engines}
    for r in range(args.rounds):
        for name, engine in engines.items():
            rates[name].append(greedy_alone(engine, speed_prompt, 128, ignore_eos=True)[1])
            log(f"round {r + 1} {name}: {rates[name][-1]:.1f} tok/s")
    for name in engines:
        emit(
            "single_stream_decode_tok_s",
            median(rates[name]),
            "tok/s",
            path=name,
            threads=args.threads,
            commit=git_commit(),
            **context,
        )
    for name in rounded:
        emit(
            f"ratio.single_stream.{name}_over_exact",
            median(rates[name]) / median(rates["exact"]),
            "ratio",
            threads=args.threads,
            **context,
        )


if __name__ == "__main__":
    main()
