"""The gRPC surface's translations: protobuf messages <-> engine types, errors -> status.

Pure functions, so the router's gRPC methods stay short and the mapping is testable
without a server.
"""

from __future__ import annotations

import grpc

from serve_app.config import AppConfig
from serve_app.errors import public_error
from serve_app.grpc.api import baton_pb2 as pb
from serve_app.model_frontend import ModelFrontend, PromptInput
from workers.engine import (
    MAX_LOGPROBS,
    FinishReason,
    InvalidRequestError,
    RequestOutput,
    SamplingParams,
    StructuredOutput,
    TokenLogprob,
    default_budget_room,
)

FINISH_REASONS = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: pb.FINISH_REASON_ABORT,
}
DEFAULT_MAX_TOKENS = 256


def prompt_from_proto(request: pb.GenerateRequest | pb.TokenizeRequest) -> PromptInput:
    """The prompt of a GenerateRequest (oneof prompt) or TokenizeRequest (oneof input)."""
    oneofs = request.DESCRIPTOR.oneofs_by_name  # also holds proto3 optionals' synthetic ones
    oneof = oneofs.get("prompt") or oneofs["input"]
    which = request.WhichOneof(oneof.name)
    if which == "text":
        return PromptInput(text=request.text)
    if which == "chat":
        return PromptInput(messages=tuple((m.role, m.content) for m in request.chat.messages))
    if which == "token_ids":
        return PromptInput(token_ids=request.token_ids.ids)
    choices = ", ".join(f.name for f in oneof.fields)
    raise InvalidRequestError(f"{oneof.name}: set one of {choices}")


def params_from_proto(request: pb.GenerateRequest, room: int) -> SamplingParams:
    """The request's sampling parameters; `room` is what the context has left after its
    prompt. Unset, max_tokens is DEFAULT_MAX_TOKENS (or min_tokens, if more) or that
    room, whichever is less."""

    def opt(name: str, default):
        return getattr(request, name) if request.HasField(name) else default

    max_tokens = request.max_tokens
    if not request.HasField("max_tokens"):
        room = default_budget_room(room, request.min_tokens)
        max_tokens = min(max(DEFAULT_MAX_TOKENS, request.min_tokens), room)
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=opt("temperature", 1.0),
        top_p=opt("top_p", 1.0),
        top_k=request.top_k,
        seed=opt("seed", None),
        ignore_eos=request.ignore_eos,
        stop_token_ids=tuple(request.stop_token_ids),
        stop=tuple(request.stop),
        logprobs=opt("logprobs", None),
        prompt_logprobs=opt("prompt_logprobs", None),
        skip_special_tokens=opt("skip_special_tokens", True),
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        repetition_penalty=opt("repetition_penalty", 1.0),
        min_p=request.min_p,
        logit_bias=dict(request.logit_bias),
        min_tokens=request.min_tokens,
        structured=structured_from_proto(request),
    )


def structured_from_proto(request: pb.GenerateRequest) -> StructuredOutput | None:
    if not request.HasField("structured_output"):
        return None
    constraint = request.structured_output
    which = constraint.WhichOneof("constraint")
    param = f"structured_output.{which}"
    if which == "json_schema":
        return StructuredOutput.json_schema(constraint.json_schema, param)
    if which == "json_object":
        if not constraint.json_object:
            raise InvalidRequestError(f"{param}: must be true when set", param=param)
        return StructuredOutput("json_object", param=param)
    if which == "regex":
        return StructuredOutput("regex", constraint.regex, param)
    if which == "choice":
        return StructuredOutput.choice(list(constraint.choice.choices), param)
    if which == "grammar":
        return StructuredOutput("grammar", constraint.grammar, param)
    raise InvalidRequestError(
        "structured_output: set one of json_schema, json_object, regex, choice, grammar",
        param="structured_output",
    )


def _logprob_to_proto(lp: TokenLogprob) -> pb.TokenLogprob:
    return pb.TokenLogprob(
        token_id=lp.token_id,
        logprob=lp.logprob,
        top_logprobs=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top],
        rank=lp.rank,
    )


def response_from_outputs(request_id: str, outputs: list[RequestOutput]) -> pb.GenerateResponse:
    """One response for one or more consecutive outputs of a request (the unary call
    merges all of them); the last one's finish reason and usage, if it is finished."""
    last = outputs[-1]
    response = pb.GenerateResponse(
        request_id=request_id,
        text="".join(o.new_text for o in outputs),
        token_ids=[t for o in outputs for t in o.new_token_ids],
        logprobs=[_logprob_to_proto(lp) for o in outputs for lp in o.new_logprobs],
        finish_reason=FINISH_REASONS[last.finish_reason],
    )
    if outputs[0].prompt_logprobs is not None:
        response.prompt_logprobs.extend(_logprob_to_proto(lp) for lp in outputs[0].prompt_logprobs)
    if last.finished:
        response.usage.CopyFrom(
            pb.Usage(
                prompt_tokens=last.num_prompt_tokens,
                completion_tokens=last.num_output_tokens,
                cached_prompt_tokens=last.num_cached_tokens,
            )
        )
    return response


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and a traceback-free message for an exception."""
    kind, message = public_error(exc)
    return {
        "invalid": grpc.StatusCode.INVALID_ARGUMENT,
        "unauthenticated": grpc.StatusCode.UNAUTHENTICATED,
        "overloaded": grpc.StatusCode.RESOURCE_EXHAUSTED,
        "unavailable": grpc.StatusCode.UNAVAILABLE,
        "cancelled": grpc.StatusCode.CANCELLED,
        "internal": grpc.StatusCode.INTERNAL,
    }[kind], message


def set_status(grpc_context: grpc.ServicerContext, exc: BaseException) -> None:
    """The status a failed call answers with. A unary method then returns an empty
    message: the context travels back with it and Serve's proxy answers with the code set
    there (raising would too, but makes Serve log a traceback per refused request). A
    streaming method raises: with no message, no context reaches the proxy."""
    code, message = status_for(exc)
    grpc_context.set_code(code)
    grpc_context.set_details(message)


def model_info(
    config: AppConfig,
    served_model_name: str,
    frontend: ModelFrontend,
    dtypes: dict[str, str],
    replica_counts: dict[str, int],
) -> pb.ModelInfo:
    """GetModelInfo's reply: the model, and each side of the service (an aggregated pool
    is both prefill and decode). `dtypes` by pool; `replica_counts` running, by deployment."""
    pools = config.pools()
    prefill, decode = (pools.get(role, config.aggregated) for role in ("prefill", "decode"))
    both = replica_counts.get("EngineServer", 0)
    return pb.ModelInfo(
        model_id=served_model_name,
        max_model_len=frontend.max_model_len,
        vocab_size=frontend.vocab_size,
        block_size=config.block_size,
        eos_token_ids=frontend.eos_token_ids,
        has_chat_template=frontend.tokenizer.has_chat_template,
        max_logprobs=MAX_LOGPROBS,
        mode=config.mode,
        prefill_tensor_parallel_size=prefill.tensor_parallel_size,
        decode_tensor_parallel_size=decode.tensor_parallel_size,
        num_prefill_replicas=replica_counts.get("PrefillServer", both),
        num_decode_replicas=replica_counts.get("DecodeServer", both),
        prefill_dtype=dtypes.get("prefill", dtypes.get("aggregated")),
        decode_dtype=dtypes.get("decode", dtypes.get("aggregated")),
    )
