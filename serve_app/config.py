"""The service's configuration: what `build_app` takes, from the CLI or a Serve config file.

One pydantic model, validated at the edge (unknown keys rejected, every range checked),
so a Serve config's `args:` block, `baton serve`'s flags and the Helm chart's values all
meet the same rules. Engines receive plain `EngineConfig`s built from it.

It imports no engine code (torch) until a method needs it: the `baton` commands that
only talk to a running service (generate, status, stop) read it without loading torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from serve_app.status_board import DEFAULT_BOARD_NAME

if TYPE_CHECKING:
    from serve_app.routing.prefix_registry import PrefixRegistryConfig
    from workers.engine import EngineConfig

# How prefill's KV blocks reach decode (workers/kv/transport.py): "nixl" (Ray
# Direct Transport: decode pulls the KV heads straight from the prefill ranks holding
# them), "object_store" (Ray's object store: works anywhere) or "auto" (AppConfig
# .kv_transport: nixl where a pool runs on GPUs or decodes at TP > 1, else the object
# store, which on CPU moves a 512-token prompt's KV as fast and a burst of small ones
# for a fraction of nixl's cost per export; bench/RESULTS.md has the figures).
Transport = Literal["auto", "object_store", "nixl"]
TRANSPORTS: tuple[str, ...] = tuple(t for t in Transport.__args__ if t != "auto")

Mode = Literal["aggregated", "disaggregated"]

# How engine outputs stream from a pool replica to the router: "grpc" (Serve's
# inter-deployment gRPC, outputs passed by value: less CPU per message on the router than
# an actor call, see bench/RESULTS.md; each replica listens on a port of its own, so the
# router's node must reach the engine nodes on any port) or "actor_call" (Ray actor calls
# through Ray's object layer, Serve's default).
OutputChannel = Literal["grpc", "actor_call"]

# "auto": float32 on CPU, bfloat16 on CUDA. bfloat16 on a CPU with AMX or AVX512-BF16
# roughly doubles batched decode and prefill throughput (bench/engine.py --dtype).
DType = Literal["auto", "float32", "bfloat16", "float16"]

# How one sequence's decode matmuls from a GGUF model's weight blocks take their input
# (workers.engine.ACTIVATIONS, which tests/test_config.py holds equal; spelled out so that
# importing this module imports no engine code): "exact" (the default) float32
# throughout; "int16" rounds the input to 16 bits per block of 32 and multiplies in
# integers: a faster single stream, whose greedy output parted from the exact path's on a
# few prompts in a hundred measured (rare near-ties); "int8" faster still, and parts at
# near-ties often.
Activations = Literal["exact", "int16", "int8"]

# Ray's own resources with fields of their own (num_cpus, num_gpus); in `resources` Ray
# would refuse them only once a replica is placed.
_RAY_BUILTIN_RESOURCES = ("CPU", "GPU")


def _custom_resources(resources: dict[str, float]) -> dict[str, float]:
    for name, amount in resources.items():
        if name in _RAY_BUILTIN_RESOURCES:
            raise ValueError(f"{name!r} is Ray's own resource: set num_cpus or num_gpus instead")
        if amount < 0:
            raise ValueError(f"{name!r} must be >= 0, got {amount}")
    return resources


# Custom Ray resources, each a non-negative amount.
CustomResources = Annotated[dict[str, float], AfterValidator(_custom_resources)]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class AutoscalingConfig(_Frozen):
    """Serve's replica autoscaling for one pool, on ongoing requests per replica."""

    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(1, ge=1)
    target_ongoing_requests: float = Field(16.0, gt=0)

    @model_validator(mode="after")
    def _ordered(self) -> AutoscalingConfig:
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"min_replicas ({self.min_replicas}) must be <= max_replicas ({self.max_replicas})"
            )
        return self


