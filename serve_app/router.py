"""The router deployment: the service's front door, on both of Serve's proxies.

gRPC (baton.v1.Baton and grpc.health.v1.Health: Serve's gRPC proxy calls the method of
the RPC's name) and OpenAI-compatible HTTP (a FastAPI app) share one path: tokenize and
check the request (`ModelFrontend`), ask the prefix registry which replicas hold how much
of the prompt, and stream the engine outputs from the pool (decode, or aggregated) whose
Serve request router places the request by those hints. The replicas send token ids;
text and stop strings are applied here (`TextStream`), so the engine loops spend nothing
on text and a stop string ends the request for the client at once.
"""

import asyncio
import importlib.metadata
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.serve.grpc_util import RayServegRPCContext
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

from serve_app.api_keys import ApiKeys, authorization
from serve_app.config import AppConfig
from serve_app.errors import public_error, unavailable
from serve_app.grpc.api import baton_pb2 as pb
from serve_app.grpc.health import HealthService
from serve_app.grpc.service import (
    model_info,
    params_from_proto,
    prompt_from_proto,
    response_from_outputs,
    set_status,
)
from serve_app.grpc.servicer import MalformedRequest, decoded
from serve_app.metrics import RouterMetrics
from serve_app.model_frontend import ModelFrontend, PromptInput
from serve_app.openai import body as openai_body
from serve_app.openai import requests as openai_api
from serve_app.openai.responses import (
    Echo,
    ResponseBuilder,
    error_body,
    http_error,
    openai_http_error,
    sse_events,
    unaborted,
    without_completion,
)
from serve_app.openai.responses_api import ResponsesBuilder, ResponsesRequest, renamed
from serve_app.openai.tokenize import DetokenizeRequest, TokenizeRequest
from serve_app.pool_watch import PoolWatch, running_replicas
from serve_app.protocol import EngineRequest
from serve_app.routing.registry_lookup import RegistryLookup
from serve_app.routing.request_router import hints_can_route
from serve_app.serve_config import DEPLOYMENT_NAMES
from serve_app.streaming.output_demux import OutputDemux
from serve_app.streaming.stream_merge import merge_streams
from serve_app.streaming.text_stream import TextStream
from workers.engine import (
    EngineDeadError,
    FinishReason,
    InvalidRequestError,
    RequestOutput,
    SamplingParams,
    yield_to_engine_threads,
)
from workers.model import model_identity

logger = logging.getLogger(__name__)

try:
    BATON_VERSION = importlib.metadata.version("baton-llm")
except importlib.metadata.PackageNotFoundError:  # run from a checkout, not installed
    BATON_VERSION = "unknown"

# Prompts longer than this are tokenized on a worker thread, where the tokenizer lets go
# of the GIL: inline, a megabyte of text would stall every stream this router relays
# for seconds. Shorter ones stay inline, as the thread hop costs more than they do.
INLINE_TOKENIZE_CHARS = 16_384
# How long a request waits for the prefix registry's routing hints before going without.
REGISTRY_WAIT_S = 0.25
# A migrated request waits this long before its first new attempt, twice as long before
# each next one: Serve needs a moment to see a replica gone and route around it.
MIGRATION_BACKOFF_S = 0.25
# No generated docs: every path but /health needs the API key where one is set, and
# the API is OpenAI's, documented there.
http_app = FastAPI(
    title="Baton",
    description="OpenAI-compatible API of a Baton service",
    docs_url=None,
    redoc_url=None,
    openapi_url=None,
)

# An unknown path or method answers in OpenAI's error shape, as every other error.
http_app.add_exception_handler(StarletteHTTPException, openai_http_error)


