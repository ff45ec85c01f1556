"""build_app: validation against the model, the deployment graph, pinned versions."""

from __future__ import annotations

import pytest
from helm_chart_helpers import app_config_of
from ray.serve._private.deploy_utils import get_app_code_version
from ray.serve.schema import ServeDeploySchema
from tiny_model import make_tiny_model

from serve_app.app import build_app, build_versioned_app, validate
from serve_app.code_version import source_digest
from serve_app.config import TRANSPORTS, AppConfig, AutoscalingConfig, PoolConfig, RouterConfig
from serve_app.serve_config import (
    DEPLOYMENT_NAMES,
    GRPC_PORT,
    IMPORT_PATH,
    ROUTER_NAME,
    serve_config,
)
from workers.kv.transport import TRANSPORTS as ENGINE_TRANSPORTS


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # 6 query heads and 3 KV heads: TP 1 and 3 divide them, 2 does not.
    return make_tiny_model(
        tmp_path_factory.mktemp("tiny"),
        num_heads=6,
        num_kv_heads=3,
        hidden_size=48,
        intermediate_size=96,  # TP 3 splits it, as it does the heads
    )


def test_a_tp_degree_that_does_not_divide_the_heads_is_refused_naming_the_pool(model_dir):
    validate(AppConfig(model=str(model_dir), prefill=PoolConfig(tensor_parallel_size=3)))
    bad = AppConfig(model=str(model_dir), decode=PoolConfig(tensor_parallel_size=2))
    with pytest.raises(
        ValueError, match=r"decode.tensor_parallel_size=2 .* valid degrees: \[1, 3, 6\]"
    ):
        build_app(bad)


def test_a_pool_without_replicas_or_autoscaling_is_refused(model_dir):
    with pytest.raises(ValueError, match="prefill.num_replicas must be >= 1"):
        validate(AppConfig(model=str(model_dir), prefill=PoolConfig(num_replicas=0)))
    scaled = PoolConfig(
        num_replicas=0, autoscaling=AutoscalingConfig(min_replicas=0, max_replicas=2)
    )
    validate(AppConfig(model=str(model_dir), prefill=scaled))


def test_the_context_length_is_the_least_any_pools_kv_cache_holds(model_dir):
    # The tiny model: 2 layers, 3 KV heads of 8 dims: 16-token blocks of 6144 bytes (fp32).
    small = PoolConfig(kv_cache_bytes=10 * 6144)
    config = AppConfig(model=str(model_dir), prefill=small)
    assert config.context_length(model_dir) == 160
    assert (
        AppConfig(model=str(model_dir), max_model_len=100, prefill=small).context_length(model_dir)
        == 100
    )
    too_long = AppConfig(model=str(model_dir), max_model_len=200, prefill=small)
    with pytest.raises(ValueError, match="prefill pool: max_model_len=200 .* 160 tokens"):
        validate(too_long)
    none = AppConfig(model=str(model_dir), decode=PoolConfig(kv_cache_bytes=6000))
    with pytest.raises(ValueError, match="decode pool: kv_cache_bytes=6000 holds no KV block"):
        validate(none)


def test_a_missing_model_folder_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        build_app({"model": str(tmp_path / "nowhere")})


def test_unknown_or_out_of_range_fields_are_refused():
    with pytest.raises(ValueError, match="transport"):
        AppConfig.model_validate({"transport": "carrier-pigeon"})
    with pytest.raises(ValueError, match="num_replicas"):
        AppConfig.model_validate({"prefill": {"num_replicas": -1}})
    with pytest.raises(ValueError, match="prefil"):
        AppConfig.model_validate({"prefil": {}})
    with pytest.raises(ValueError, match="min_replicas"):
        AutoscalingConfig(min_replicas=3, max_replicas=2)
    with pytest.raises(ValueError, match="local_prefill_tokens"):
        AppConfig.model_validate({"local_prefill_tokens": -1})
    with pytest.raises(ValueError, match="max_pending_prefills"):
        AppConfig.model_validate({"max_pending_prefills": 0})
    # Custom resources: non-negative, and never Ray's own (num_cpus / num_gpus say those).
    with pytest.raises(ValueError, match=r"prefill.resources\n.*'baton_x' must be >= 0"):
        AppConfig.model_validate({"prefill": {"resources": {"baton_x": -1}}})
    with pytest.raises(ValueError, match="router.resources\n.*'GPU' is Ray's own resource"):
        AppConfig.model_validate({"router": {"resources": {"GPU": 1}}})
    resources = {"baton_decode": 0.01, "memory": 2**30}  # Ray's memory is a resource here
    assert AppConfig(decode=PoolConfig(resources=resources)).decode.resources == resources
    with pytest.raises(ValueError, match=r"decode\n.*max_num_batched_tokens \(32\) must be >="):
        AppConfig.model_validate({"decode": {"max_num_batched_tokens": 32}})


