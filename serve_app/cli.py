"""The `baton` command."""

from __future__ import annotations

import argparse
import logging
import sys
import uuid

log = logging.getLogger("baton")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256, help="new tokens at most (default 256)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--seed", type=int, default=None, help="makes sampling reproducible")


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="baton", description="Baton LLM inference")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate a completion and stream it to stdout")
    gen.add_argument("prompt", help="the prompt, or the user message with --chat")
    gen.add_argument(
        "--model",
        default=None,
        help="local Hugging Face Llama-family folder (default: bundled SmolLM2-135M-Instruct)",
    )
    gen.add_argument("--chat", action="store_true", help="render PROMPT with the chat template")
    gen.add_argument("--system", default=None, help="system message (with --chat)")
    _add_sampling_args(gen)
    return parser


def _generate(args: argparse.Namespace) -> int:
    # Heavy imports wait until a command needs them, so `baton --help` is instant.
    from workers.engine.config import EngineConfig
    from workers.engine.engine import LLMEngine
    from workers.engine.sampling_params import SamplingParams
    from workers.model.default_model import ensure_default_model

    if args.system is not None and not args.chat:
        raise ValueError("--system needs --chat: a system message only exists in a chat")
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )
    model = args.model or str(ensure_default_model())
    log.info("loading %s", model)
    engine = LLMEngine(EngineConfig(model=model))
    if args.chat:
        messages = [{"role": "user", "content": args.prompt}]
        if args.system is not None:
            messages.insert(0, {"role": "system", "content": args.system})
        prompt_ids = engine.tokenizer.encode_chat(messages)
    else:
        prompt_ids = engine.tokenizer.encode(args.prompt)
    engine.add_request(uuid.uuid4().hex, prompt_ids, params)
    last = None
    while engine.has_unfinished():
        for last in engine.step():
            sys.stdout.write(last.new_text)
            sys.stdout.flush()
    # The newline ends the completion before the summary, so a terminal showing
    # both streams does not run the log line into the text.
    sys.stdout.write("\n")
    sys.stdout.flush()
    if last is not None:
        log.info(
            "finish_reason=%s prompt_tokens=%d completion_tokens=%d",
            last.finish_reason.value,
            last.num_prompt_tokens,
            last.num_output_tokens,
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    args = _build_parser().parse_args(argv)
    from workers.model.default_model import ModelFetchError

    try:
        if args.command == "generate":
            return _generate(args)
    except (ValueError, ModelFetchError) as e:
        print(f"baton: error: {e}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