class PoolConfig(_Frozen):
    """One pool of engine replicas (prefill, decode, or the aggregated pool)."""

    num_replicas: int = Field(1, ge=0)
    # Set: Serve scales the pool between min and max; num_replicas is the starting count.
    autoscaling: AutoscalingConfig | None = None
    tensor_parallel_size: int = Field(1, ge=1)
    # Resources of the replica process; TP ranks (tensor_parallel_size > 1) are Ray actors
    # of their own, each taking one CPU (or one GPU when num_gpus > 0), reserved with the
    # replica on one node.
    num_cpus: float = Field(1.0, ge=0)
    num_gpus: float = Field(0.0, ge=0)
    # Custom Ray resources, e.g. {"baton_prefill": 0.01} to pin replicas to prefill nodes.
    resources: CustomResources = Field(default_factory=dict)
    kv_cache_bytes: int = Field(512 * 2**20, ge=1)
    max_num_seqs: int = Field(64, ge=1)
    max_num_batched_tokens: int = Field(1024, ge=1)
    # torch threads per replica (or per TP rank). "auto": the machine's cores, shared step
    # by step among the engines busy on it (workers/engine/core_share.py): all of them
    # while this replica alone has work, an even split while others have too.
    num_threads: Annotated[int, Field(ge=1)] | Literal["auto"] = "auto"
    # Weights and KV cache; pools may differ (a handoff converts the KV on import).
    dtype: DType = "auto"
    # Requests Serve sends one replica at once; beyond it they queue at the router. (A
    # streaming pool's replicas take one more per router replica: its output subscription.)
    max_ongoing_requests: int = Field(128, ge=1)
    # Requests each router may queue for this pool while every replica is at
    # max_ongoing_requests; beyond it a request fails at once as the service being full
    # (gRPC RESOURCE_EXHAUSTED, HTTP 503 with Retry-After) rather than waiting without
    # bound. None: no limit. (For the prefill pool the callers are the decode replicas,
    # which prefill a refused prompt themselves.)
    max_queued_requests: int | None = Field(512, ge=1)
    # How long a replica that is scaled down or replaced may finish its streams before
    # Serve stops it: long enough for the longest generation you serve.
    graceful_shutdown_timeout_s: float = Field(120.0, gt=0)
    # Handoff KV a decode replica may hold pulled but not yet imported (None: a quarter of
    # its KV cache); beyond it, further pulls wait for imports.
    max_pulled_kv_bytes: int | None = Field(None, ge=1)
    # N-gram speculative decoding: up to this many drafted tokens per sequence and step,
    # checked in one step while at most 4 sequences run (workers/engine/speculative.py;
    # greedy output unchanged). 0 turns it off. A prefill replica ignores it.
    speculative_tokens: int = Field(0, ge=0, le=16)
    # How one sequence's decode matmuls from GGUF blocks take their input
    # (EngineConfig.activations; Activations above): "exact" (the default: float32
    # throughout), "int16" or "int8" (faster; greedy output may part from exact's at a
    # near-tie).
    activations: Activations = "exact"

    @model_validator(mode="after")
    def _budget_per_step(self) -> PoolConfig:
        from workers.engine import SchedulerConfig

        SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens)  # the engine's rule
        return self

    @model_validator(mode="after")
    def _replica_bundle(self) -> PoolConfig:
        # A TP replica's own bundle in the placement group it shares with its ranks: Ray
        # refuses a bundle that asks for nothing.
        if self.tensor_parallel_size > 1 and not (
            self.num_cpus > 0 or any(v > 0 for v in self.resources.values())
        ):
            raise ValueError(
                "num_cpus must be > 0 when tensor_parallel_size > 1 (or give the replica a "
                "custom resource): Serve reserves the replica and its ranks together, and "
                "the replica's share may not be empty"
            )
        return self