def test_the_config_offers_exactly_the_engines_transports(model_dir):
    assert TRANSPORTS == ENGINE_TRANSPORTS
    for transport in TRANSPORTS:
        config = AppConfig(model=str(model_dir), transport=transport)
        validate(config)
        engine = config.engine_config(config.decode, str(model_dir), "m")
        assert engine.kv_transport == transport


def test_auto_transport_is_nixl_with_gpus_or_a_tp_decode_and_the_object_store_otherwise(
    model_dir,
):
    cases = [
        ({}, "object_store"),
        ({"decode": {"tensor_parallel_size": 3}}, "nixl"),
        ({"prefill": {"tensor_parallel_size": 3}}, "object_store"),
        ({"prefill": {"num_gpus": 1}}, "nixl"),
        ({"decode": {"num_gpus": 1}}, "nixl"),
        ({"transport": "nixl"}, "nixl"),
        ({"decode": {"tensor_parallel_size": 3}, "transport": "object_store"}, "object_store"),
    ]
    for fields, expected in cases:
        config = AppConfig.model_validate({"model": str(model_dir), **fields})
        assert config.kv_transport() == expected, fields
        for pool in (config.prefill, config.decode):
            assert config.engine_config(pool, str(model_dir), "m").kv_transport == expected
    assert AppConfig().transport == "auto"


def test_each_pool_chooses_its_dtype(model_dir):
    config = AppConfig.model_validate({"model": str(model_dir), "prefill": {"dtype": "bfloat16"}})
    prefill = config.engine_config(config.prefill, str(model_dir), "m")
    decode = config.engine_config(config.decode, str(model_dir), "m")
    assert (prefill.dtype, decode.dtype) == ("bfloat16", "auto")
    # auto is float32 on a CPU pool (num_gpus 0), bfloat16 on a GPU one.
    assert (prefill.resolved_dtype_name(), decode.resolved_dtype_name()) == ("bfloat16", "float32")
    gpu_pool = config.decode.model_copy(update={"num_gpus": 1})
    assert config.engine_config(gpu_pool, str(model_dir), "m").resolved_dtype_name() == "bfloat16"
    with pytest.raises(ValueError, match="dtype"):
        AppConfig.model_validate({"decode": {"dtype": "fp8"}})


def test_a_pool_turns_speculative_decoding_on_by_its_draft_count(model_dir):
    config = AppConfig.model_validate(
        {"model": str(model_dir), "decode": {"speculative_tokens": 6}}
    )
    decode = config.engine_config(config.decode, str(model_dir), "m")
    assert decode.speculative is not None and decode.speculative.num_tokens == 6
    assert config.engine_config(config.prefill, str(model_dir), "m").speculative is None
    with pytest.raises(ValueError, match="speculative_tokens"):
        AppConfig.model_validate({"decode": {"speculative_tokens": 17}})


def test_the_graph_has_a_router_and_one_deployment_per_pool(model_dir):
    for mode, pools in [("aggregated", ["aggregated"]), ("disaggregated", ["prefill", "decode"])]:
        app = build_app({"model": str(model_dir), "mode": mode})
        names = {d.name for d in _deployments(app)}
        assert names == {"Router", *(DEPLOYMENT_NAMES[p] for p in pools)}