async def _only_choice(
    outputs: AsyncIterator[RequestOutput],
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """A one-choice request's outputs in the (choice index, output) form of merge_streams."""
    async for out in outputs:
        yield 0, out


def _tool_names(req: openai_api.OpenAIRequest) -> list[str] | None:
    """The functions whose calls a chat's output is parsed for; None: no tools offered."""
    if not isinstance(req, openai_api.ChatCompletionRequest) or not req.offered_tools():
        return None
    return [t["function"]["name"] for t in req.offered_tools()]


def _grpc_authorization(grpc_context: RayServegRPCContext) -> str | None:
    return authorization(grpc_context.invocation_metadata())


# Helpers sit above the class: Serve pickles the ingress class by value when it is
# decorated, so names it uses must already exist.
@serve.ingress(http_app)
class Router(HealthService):
    def __init__(
        self,
        config: AppConfig,
        pool: DeploymentHandle,
    ):
        """`pool` streams outputs: the decode pool, or the aggregated one."""
        # Its threads wake for every token: they must not preempt an engine thread on
        # the same machine (workers/engine/thread_policy.py).
        yield_to_engine_threads()
        # First: a router told to check keys it cannot read fails before any other work.
        self.api_keys = None if config.api_key_file is None else ApiKeys(config.api_key_file)
        self.config = config
        model_dir = config.model_dir()
        self.model_id = model_identity(model_dir)
        self.frontend = ModelFrontend(
            model_dir, self.model_id, config.block_size, config.context_length(model_dir)
        )
        self.served_model_name = config.served_name(model_dir)
        # What "auto" means for each pool is the engine's rule, so ask the engine's config.
        self.dtypes = {
            role: config.engine_config(p, str(model_dir), self.model_id).resolved_dtype_name()
            for role, p in config.pools().items()
        }
        app_name = serve.get_replica_context().app_name
        # This application's registry: its own unless the config names a shared one.
        self.registry = RegistryLookup(config.prefix_registry(app_name), wait_s=REGISTRY_WAIT_S)
        # `_by_reference` is Serve's switch between its two handle channels (see
        # config.OutputChannel); a decode replica's prefill call is always an actor call
        # (engine_server.py), as its result carries ObjectRefs to the exported KV.
        self.pool = pool.options(stream=True, _by_reference=config.output_channel == "actor_call")
        self.metrics = RouterMetrics(app_name, self.served_model_name)
        self.max_migrations = config.router.max_migrations
        # The pool whose replicas stream the outputs: without one running, nothing serves.
        self.streaming_pool = "aggregated" if "aggregated" in config.pools() else "decode"
        self.pools = PoolWatch(DEPLOYMENT_NAMES[self.streaming_pool])
        self.demux = OutputDemux(self.pool.subscribe.remote)

    def __del__(self) -> None:
        # Serve calls this on graceful shutdown, and after a constructor that failed part
        # way: release the replicas' subscriptions now rather than after their idle time.
        if hasattr(self, "demux"):
            self.demux.close()

    def _authorize(self, header: str | None) -> None:
        """Unauthenticated unless the service is open or `header` carries one of its keys."""
        if self.api_keys is not None:
            self.api_keys.check(header)

    # -- the shared path -----------------------------------------------------------

    async def _engine_requests(
        self, ids: list[int], choices: list[SamplingParams], cache_salt: str | None
    ) -> list[tuple[EngineRequest, TextStream]]:
        """One engine request (and its text) per choice's parameters, all of one prompt."""
        # Internal ids are always fresh: two clients may send the same request_id.
        requests = [
            self.frontend.build_request(uuid.uuid4().hex, ids, p, cache_salt) for p in choices
        ]
        await self.frontend.check_structured(choices[0])  # the choices share it
        if requests[0].block_hashes and self._hints_can_route():
            hits = await self.registry.longest_prefixes(requests[0].block_hashes)
            requests = [replace(r, prefix_hits=hits) for r in requests]
        requests = [replace(r, router_id=self.demux.router_id) for r in requests]
        return [
            (r, self.frontend.text_stream(ids, p)) for r, p in zip(requests, choices, strict=True)
        ]

    async def _outputs(
        self, request: EngineRequest, text: TextStream, api: str
    ) -> AsyncIterator[RequestOutput]:
        """The pool's outputs for one choice of a checked request, with their text; its
        inter-token gaps and tokens go to the metrics (the request itself is counted
        around all its choices, by `RouterMetrics.request`).

        A replica that fails under the request (it dies, its engine fails, the output
        subscription is lost, it aborts the request as it shuts down) costs the client
        nothing: the request is migrated, sent again to the pool as its prompt and the
        tokens already sent (`SamplingParams.resumed_tokens`), and its stream goes on
        where it stopped, up to `RouterConfig.max_migrations` times."""
        last: RequestOutput | None = None
        last_at = time.perf_counter()
        emitted: list[int] = []  # the tokens sent on, which a migrated request resumes after
        migrations = 0
        try:
            while True:
                call = self.pool.generate.remote(request)
                outputs = self.demux.outputs(request.request_id, call)
                engine_done = False  # the engine's own last output arrived
                try:
                    async for out in outputs:
                        if out.finish_reason is FinishReason.ABORT:
                            # Not this router's cancel (it stops reading first): the
                            # replica is stopping under the request.
                            raise EngineDeadError("the replica stopped under the request")
                        engine_done = out.finished
                        emitted += out.new_token_ids
                        out = text.add(out)
                        now = time.perf_counter()
                        if last is not None and out.new_token_ids:
                            self.metrics.next_tokens(api, now - last_at, len(out.new_token_ids))
                        last, last_at = out, now
                        yield out
                        if text.stopped:
                            # The output ended at a stop string while the engine decodes.
                            break
                    return
                except Exception as e:
                    if not unavailable(e) or migrations >= self.max_migrations:
                        raise
                    migrations += 1
                    self.metrics.migrated(api)
                    logger.warning(
                        "request %s: its replica failed after %d tokens (%s); migrating it "
                        "(attempt %d of %d)",
                        request.request_id, len(emitted), e, migrations,
                        self.max_migrations,
                    )  # fmt: skip
                    await asyncio.sleep(MIGRATION_BACKOFF_S * 2 ** (migrations - 1))
                    request = await self._resumed(request, emitted)
                finally:
                    if not engine_done:
                        # Said outright (stop string, client gone, a failure), not left to
                        # Serve's parent-request bookkeeping or garbage collection: the
                        # replica's generator is cancelled now, so its engine aborts the
                        # request and frees its blocks at once.
                        call.cancel()
                    await outputs.aclose()  # its finally clauses only drop what it registered
        finally:
            self.metrics.generated(api, last.num_output_tokens if last else 0)

    async def _resumed(self, lost: EngineRequest, emitted: list[int]) -> EngineRequest:
        """`lost` to send again, with the tokens it already sent as the end of its prompt:
        a new id (the failed replica may still hold the old one), the block hashes and
        routing hints of the longer prompt, no prompt logprobs (they were sent)."""
        params = lost.params
        prompt = list(lost.prompt_token_ids)
        if emitted:
            # `emitted` holds every token sent since the client's request, whose prompt
            # is the lost one's less what an earlier migration resumed after.
            prompt = prompt[: len(prompt) - params.resumed_tokens] + emitted
            params = replace(params, resumed_tokens=len(emitted), prompt_logprobs=None)
        request = self.frontend.build_request(uuid.uuid4().hex, prompt, params, lost.cache_salt)
        if request.block_hashes and self._hints_can_route():
            hits = await self.registry.longest_prefixes(request.block_hashes)
            request = replace(request, prefix_hits=hits)
        return replace(request, router_id=self.demux.router_id)

    async def _tokenize(self, prompt: PromptInput, to_generate: bool = True) -> list[int]:
        """The prompt's tokens; refused first if it cannot fit the context (Tokenize, not
        `to_generate`, counts up to the context's length)."""
        self.frontend.check_size(prompt)
        if prompt.num_chars() > INLINE_TOKENIZE_CHARS:
            return await asyncio.to_thread(self.frontend.tokenize, prompt, to_generate)
        return self.frontend.tokenize(prompt, to_generate)

    def _refused(self, api: str, exc: BaseException) -> None:
        """Counts a request that failed before reaching a pool."""
        self.metrics.ended(api, public_error(exc)[0])

    # -- gRPC: baton.v1.Baton ----------------------------------------------------------

    async def _proto_outputs(
        self, request: pb.GenerateRequest, grpc_context: RayServegRPCContext
    ) -> AsyncIterator[RequestOutput]:
        started = time.perf_counter()
        try:
            self._authorize(_grpc_authorization(grpc_context))
            request = decoded(request)
            ids = await self._tokenize(prompt_from_proto(request))
            params = params_from_proto(request, self.frontend.room_after(ids))
            ((engine_request, text),) = await self._engine_requests(
                ids, [params], request.cache_salt or None
            )
        except Exception as e:
            self._refused("grpc", e)
            raise
        choice = _only_choice(self._outputs(engine_request, text, "grpc"))
        async for _, out in self.metrics.request("grpc", started, choice):
            yield out

    async def Generate(
        self, request: pb.GenerateRequest | MalformedRequest, grpc_context: RayServegRPCContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        rid = None
        try:
            async for out in self._proto_outputs(request, grpc_context):
                # Decoded by now: a malformed request fails before its first output.
                rid = rid or request.request_id or uuid.uuid4().hex
                yield response_from_outputs(rid, [out])
        except Exception as e:
            set_status(grpc_context, e)
            raise

    async def GenerateUnary(
        self, request: pb.GenerateRequest | MalformedRequest, grpc_context: RayServegRPCContext
    ) -> pb.GenerateResponse:
        try:
            outputs = [out async for out in self._proto_outputs(request, grpc_context)]
        except Exception as e:
            set_status(grpc_context, e)
            return pb.GenerateResponse()
        return response_from_outputs(request.request_id or uuid.uuid4().hex, outputs)

    async def Tokenize(
        self, request: pb.TokenizeRequest | MalformedRequest, grpc_context: RayServegRPCContext
    ) -> pb.TokenizeResponse:
        try:
            self._authorize(_grpc_authorization(grpc_context))
            ids = await self._tokenize(prompt_from_proto(decoded(request)), to_generate=False)
        except Exception as e:
            set_status(grpc_context, e)
            return pb.TokenizeResponse()
        return pb.TokenizeResponse(token_ids=ids, count=len(ids))

    async def GetModelInfo(
        self, request: pb.ModelInfoRequest, grpc_context: RayServegRPCContext
    ) -> pb.ModelInfo:
        try:
            self._authorize(_grpc_authorization(grpc_context))
            counts = await asyncio.to_thread(running_replicas)  # asks Serve's controller
        except Exception as e:
            set_status(grpc_context, e)
            return pb.ModelInfo()
        return model_info(self.config, self.served_model_name, self.frontend, self.dtypes, counts)

    # -- OpenAI-compatible HTTP -----------------------------------------------------------

    @http_app.get("/health")
    async def health(self):
        """200 {"status": "ok"} while the pools serve; "degraded" while the prefill pool
        has no running replica (decode prefills itself); 503 "unavailable" while the pool
        that streams outputs has none. Each pool's running replicas are in "pools"."""
        counts = await self._pool_counts()
        if not await self._serving():
            return JSONResponse({"status": "unavailable", "pools": counts}, 503)
        degraded = counts.get("prefill") == 0
        return {"status": "degraded" if degraded else "ok", "pools": counts}

    async def _pool_counts(self) -> dict[str, int]:
        """Running replicas per pool, as Serve's controller last said (the watch asks at
        most once per REFRESH_S: health probes come often; the first probe asks itself)."""
        by_deployment = self.pools.counts()
        if by_deployment is None:
            by_deployment = await asyncio.to_thread(running_replicas)
        return {role: by_deployment.get(DEPLOYMENT_NAMES[role], 0) for role in self.config.pools()}

    async def _serving(self) -> bool:
        counts = await self._pool_counts()
        return counts[self.streaming_pool] > 0

    def _hints_can_route(self) -> bool:
        """Whether to ask the registry: only while its hints can change a route, as Serve's
        controller last said. With one replica a pool, as `baton serve` deploys, the lookup
        would only add its round trip to every request."""
        pools = (DEPLOYMENT_NAMES[role] for role in self.config.pools())
        return hints_can_route(self.pools.counts(), pools)

    @http_app.get("/version")
    async def version(self) -> dict:
        return {"version": BATON_VERSION}

    @http_app.post("/tokenize")
    async def tokenize_http(self, raw: Request):
        """vLLM's: a prompt's token ids, counted against the context."""
        try:
            self._authorize(raw.headers.get("authorization"))
            req = openai_api.parse(TokenizeRequest, await openai_body.json_body(raw))
            if req.model != self.served_model_name:
                return self._model_not_found(req.model)
            ids = await self._tokenize(req.prompt_input(), to_generate=False)
        except Exception as e:
            return http_error(e)
        strs = [self._token_text(t) for t in ids] if req.return_token_strs else None
        return {
            "count": len(ids),
            "max_model_len": self.frontend.max_model_len,
            "tokens": ids,
            "token_strs": strs,
        }

    @http_app.post("/detokenize")
    async def detokenize_http(self, raw: Request):
        """vLLM's: token ids back to text (special tokens included)."""
        try:
            self._authorize(raw.headers.get("authorization"))
            req = openai_api.parse(DetokenizeRequest, await openai_body.json_body(raw))
            if req.model != self.served_model_name:
                return self._model_not_found(req.model)
            text = self.frontend.detokenize(req.tokens)
        except Exception as e:
            return http_error(e)
        return {"prompt": text}

    @http_app.get("/v1/models")
    async def models(self, raw: Request):
        try:
            self._authorize(raw.headers.get("authorization"))
        except Exception as e:
            return http_error(e)
        return {"object": "list", "data": [self._model_card()]}

    @http_app.get("/v1/models/{model:path}")
    async def model(self, model: str, raw: Request):
        try:
            self._authorize(raw.headers.get("authorization"))
        except Exception as e:
            return http_error(e)
        if model != self.served_model_name:
            return self._model_not_found(model)
        return self._model_card()

    def _model_card(self) -> dict:
        return {
            "id": self.served_model_name,
            "object": "model",
            "created": 0,
            "owned_by": "baton",
            "max_model_len": self.frontend.max_model_len,
        }

    def _model_not_found(self, model: str) -> JSONResponse:
        shown = model if len(model) <= 200 else model[:200] + "..."  # the client's, echoed
        message = f"model {shown!r} is not served here; use {self.served_model_name!r}"
        return JSONResponse(
            error_body(message, "invalid_request_error", "model", "model_not_found"), 404
        )

    @http_app.post("/v1/completions")
    async def completions(self, raw: Request):
        return await self._openai(raw, openai_api.CompletionRequest, chat=False)

    @http_app.post("/v1/chat/completions")
    async def chat_completions(self, raw: Request):
        return await self._openai(raw, openai_api.ChatCompletionRequest, chat=True)

    async def _openai(self, raw: Request, model: type, chat: bool):
        started = time.perf_counter()
        req = None
        try:
            self._authorize(raw.headers.get("authorization"))
            req = openai_api.parse(model, await openai_body.json_body(raw))
            if req.model != self.served_model_name:
                self.metrics.ended("http", "invalid")
                return self._model_not_found(req.model)
            prompts, choices = await self._openai_choices(req)
        except Exception as e:
            if req is not None and isinstance(e, InvalidRequestError):
                req.as_sent(e)
            self._refused("http", e)
            return http_error(e)
        builder = ResponseBuilder(
            chat,
            choices[0][0].request_id,
            self.served_model_name,
            self._token_text,
            self.frontend.tokenizer.token_bytes,
            [self._echo(req, prompt, ids) for prompt, ids in prompts],
            req.prompt_logprobs,
            _tool_names(req),
            choices_per_prompt=req.n,
        )
        outputs = self.metrics.request(
            "http",
            started,
            unaborted(
                merge_streams([self._outputs(request, text, "http") for request, text in choices])
            ),
        )
        if isinstance(req, openai_api.CompletionRequest) and req.prompt_only:
            outputs = without_completion(outputs)
        try:
            # The first output before answering: an engine's refusal is still a 4xx.
            first = await anext(outputs)
        except Exception as e:
            return http_error(e)
        if not req.stream:
            by_choice: list[list[RequestOutput]] = [[] for _ in choices]
            by_choice[first[0]].append(first[1])
            try:
                async for index, out in outputs:
                    by_choice[index].append(out)
            except Exception as e:
                return http_error(e)
            return builder.complete(by_choice)
        return StreamingResponse(
            sse_events(builder, first, outputs, req.include_usage()), media_type="text/event-stream"
        )

    async def _openai_choices(
        self, req: openai_api.OpenAIRequest
    ) -> tuple[list[tuple[PromptInput, list[int]]], list[tuple[EngineRequest, TextStream]]]:
        """A parsed request's prompts (with their tokens) and its choices' engine requests:
        each prompt's n choices in turn, choice k * n + j being prompt k's j-th."""
        prompts, choices = [], []
        for prompt in req.prompt_inputs():
            ids = await self._tokenize(prompt)
            params = req.sampling_params(self.frontend.room_after(ids))
            choices += await self._engine_requests(
                ids, openai_api.choice_params(params, req.n, req.stream), req.cache_salt
            )
            prompts.append((prompt, ids))
        return prompts, choices

    @http_app.post("/v1/responses")
    async def responses(self, raw: Request):
        """OpenAI's Responses API, as the chat completion it amounts to."""
        started = time.perf_counter()
        chat = None
        try:
            self._authorize(raw.headers.get("authorization"))
            req = openai_api.parse(ResponsesRequest, await openai_body.json_body(raw))
            if req.model != self.served_model_name:
                self.metrics.ended("http", "invalid")
                return self._model_not_found(req.model)
            chat = req.chat_request()
            _, choices = await self._openai_choices(chat)
        except Exception as e:
            if chat is not None and isinstance(e, InvalidRequestError):
                renamed(chat.as_sent(e))
            self._refused("http", e)
            return http_error(e)
        builder = ResponsesBuilder(req, chat, self.served_model_name)
        outputs = self.metrics.request(
            "http",
            started,
            unaborted(merge_streams([self._outputs(r, text, "http") for r, text in choices])),
        )
        try:
            _, first = await anext(outputs)  # before answering: a refusal is still a 4xx
        except Exception as e:
            return http_error(e)
        if not req.stream:
            collected = [first]
            try:
                collected += [out async for _, out in outputs]
            except Exception as e:
                return http_error(e)
            return builder.complete(collected)
        return StreamingResponse(builder.events(first, outputs), media_type="text/event-stream")

    def _echo(
        self, req: openai_api.OpenAIRequest, prompt: PromptInput, ids: list[int]
    ) -> Echo | None:
        """A completion's prompt to echo: its text as sent, or its token ids' text."""
        if not (isinstance(req, openai_api.CompletionRequest) and req.echo):
            return None
        text = prompt.text
        if text is None:
            text = self.frontend.tokenizer.decode(ids, skip_special_tokens=False)
        return Echo(text, ids, req.logprobs)

    def _token_text(self, token_id: int) -> str:
        return self.frontend.tokenizer.decode([token_id], skip_special_tokens=False)
