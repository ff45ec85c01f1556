"""The prefix registry: the index on its own, then the named actor on a real local Ray."""

from __future__ import annotations

import asyncio
import time

import pytest

from serve_app.routing import prefix_registry
from serve_app.routing.prefix_index import PrefixIndex
from serve_app.routing.prefix_registry import (
    HEARTBEAT_S,
    PrefixRegistryConfig,
    get_or_create_registry,
)
from serve_app.routing.registry_lookup import RegistryLookup
from serve_app.routing.registry_names import app_registry_name, remove_registry
from workers.engine.block_hash import BlockHash, hash_full_blocks, root_hash

ROOT = root_hash("m", None)


def _chain(n: int, seed: int = 0) -> list[BlockHash]:
    """Hashes of an n-block prompt; chains with different seeds share nothing."""
    return hash_full_blocks([seed * 1000 + i for i in range(4 * n)], 4, ROOT)


PROMPT = _chain(6)


# -- the index ---------------------------------------------------------------------


def test_longest_prefix_per_replica():
    index = PrefixIndex(100)
    index.publish("r1", PROMPT[:4], [])
    index.publish("r2", PROMPT[:2], [])
    index.publish("r3", _chain(3, seed=1), [])
    assert index.longest_prefixes(PROMPT) == {"r1": 4, "r2": 2, "r3": 0}
    assert index.longest_prefixes(PROMPT[:3]) == {"r1": 3, "r2": 2, "r3": 0}
    assert index.longest_prefixes([]) == {"r1": 0, "r2": 0, "r3": 0}


def test_only_a_leading_run_counts():
    index = PrefixIndex(100)
    # r1 holds blocks 0, 1 and 3, but not 2: its usable prefix ends at 2.
    index.publish("r1", [PROMPT[0], PROMPT[1], PROMPT[3]], [])
    # r2 holds later blocks only: nothing usable.
    index.publish("r2", PROMPT[1:], [])
    assert index.longest_prefixes(PROMPT) == {"r1": 2, "r2": 0}


def test_evictions_shorten_prefixes():
    index = PrefixIndex(100)
    index.publish("r1", PROMPT, [])
    index.publish("r1", [], [PROMPT[3]])
    assert index.longest_prefixes(PROMPT) == {"r1": 3}
    index.publish("r1", [], [PROMPT[0]])
    assert index.longest_prefixes(PROMPT) == {"r1": 0}
    assert index.stats()["entries"] == 4
    # Evicting what is not held changes nothing.
    index.publish("r1", [], [PROMPT[0], _chain(1, seed=9)[0]])
    assert index.stats()["entries"] == 4


def test_a_batch_applies_evictions_before_stores():
    index = PrefixIndex(100)
    index.publish("r1", PROMPT[:2], [])
    index.publish("r1", [PROMPT[1], PROMPT[2]], [PROMPT[1]])
    assert index.longest_prefixes(PROMPT) == {"r1": 3}


def test_the_size_bound_drops_the_least_recently_used_entries():
    index = PrefixIndex(5)
    index.publish("r1", PROMPT[:3], [])
    index.publish("r2", PROMPT[:2], [])
    assert index.stats()["entries"] == 5
    # A query refreshes the entries it matched: block 0 of r1 and of r2.
    index.longest_prefixes(PROMPT[:1])
    index.publish("r3", PROMPT[:2], [])
    # The two oldest entries went: r1's blocks 1 and 2.
    stats = index.stats()
    assert stats["entries"] == 5
    assert stats["dropped_entries"] == 2
    assert index.longest_prefixes(PROMPT) == {"r1": 1, "r2": 2, "r3": 2}


def test_the_bound_drops_a_chain_from_its_tail_so_its_prefix_still_matches():
    index = PrefixIndex(10)
    first, second = _chain(8, seed=1), _chain(4, seed=2)
    index.publish("r1", first, [])
    index.publish("r1", second, [])
    # Two entries had to go: the first chain's last two blocks, not its root.
    assert index.longest_prefixes(first) == {"r1": 6}
    assert index.longest_prefixes(second) == {"r1": 4}
    # A query refreshes the matched run deepest first too: the next drop takes the
    # unqueried chain's tail.
    index.longest_prefixes(first)
    index.publish("r1", _chain(1, seed=3), [])
    assert index.longest_prefixes(first) == {"r1": 6}
    assert index.longest_prefixes(second) == {"r1": 3}