def test_each_pool_sets_how_long_its_replicas_may_drain(model_dir):
    pools = {"prefill": {"graceful_shutdown_timeout_s": 45}, "decode": {}}
    app = build_app({"model": str(model_dir), **pools})
    drain = {d.name: d._deployment_config.graceful_shutdown_timeout_s for d in _deployments(app)}
    assert drain["PrefillServer"] == 45 and drain["DecodeServer"] == 120
    # The router relays the streams of either, so it may take the longest of them.
    assert drain["Router"] == 120
    longer = build_app({"model": str(model_dir), "decode": {"graceful_shutdown_timeout_s": 300}})
    assert {d.name: d._deployment_config.graceful_shutdown_timeout_s for d in _deployments(longer)}[
        "Router"
    ] == 300


def test_each_pool_replica_admits_its_max_ongoing_requests_whatever_the_router_count(model_dir):
    """Output subscriptions travel on sockets, not Serve calls, so they take no slot."""
    pools = {"prefill": {"max_ongoing_requests": 4}, "decode": {"max_ongoing_requests": 6}}
    app = build_app({"model": str(model_dir), "router": {"num_replicas": 2}, **pools})
    slots = {d.name: d._deployment_config.max_ongoing_requests for d in _deployments(app)}
    assert slots["PrefillServer"] == 4 and slots["DecodeServer"] == 6
    agg = build_app({"model": str(model_dir), "mode": "aggregated"})
    slots = {d.name: d._deployment_config.max_ongoing_requests for d in _deployments(agg)}
    assert slots["EngineServer"] == 128
    config = AppConfig(
        router=RouterConfig(num_replicas=3), decode=PoolConfig(max_ongoing_requests=4)
    )
    (served,) = serve_config(config)["applications"]
    # A config-file deploy's overrides carry replica counts only; the limits are args.
    assert all("max_ongoing_requests" not in d for d in served["deployments"])
    assert AppConfig.model_validate(served["args"]).decode.max_ongoing_requests == 4


def test_each_pool_bounds_the_requests_a_router_queues_for_it(model_dir):
    pools = {"prefill": {"max_queued_requests": None}, "decode": {"max_queued_requests": 3}}
    app = build_app({"model": str(model_dir), **pools})
    queued = {d.name: d._deployment_config.max_queued_requests for d in _deployments(app)}
    # None is Serve's -1, no limit; the router's own deployment keeps Serve's default.
    assert queued == {"Router": -1, "PrefillServer": -1, "DecodeServer": 3}
    agg = build_app({"model": str(model_dir), "mode": "aggregated"})
    queued = {d.name: d._deployment_config.max_queued_requests for d in _deployments(agg)}
    assert queued["EngineServer"] == 512


def test_a_tp_replica_is_reserved_with_its_ranks_as_one_placement_group(model_dir):
    """Placed apart, a TP replica could land where its ranks do not fit (a node without
    GPUs); and Ray's autoscaler would see the replica's share alone."""
    pools = {
        "prefill": {"tensor_parallel_size": 3, "num_gpus": 1, "resources": {"baton_prefill": 0.1}},
        "decode": {"tensor_parallel_size": 3, "num_cpus": 2},
    }
    app = build_app({"model": str(model_dir), **pools})
    by_name = {d.name: d for d in _deployments(app)}
    prefill, decode = by_name["PrefillServer"], by_name["DecodeServer"]
    assert prefill._replica_config.placement_group_bundles == [
        {"CPU": 1.0, "baton_prefill": 0.1},
        *[{"CPU": 1.0, "GPU": 1.0}] * 3,
    ]
    assert decode._replica_config.placement_group_bundles == [{"CPU": 2.0}, *[{"CPU": 1.0}] * 3]
    for d in (prefill, decode):
        assert d._replica_config.placement_group_strategy == "STRICT_PACK"
        assert d.ray_actor_options["num_gpus"] == 0  # the ranks take the GPUs
    # The engines take bundles 1..3 of it; a TP 1 replica is placed on its own.
    config = AppConfig.model_validate({"model": str(model_dir), **pools})
    assert config.engine_config(config.decode, str(model_dir), "m").tp_placement == "current"
    single = build_app({"model": str(model_dir), "mode": "aggregated"})
    (engine,) = [d for d in _deployments(single) if d.name == "EngineServer"]
    assert engine._replica_config.placement_group_bundles is None
    assert config.engine_config(config.aggregated, str(model_dir), "m").tp_placement == "own"


