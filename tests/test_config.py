"""serve_app/config.py's rules that need neither a model nor Serve (the model-bound ones
are in test_app.py): which prefix registry an application's router and replicas use."""

from __future__ import annotations

import typing

import pytest
from pydantic import ValidationError

from serve_app.config import Activations, AppConfig, PoolConfig
from serve_app.ops.service_ops import Deployed
from serve_app.routing.registry_names import REGISTRY_NAMESPACE, app_registry_name
from serve_app.serve_config import serve_config


def test_applications_on_one_cluster_get_a_registry_each_by_default():
    config = AppConfig()
    assert config.registry_name is None
    names = {app: config.prefix_registry(app).name for app in ("baton", "other", "second-model")}
    assert len(set(names.values())) == 3, names
    assert names["baton"] == app_registry_name("baton")
    assert config.prefix_registry("baton").namespace == REGISTRY_NAMESPACE
    # Nothing in the deployed config names one: each replica finds its application's.
    (app,) = serve_config(config)["applications"]
    assert "registry_name" not in app["args"]
    record = Deployed(config, "/", "v1").to_record()
    assert Deployed.from_record("baton", record).config.registry_name is None


def test_a_registry_name_set_on_several_applications_shares_one_on_purpose():
    config = AppConfig(registry_name="shared-prefixes")
    assert {config.prefix_registry(app).name for app in ("baton", "other")} == {"shared-prefixes"}
    # As an earlier Baton's `baton serve` kept its default: still that shared registry.
    legacy = AppConfig.model_validate({"registry_name": "baton-prefix-registry"})
    assert legacy.prefix_registry("other").name == "baton-prefix-registry"


def test_a_registry_name_is_non_empty_and_not_the_status_boards():
    with pytest.raises(ValidationError) as err:
        AppConfig(registry_name="")
    assert "registry_name" in str(err.value) and "at least 1 character" in str(err.value)
    with pytest.raises(ValidationError, match="registry_name and status_board_name must name"):
        AppConfig(registry_name="baton-status")
    with pytest.raises(ValidationError, match="must name different actors"):
        AppConfig(registry_name="mine", status_board_name="mine")


def test_the_pools_defaults_are_validated_pools_the_engine_accepts():
    # Built unvalidated, so that importing config.py imports no engine code; they are
    # what a validated PoolConfig() is, which the engine's own rules accept.
    from workers.engine import SchedulerConfig

    for name in ("aggregated", "prefill", "decode"):
        default = AppConfig.model_fields[name].default
        assert default == PoolConfig() and getattr(AppConfig(), name) == PoolConfig()
        SchedulerConfig(default.max_num_seqs, default.max_num_batched_tokens)
    assert AppConfig(prefill=PoolConfig()).model_dump(exclude_defaults=True) == {}
    with pytest.raises(ValidationError, match="max_num_batched_tokens"):
        AppConfig.model_validate({"decode": {"max_num_seqs": 8, "max_num_batched_tokens": 4}})


def test_the_activations_are_the_engines_and_others_are_refused_naming_the_field():
    from workers.engine import ACTIVATIONS, EngineConfig

    assert typing.get_args(Activations) == ACTIVATIONS
    assert PoolConfig().activations == EngineConfig(model="m").activations == "exact"
    with pytest.raises(ValidationError) as err:
        PoolConfig(activations="int4")
    ((error,),) = [err.value.errors()]
    assert error["loc"] == ("activations",)
    assert "'exact', 'int16' or 'int8'" in error["msg"]
    with pytest.raises(ValidationError, match=r"decode\.activations"):
        AppConfig.model_validate({"decode": {"activations": True}})