def test_a_replica_not_heard_from_for_its_ttl_is_forgotten():
    now = [0.0]
    index = PrefixIndex(100, replica_ttl_s=60.0, clock=lambda: now[0])
    index.publish("crashed", PROMPT, [])
    index.publish("live", PROMPT[:2], [])
    now[0] = 50.0
    index.publish("live", [], [])  # its heartbeat
    assert index.longest_prefixes(PROMPT) == {"crashed": 6, "live": 2}
    now[0] = 61.0
    assert index.longest_prefixes(PROMPT) == {"live": 2}
    stats = index.stats()
    assert stats["expired_replicas"] == 1 and stats["entries"] == 2 and stats["replicas"] == 1


def test_a_replica_gets_a_new_session_whenever_the_index_forgot_it():
    now = [0.0]
    index = PrefixIndex(100, replica_ttl_s=60.0, clock=lambda: now[0])
    first = index.publish("r", PROMPT[:2], [])
    assert index.publish("r", [], []) == first  # known: the same session
    now[0] = 61.0
    assert index.longest_prefixes(PROMPT) == {}  # expired, with all it held
    after_expiry = index.publish("r", [], [])  # its next heartbeat
    assert after_expiry != first and index.longest_prefixes(PROMPT) == {"r": 0}
    index.remove_replica("r")
    after_removal = index.publish("r", [], [])
    # A restarted registry is a new index: its sessions are none of the old ones.
    restarted = PrefixIndex(100).publish("r", [], [])
    assert len({first, after_expiry, after_removal, restarted}) == 4


def test_a_ttl_within_the_heartbeat_is_refused():
    with pytest.raises(ValueError, match="replica_ttl_s must exceed"):
        PrefixRegistryConfig(name="r", replica_ttl_s=HEARTBEAT_S)


def test_restoring_an_entry_refreshes_it():
    index = PrefixIndex(2)
    a, b, c = _chain(3)
    index.publish("r1", [a, b], [])
    index.publish("r1", [a], [])  # a is now the most recent
    index.publish("r1", [c], [])
    assert index.longest_prefixes([a]) == {"r1": 1}
    assert index.longest_prefixes([b]) == {"r1": 0}


def test_memory_stays_bounded_under_a_flood():
    index = PrefixIndex(50)
    for seed in range(40):
        index.publish(f"r{seed % 4}", _chain(8, seed=seed), [])
    stats = index.stats()
    assert stats["entries"] == 50
    assert stats["hashes"] <= 50
    assert stats["dropped_entries"] == 40 * 8 - 50


def test_removing_a_replica_drops_all_its_entries():
    index = PrefixIndex(100)
    index.publish("r1", PROMPT, [])
    index.publish("r2", PROMPT[:3], [])
    assert index.remove_replica("r1") == 6
    assert index.longest_prefixes(PROMPT) == {"r2": 3}
    assert index.stats() == {
        "entries": 3,
        "max_entries": 100,
        "hashes": 3,
        "replicas": 1,
        "dropped_entries": 0,
        "expired_replicas": 0,
        "queries": 1,
    }
    assert index.remove_replica("r1") == 0
    index.remove_replica("r2")
    assert index.stats()["hashes"] == 0
    assert index.longest_prefixes(PROMPT) == {}


def test_bad_input_is_refused_with_a_hint():
    with pytest.raises(ValueError, match="max_entries"):
        PrefixIndex(0)
    with pytest.raises(ValueError, match="max_entries"):
        PrefixRegistryConfig(name="r", max_entries=0)
    index = PrefixIndex(10)
    with pytest.raises(ValueError, match="BlockHash"):
        index.publish("r1", [PROMPT[0].digest], [])
    with pytest.raises(ValueError, match="replica_id"):
        index.publish("", PROMPT, [])
    with pytest.raises(ValueError, match="BlockHash"):
        index.longest_prefixes([PROMPT[0].hex()])
    assert index.stats()["entries"] == 0
    with pytest.raises(ValueError, match="name and namespace must be non-empty"):
        PrefixRegistryConfig(name="")


def test_each_application_has_a_registry_name_of_its_own():
    names = {app: app_registry_name(app) for app in ("baton", "other", "baton-other", "")}
    assert len(set(names.values())) == len(names)
    assert names["baton"] == "baton-prefix-registry-baton"
    assert app_registry_name("other") == names["other"]  # every replica finds the same one
    with pytest.raises(TypeError):
        PrefixRegistryConfig()  # no cluster-wide default every application would share