def test_a_tp_replica_must_ask_for_something_of_its_own():
    with pytest.raises(ValueError, match="num_cpus must be > 0 when tensor_parallel_size > 1"):
        PoolConfig(tensor_parallel_size=2, num_cpus=0)
    PoolConfig(tensor_parallel_size=2, num_cpus=0, resources={"baton_decode": 0.01})
    PoolConfig(num_cpus=0)  # a TP 1 replica needs no placement group


def _deployments(app) -> list:
    """Every deployment of an application graph (bound deployments are init args)."""
    seen, stack = [], [app]
    while stack:
        deployment = stack.pop()._bound_deployment
        seen.append(deployment)
        stack.extend(a for a in deployment.init_args if hasattr(a, "_bound_deployment"))
    return seen


def test_rescaling_leaves_every_deployment_version_unchanged(model_dir):
    """Replicas are built from the config without replica counts, and versions are pinned
    to that: a redeploy that only rescales must not restart any replica."""
    base = AppConfig(model=str(model_dir))
    scaled = base.model_copy(update={"prefill": PoolConfig(num_replicas=4)})
    assert base.without_scale() == scaled.without_scale()

    def versions(config: AppConfig) -> dict[str, str]:
        return {d.name: d.version for d in _deployments(build_app(config))}

    assert versions(base) == versions(scaled) and all(versions(base).values())
    assert versions(base.model_copy(update={"block_size": 32})) != versions(base)
    # `baton scale` builds with the code version `baton serve` deployed, whatever the
    # code is now; a new version is a new version of every deployment.
    assert versions(base) == {
        d.name: d.version for d in _deployments(build_versioned_app(base, source_digest()))
    }
    edited = {d.name: d.version for d in _deployments(build_versioned_app(base, "edited"))}
    assert edited.keys() == versions(base).keys()
    assert not set(edited.values()) & set(versions(base).values())


def test_serve_can_call_build_app_as_a_config_files_builder(model_dir):
    # What Serve runs for `import_path: serve_app.app:build_app` with `args`: it takes
    # a builder of exactly one parameter.
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary

    app = call_user_app_builder_with_args_if_necessary(build_app, {"model": str(model_dir)})
    names = {d.name for d in _deployments(app)}
    assert names == {ROUTER_NAME, DEPLOYMENT_NAMES["prefill"], DEPLOYMENT_NAMES["decode"]}


def test_the_serve_config_is_one_valid_application_of_build_app():
    autoscaling = AutoscalingConfig(min_replicas=1, max_replicas=4)
    config = AppConfig(
        prefill=PoolConfig(num_replicas=2, tensor_parallel_size=3),
        decode=PoolConfig(num_replicas=2, autoscaling=autoscaling),
        router=RouterConfig(num_replicas=2),
    )
    raw = serve_config(config)
    schema = ServeDeploySchema.model_validate(raw)
    (app,) = schema.applications
    assert app.import_path == IMPORT_PATH and schema.grpc_options.port == GRPC_PORT
    assert app_config_of(raw["applications"][0]) == config


def test_rescaling_through_a_serve_config_keeps_serves_code_version():
    """Serve versions every deployment of a config-file application by its code version
    (import path, args, ...): rescaling must leave it alone, or Serve restarts them all.
    (Turning a pool's autoscaling on or off does change it: Serve hashes the list of
    autoscaling policies in use.)"""

    def code_version(config: AppConfig) -> str:
        (app,) = ServeDeploySchema.model_validate(serve_config(config)).applications
        return get_app_code_version(app)

    def autoscaled(lo: int, hi: int, start: int = 1) -> PoolConfig:
        scaling = AutoscalingConfig(min_replicas=lo, max_replicas=hi)
        return PoolConfig(num_replicas=start, autoscaling=scaling)

    base = AppConfig(decode=autoscaled(1, 4))
    for rescaled in (
        base.model_copy(update={"prefill": PoolConfig(num_replicas=4)}),
        base.model_copy(update={"decode": autoscaled(2, 8, start=3)}),
        base.model_copy(update={"router": RouterConfig(num_replicas=3)}),
    ):
        assert code_version(rescaled) == code_version(base)
    assert code_version(base.model_copy(update={"block_size": 32})) != code_version(base)