class RouterConfig(_Frozen):
    num_replicas: int = Field(1, ge=1)
    # Tokenizing and relaying is light next to an engine; half a CPU lets a small box fit
    # a router beside one prefill and one decode replica.
    num_cpus: float = Field(0.5, ge=0)
    resources: CustomResources = Field(default_factory=dict)
    max_ongoing_requests: int = Field(256, ge=1)
    # Times one request may be migrated to another replica when the one serving it fails
    # (router.py); 0 fails it at once, with a retryable error.
    max_migrations: int = Field(3, ge=0)


class AppConfig(_Frozen):
    # A bundled model's name (smollm2-135m-instruct, gemma3-270m; "default" is the first),
    # a GGUF file or a local Hugging Face model folder (Llama family or Gemma 3).
    model: str = Field("default", min_length=1)
    # The name clients use (OpenAI "model", gRPC model info); defaults to the folder's name.
    served_model_name: str | None = None
    mode: Mode = "disaggregated"
    transport: Transport = "auto"
    block_size: int = Field(16, ge=1, le=1024)
    max_model_len: int | None = Field(None, ge=1)
    enable_prefix_caching: bool = True
    handoff_timeout_s: float = Field(30.0, gt=0)
    # Selective disaggregation: a decode replica prefills a prompt itself, with no
    # handoff, when the prompt's uncached part is at most `local_prefill_tokens`, or when
    # it already waits on `max_pending_prefills` prefills from the prefill pool (a burst
    # the pool would queue, while this replica's own compute can take it). 0 / None turn
    # each rule off; both off, every prompt goes through the prefill pool.
    local_prefill_tokens: int = Field(0, ge=0)
    max_pending_prefills: int | None = Field(None, ge=1)
    # New tokens a stream gathers before the next message leaves the engine replica (the
    # first token always goes at once): each message costs two Ray Serve hops of CPU, so
    # a larger interval buys throughput at high concurrency for burstier streams. 1 sends
    # every token as it is made.
    stream_interval: int = Field(1, ge=1, le=64)
    output_channel: OutputChannel = "grpc"
    # Pools: "aggregated" mode uses `aggregated`, "disaggregated" uses prefill and decode.
    # The defaults are built unvalidated (equal to `PoolConfig()`, whose values the engine
    # accepts: tests/test_config.py), so importing this module imports no engine code.
    aggregated: PoolConfig = PoolConfig.model_construct()
    prefill: PoolConfig = PoolConfig.model_construct()
    decode: PoolConfig = PoolConfig.model_construct()
    router: RouterConfig = RouterConfig()
    # Name of the detached prefix-registry actor the router and pool replicas share (Ray
    # namespace "baton"). None: the application's own, named after its Serve application
    # (`baton-prefix-registry-<app name>`, see `prefix_registry`), so applications on one
    # cluster never route by each other's replicas; `baton stop` removes it with the
    # application. A name several applications set shares one registry on purpose (and
    # outlives them: nothing removes it).
    registry_name: str | None = Field(None, min_length=1)
    # Name of the detached actor replicas post their stats to (for `baton status`).
    status_board_name: str = Field(DEFAULT_BOARD_NAME, min_length=1)
    # A file on the router's machine holding the service's API keys, one per line, read
    # again when it changes (see api_keys.py). None: no key is asked for.
    api_key_file: str | None = None

    @field_validator("api_key_file")
    @classmethod
    def _absolute_key_file(cls, path: str | None) -> str | None:
        if path is not None and not Path(path).is_absolute():
            raise ValueError(
                f"api_key_file must be an absolute path on the router's machine (the router "
                f"does not run in this directory), got {path!r}"
            )
        return path

    @model_validator(mode="after")
    def _distinct_actor_names(self) -> AppConfig:
        if self.registry_name is not None and self.registry_name == self.status_board_name:
            raise ValueError(
                f"registry_name and status_board_name must name different actors (both "
                f"live in Ray namespace 'baton'), got {self.registry_name!r} for both"
            )
        return self

    def prefix_registry(self, app_name: str) -> PrefixRegistryConfig:
        """The prefix registry of this config deployed as Serve application `app_name`:
        `registry_name`, else the application's own."""
        from serve_app.routing.prefix_registry import PrefixRegistryConfig
        from serve_app.routing.registry_names import app_registry_name

        return PrefixRegistryConfig(name=self.registry_name or app_registry_name(app_name))

    def model_dir(self) -> Path:
        """The model's local folder: a bundled model is fetched and a GGUF file converted
        on first use, a folder used as it is."""
        from workers.model import resolve_model

        return resolve_model(self.model)

    def served_name(self, model_dir: Path) -> str:
        """The model's name to clients and in metrics (`model_name`): `served_model_name`,
        else the folder's (a bundled model's: its name)."""
        return self.served_model_name or model_dir.name

    def pools(self) -> dict[str, PoolConfig]:
        """The pools this mode runs, by role."""
        if self.mode == "aggregated":
            return {"aggregated": self.aggregated}
        return {"prefill": self.prefill, "decode": self.decode}

    def without_scale(self) -> AppConfig:
        """This config with every replica count and autoscaling at their defaults: what
        replicas are built from, so scaling a pool or the router changes no replica's
        arguments (Serve then adds or drains replicas instead of restarting them all)."""
        neutral = {"num_replicas": 1, "autoscaling": None}
        update = {
            name: getattr(self, name).model_copy(update=neutral)
            for name in ("aggregated", "prefill", "decode")
        }
        update["router"] = self.router.model_copy(update={"num_replicas": 1})
        return self.model_copy(update=update)

    def context_length(self, model_dir: Path) -> int:
        """Tokens one request may span: the engines' `EngineConfig.context_length`, the
        least of every pool's (each holds a request's blocks whole). ValueError, naming
        the pool, if `max_model_len` is more than a pool's KV cache holds."""
        from workers.model import ModelConfig

        model = ModelConfig.from_pretrained(model_dir)
        lengths = []
        for role, pool in self.pools().items():
            try:
                engine = self.engine_config(pool, str(model_dir), model_id=None)
                lengths.append(engine.context_length(model))
            except ValueError as e:
                raise ValueError(f"{role} pool: {e}") from None
        return min(lengths)

    def kv_transport(self) -> str:
        """`transport`, with "auto" resolved: nixl where it avoids a copy through host
        memory (GPU pools) or through the decode replica's process (each decode rank pulls
        its own KV heads), else the object store."""
        if self.transport != "auto":
            return self.transport
        pools = (self.prefill, self.decode)
        direct = any(p.num_gpus > 0 for p in pools) or self.decode.tensor_parallel_size > 1
        return "nixl" if direct else "object_store"

    def engine_config(self, pool: PoolConfig, model_dir: str, model_id: str | None) -> EngineConfig:
        from workers.engine import EngineConfig, SpeculativeConfig

        return EngineConfig(
            model=model_dir,
            block_size=self.block_size,
            kv_cache_bytes=pool.kv_cache_bytes,
            max_num_seqs=pool.max_num_seqs,
            max_num_batched_tokens=pool.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            device="cuda" if pool.num_gpus > 0 else "cpu",
            num_threads=pool.num_threads,
            dtype=pool.dtype,
            tensor_parallel_size=pool.tensor_parallel_size,
            # Serve reserves a TP replica's ranks with it (app.py's placement_group_bundles).
            tp_placement="current" if pool.tensor_parallel_size > 1 else "own",
            enable_prefix_caching=self.enable_prefix_caching,
            model_id=model_id,
            handoff_timeout_s=self.handoff_timeout_s,
            kv_transport=self.kv_transport(),
            detokenize=False,  # the router makes the text (serve_app/streaming/text_stream.py)
            speculative=(
                SpeculativeConfig(num_tokens=pool.speculative_tokens)
                if pool.speculative_tokens
                else None
            ),
            activations=pool.activations,
        )