def test_removing_a_registry_kills_it_for_good_and_a_missing_one_is_no_error(monkeypatch):
    actors, killed = {("baton-prefix-registry-a", "baton"): "actor-a"}, []

    def get_actor(name, namespace):
        if (name, namespace) not in actors:
            raise ValueError(f"Failed to look up actor with name {name!r}")
        return actors[name, namespace]

    monkeypatch.setattr(prefix_registry.ray, "get_actor", get_actor)
    monkeypatch.setattr(
        prefix_registry.ray, "kill", lambda actor, no_restart: killed.append((actor, no_restart))
    )
    assert remove_registry("baton-prefix-registry-a")
    assert not remove_registry("baton-prefix-registry-b")
    assert killed == [("actor-a", True)]


# -- the actor on a real Ray ------------------------------------------------------------


@pytest.fixture
def registry(ray_cluster, request):
    # A registry per test: a unique name so no state leaks between tests.
    config = PrefixRegistryConfig(max_entries=8, name=f"registry-{request.node.name}")
    handle = get_or_create_registry(config)
    yield handle
    ray_cluster.kill(handle)


@pytest.mark.slow
def test_actor_answers_per_replica_from_published_events(ray_cluster, registry):
    ray = ray_cluster
    ray.get(registry.publish.remote("prefill-0", PROMPT[:4], []))
    ray.get(registry.publish.remote("prefill-1", PROMPT[:2], []))
    assert ray.get(registry.longest_prefixes.remote(PROMPT)) == {"prefill-0": 4, "prefill-1": 2}
    # Eviction events.
    ray.get(registry.publish.remote("prefill-0", [], [PROMPT[1]]))
    assert ray.get(registry.longest_prefixes.remote(PROMPT)) == {"prefill-0": 1, "prefill-1": 2}


@pytest.mark.slow
def test_actor_applies_one_replicas_batches_in_order(ray_cluster, registry):
    ray = ray_cluster
    a = PROMPT[0]
    # Not awaited one by one: a store, an evict and a store again, all in flight at once.
    refs = [
        registry.publish.remote("r", [a], []),
        registry.publish.remote("r", [], [a]),
        registry.publish.remote("r", [a], []),
        registry.publish.remote("r", [], [a]),
    ]
    answer = registry.longest_prefixes.remote([a])
    ray.get(refs)
    assert ray.get(answer) == {"r": 0}


@pytest.mark.slow
def test_actor_keeps_its_size_bound(ray_cluster, registry):
    ray = ray_cluster
    ray.get(registry.publish.remote("r1", _chain(6, seed=1), []))
    ray.get(registry.publish.remote("r2", _chain(6, seed=2), []))
    stats = ray.get(registry.stats.remote())
    assert stats["entries"] == 8
    assert stats["dropped_entries"] == 4
    # r1's chain lost its last four blocks: its first two still match.
    answer = ray.get(registry.longest_prefixes.remote(_chain(6, seed=1)))
    assert answer == {"r1": 2, "r2": 0}
    assert ray.get(registry.longest_prefixes.remote(_chain(6, seed=2))) == {"r1": 0, "r2": 6}


@pytest.mark.slow
def test_actor_drops_a_removed_replica(ray_cluster, registry):
    ray = ray_cluster
    ray.get(registry.publish.remote("r1", PROMPT[:3], []))
    ray.get(registry.publish.remote("r2", PROMPT[:3], []))
    assert ray.get(registry.remove_replica.remote("r1")) == 3
    assert ray.get(registry.longest_prefixes.remote(PROMPT)) == {"r2": 3}
    assert ray.get(registry.stats.remote())["entries"] == 3


@pytest.mark.slow
def test_get_or_create_finds_the_same_named_actor(ray_cluster, registry, request):
    ray = ray_cluster
    again = get_or_create_registry(
        PrefixRegistryConfig(max_entries=8, name=f"registry-{request.node.name}")
    )
    ray.get(registry.publish.remote("r1", PROMPT[:2], []))
    assert ray.get(again.longest_prefixes.remote(PROMPT)) == {"r1": 2}
    named = ray.get_actor(f"registry-{request.node.name}", namespace="baton")
    assert ray.get(named.stats.remote())["entries"] == 2


