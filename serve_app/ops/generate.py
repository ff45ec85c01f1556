"""`baton generate`: one completion, streamed to stdout, from the service over gRPC or
(`--local`) from an engine in this process."""

from __future__ import annotations

import argparse
import logging
import sys
import uuid

log = logging.getLogger("baton")

# grpc_service.DEFAULT_MAX_TOKENS (tests/test_cli.py holds them equal), spelled out so
# that `baton --help` imports no protobuf.
DEFAULT_MAX_TOKENS = 256


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help=f"new tokens at most (default {DEFAULT_MAX_TOKENS}, or the context's room if less)",
    )
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--seed", type=int, default=None, help="makes sampling reproducible")


def _sampling(args: argparse.Namespace) -> dict:
    return {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "seed": args.seed,
    }


def _messages(args: argparse.Namespace) -> list[dict[str, str]] | None:
    if args.system is not None and not args.chat:
        raise ValueError("--system needs --chat: a system message only exists in a chat")
    if not args.chat:
        return None
    messages = [{"role": "user", "content": args.prompt}]
    if args.system is not None:
        messages.insert(0, {"role": "system", "content": args.system})
    return messages


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def generate(args: argparse.Namespace) -> int:
    messages = _messages(args)
    if not args.local:
        if args.dtype is not None or args.speculative_tokens or args.activations is not None:
            raise ValueError(
                "--dtype, --speculative-tokens and --activations need --local: the service "
                "runs what it was deployed with"
            )
        return _generate_remote(args, messages)
    # Heavy imports wait until a command needs them, so `baton --help` is instant.
    from workers.engine import (
        EngineConfig,
        LLMEngine,
        SamplingParams,
        SpeculativeConfig,
        default_budget_room,
    )
    from workers.model import resolve_model

    model = str(resolve_model(args.model))
    log.info("loading %s", model)
    speculative = (
        SpeculativeConfig(num_tokens=args.speculative_tokens) if args.speculative_tokens else None
    )
    # Unset: EngineConfig's default.
    activations = {} if args.activations is None else {"activations": args.activations}
    engine = LLMEngine(
        EngineConfig(
            model=model, dtype=args.dtype or "auto", speculative=speculative, **activations
        )
    )
    if messages is not None:
        prompt_ids = engine.tokenizer.encode_chat(messages)
    else:
        prompt_ids = engine.tokenizer.encode(args.prompt)
    sampling = _sampling(args)
    if sampling["max_tokens"] is None:  # as the service's default (baton.proto)
        room = default_budget_room(engine.max_model_len - len(prompt_ids), 0)
        sampling["max_tokens"] = min(DEFAULT_MAX_TOKENS, room)
    engine.add_request(uuid.uuid4().hex, prompt_ids, SamplingParams(**sampling))
    last = None
    while engine.has_unfinished():
        for last in engine.step():
            _write(last.new_text)
    # The newline ends the completion before the summary, so a terminal showing
    # both streams does not run the log line into the text.
    _write("\n")
    if last is not None:
        log.info(
            "finish_reason=%s prompt_tokens=%d completion_tokens=%d",
            last.finish_reason.value,
            last.num_prompt_tokens,
            last.num_output_tokens,
        )
    return 0


def _remote_request(args: argparse.Namespace, messages: list[dict] | None):
    """The GenerateRequest `baton generate` sends: flags left unset stay absent, so the
    service's defaults (baton.proto) apply."""
    from serve_app.ops.client import generate_request

    sampling = {k: v for k, v in _sampling(args).items() if v is not None}
    return generate_request(
        args.prompt if messages is None else None, messages=messages, **sampling
    )


def _check_served_model(wanted: str, served: str) -> None:
    """Without --local, --model names the model the caller expects the service to serve.
    Compared without case: a bundled model is served under its folder's name
    (SmolLM2-135M-Instruct for smollm2-135m-instruct)."""
    if wanted.lower() != served.lower():
        raise ValueError(
            f"--model {wanted!r}: the service at this address serves {served!r}; drop "
            "--model, or pass --local to run that model in this process"
        )


def _generate_remote(args: argparse.Namespace, messages: list[dict] | None) -> int:
    import grpc

    from serve_app.grpc.api import baton_pb2 as pb
    from serve_app.ops.client import BatonClient

    request = _remote_request(args, messages)
    last = None
    client_args = {"application": args.app} if args.app else {}
    with BatonClient(args.address, api_key=args.api_key, **client_args) as client:
        try:
            if args.model is not None:
                _check_served_model(args.model, client.model_info().model_id)
            for last in client.generate(request):
                _write(last.text)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise ValueError(e.details()) from None
            print(f"baton: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    _write("\n")
    if last is not None:
        log.info(
            "finish_reason=%s prompt_tokens=%d completion_tokens=%d cached_prompt_tokens=%d",
            pb.FinishReason.Name(last.finish_reason).removeprefix("FINISH_REASON_").lower(),
            last.usage.prompt_tokens,
            last.usage.completion_tokens,
            last.usage.cached_prompt_tokens,
        )
    return 0
