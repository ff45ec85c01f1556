"""A small Python client of the gRPC API (what `baton generate` and the benchmark use).

Any gRPC client works against the service (the API is `protos/baton/v1/baton.proto`,
and server reflection is on for generic tools); this one only saves the boilerplate.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc

from serve_app.grpc.api import baton_pb2 as pb
from serve_app.grpc.api import baton_pb2_grpc as pb_grpc
from serve_app.serve_config import APP_NAME, GRPC_PORT, MAX_REQUEST_BYTES


def generate_request(
    prompt: str | list[int] | None = None,
    *,
    messages: list[dict[str, str]] | None = None,
    **sampling: Any,
) -> pb.GenerateRequest:
    """A GenerateRequest from a text prompt, token ids or chat messages plus sampling
    fields named as in the proto (max_tokens, temperature, stop, cache_salt...); a value
    the proto cannot hold is a ValueError naming its field. top_k=-1 (the engine's and
    vLLM's "off") is sent as 0, the proto's "off"."""
    request = pb.GenerateRequest()
    for name, value in sampling.items():
        if name == "top_k" and value == -1:
            value = 0
        try:
            request.MergeFrom(pb.GenerateRequest(**{name: value}))
        except (TypeError, ValueError) as e:
            raise ValueError(f"{name}: {e}") from None
    if messages is not None:
        request.chat.CopyFrom(pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in messages]))
    elif isinstance(prompt, str):
        request.text = prompt
    elif prompt is not None:
        request.token_ids.CopyFrom(pb.TokenIds(ids=list(prompt)))
    return request


class BatonClient:
    def __init__(
        self,
        address: str = f"localhost:{GRPC_PORT}",
        application: str = APP_NAME,
        api_key: str | None = None,
    ):
        """`api_key`: sent as `authorization: Bearer <key>` to a service that asks for one."""
        # Up to the service's own message limit, not grpc's 4 MiB: a long prompt's
        # prompt_logprobs with 20 alternatives each take ~230 bytes a token.
        self.channel = grpc.insecure_channel(
            address, options=[("grpc.max_receive_message_length", MAX_REQUEST_BYTES)]
        )
        self.stub = pb_grpc.BatonStub(self.channel)
        # Serve's gRPC proxy routes by this header when it serves several applications.
        self.metadata: tuple[tuple[str, str], ...] = (("application", application),)
        if api_key:
            self.metadata += (("authorization", f"Bearer {api_key}"),)

    def generate(
        self, request: pb.GenerateRequest, timeout: float | None = None
    ) -> Iterator[pb.GenerateResponse]:
        return self.stub.Generate(request, metadata=self.metadata, timeout=timeout)

    def generate_unary(
        self, request: pb.GenerateRequest, timeout: float | None = None
    ) -> pb.GenerateResponse:
        return self.stub.GenerateUnary(request, metadata=self.metadata, timeout=timeout)

    def tokenize(self, text: str) -> list[int]:
        response = self.stub.Tokenize(pb.TokenizeRequest(text=text), metadata=self.metadata)
        return list(response.token_ids)

    def model_info(self) -> pb.ModelInfo:
        return self.stub.GetModelInfo(pb.ModelInfoRequest(), metadata=self.metadata)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> BatonClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