@pytest.mark.slow
def test_a_restarted_actor_starts_every_replica_on_a_new_session(ray_cluster, registry):
    ray = ray_cluster
    before = ray.get(registry.publish.remote("r1", PROMPT[:3], []))
    ray.kill(registry, no_restart=False)  # as when its node goes: Ray starts it again, empty
    deadline = time.monotonic() + 30
    while True:
        assert time.monotonic() < deadline, "the registry was never restarted"
        try:
            if not ray.get(registry.stats.remote())["replicas"]:
                break
        except ray.exceptions.ActorUnavailableError:  # while it restarts
            pass
        time.sleep(0.1)
    after = ray.get(registry.publish.remote("r1", [], []))
    assert after != before
    assert ray.get(registry.longest_prefixes.remote(PROMPT)) == {"r1": 0}


@pytest.mark.slow
def test_actor_refuses_bad_events(ray_cluster, registry):
    ray = ray_cluster
    with pytest.raises(ray.exceptions.RayTaskError, match="BlockHash"):
        ray.get(registry.publish.remote("r1", ["not-a-hash"], []))
    # The actor survives a bad call and keeps serving.
    assert ray.get(registry.stats.remote())["entries"] == 0


@pytest.mark.slow
def test_a_routers_lookup_goes_without_hints_when_the_registry_is_slow_or_gone(
    ray_cluster, request
):
    ray = ray_cluster
    config = PrefixRegistryConfig(max_entries=8, name=f"registry-{request.node.name}")
    lookup = RegistryLookup(config, wait_s=0.5)

    @ray.remote(num_cpus=0)
    class Stalled:  # a registry that answers too late (restarting, or far behind)
        def longest_prefixes(self, hashes):
            time.sleep(3)
            return {"r1": len(hashes)}

    async def main():
        ray.get(lookup.actor.publish.remote("r1", PROMPT[:2], []))
        assert await lookup.longest_prefixes(PROMPT) == {"r1": 2}
        registry, lookup.actor = lookup.actor, Stalled.remote()
        assert await lookup.longest_prefixes(PROMPT) == {}  # its late answer says r1
        assert lookup.num_timeouts == 1
        ray.kill(lookup.actor)
        ray.kill(registry)
        assert await lookup.longest_prefixes(PROMPT) == {}  # lost: a new one is started
        assert await lookup.longest_prefixes(PROMPT) == {}  # which knows nothing yet
        ray.get(lookup.actor.publish.remote("r2", PROMPT[:3], []))
        assert await lookup.longest_prefixes(PROMPT) == {"r2": 3}

    try:
        asyncio.run(main())
    finally:
        ray.kill(lookup.actor)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["registry", "status board"])
def test_what_a_tp_replica_starts_for_the_app_outlives_the_replicas_placement_group(
    ray_cluster, request, kind
):
    """A TP replica runs in a placement group Serve reserves with its ranks, and Serve
    captures the actors it starts into it. The registry and the status board serve the
    whole application: they must not go down with that group when the replica is scaled
    away."""
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from serve_app.status_board import find_board, get_or_create_board

    ray = ray_cluster
    name = f"{kind}-{request.node.name}"
    pg = placement_group([{"CPU": 1.0}, {"CPU": 1.0}], strategy="STRICT_PACK")
    ray.get(pg.ready())

    def placement_group_of(_actor) -> str | None:
        return ray.get_runtime_context().get_placement_group_id()

    @ray.remote(num_cpus=1)
    def start() -> str | None:
        if kind == "registry":
            actor = get_or_create_registry(PrefixRegistryConfig(max_entries=8, name=name))
            ray.get(actor.publish.remote("r1", PROMPT[:2], []))
        else:
            actor = get_or_create_board(name)
            ray.get(actor.post.remote("r1", {"role": "decode"}))
        return ray.get(actor.__ray_call__.remote(placement_group_of))

    capture = PlacementGroupSchedulingStrategy(pg, 0, placement_group_capture_child_tasks=True)
    assert ray.get(start.options(scheduling_strategy=capture).remote()) is None
    remove_placement_group(pg)
    if kind == "registry":
        actor = ray.get_actor(name, namespace="baton")
        alive = ray.get(actor.longest_prefixes.remote(PROMPT)) == {"r1": 2}
    else:
        actor = find_board(name)
        alive = ray.get(actor.snapshots.remote()) == [{"role": "decode"}]
    ray.kill(actor)
    assert alive
