"""A tensor-parallel worker group: one Ray actor per rank, packed on one node.

The engine drives it exactly like an in-process ModelRunner (`execute(step)
-> StepOutput`): each step is sent to every rank, the ranks exchange activations
over torch.distributed, and rank 0's output (logits, prompt logprobs) comes back. A
rank that dies turns the next step (or KV pull) into an EngineDeadError naming it,
rather than a hang.

Handed-over KV blocks under a direct transport (KVRefs) go rank to rank: each rank
pulls the prefill ranks' parts that hold its KV heads itself (`prefetch`, callable from
any thread while steps run) and the import only writes what is already there.
"""

from __future__ import annotations

import threading
from dataclasses import replace

from workers.errors import EngineDeadError
from workers.kv import transport as kv_transport
from workers.kv.transport import KVPart, KVRef, KVTransferError
from workers.model.config import ModelConfig, kv_shards
from workers.runner.runner_spec import RunnerSpec
from workers.runner.step_io import StepInput, StepOutput
from workers.runner.tp_worker import TPWorker

# Where a group's ranks go (EngineConfig.tp_placement says what each means).
TP_PLACEMENTS = ("own", "current")

_PLACEMENT_TIMEOUT_S = 60.0
# For rank 0's actor to come up in its bundle (a worker process importing torch, slow on
# a loaded machine); bounded, as a bundle something else took would leave it pending.
_START_TIMEOUT_S = 120.0
# The ranks' concurrency group for moving handed-over KV into and out of their staging
# area: its own thread, so a pull overlaps the steps run in Ray's default group.
_KV_PULL = "kv_pull"


def rank_bundle(gpu: bool) -> dict[str, float]:
    """What one rank's actor takes, and so what a placement group reserves per rank."""
    return {"CPU": 1.0, "GPU": 1.0} if gpu else {"CPU": 1.0}


class TPWorkerGroup:
    # The ranks set their own threads for every step (tp_worker.py); the engine's
    # small-step rule (ModelRunner.small_step_rows) is not theirs.
    small_step_rows = 0

    def __init__(
        self,
        tp_size: int,
        spec: RunnerSpec,
        num_threads_per_rank: int = 1,
        placement: str = "own",
    ):
        import ray
        from ray.util.placement_group import remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if placement not in TP_PLACEMENTS:
            raise ValueError(f"placement must be one of {TP_PLACEMENTS}, got {placement!r}")
        if not ray.is_initialized():
            # An engine built outside a Ray cluster gets a private local one.
            ray.init(include_dashboard=False, log_to_driver=False)
        self._ray = ray
        self._remove_pg = remove_placement_group
        self.tp_size = tp_size
        # Ranks holding distinct KV-head shares: all of them, unless heads are replicated.
        num_kv_heads = ModelConfig.from_pretrained(spec.model_dir).num_key_value_heads
        self.kv_size = kv_shards(num_kv_heads, tp_size)
        self._ranks_per_share = tp_size // self.kv_size
        gpu = spec.device.startswith("cuda")
        bundle = rank_bundle(gpu)
        if placement == "own":
            self.placement_group, first_bundle = _reserve_on_this_node(tp_size, bundle), 0
        else:
            self.placement_group, first_bundle = _current_bundles(tp_size, bundle), 1
        self._owns_placement_group = placement == "own"
        actor = ray.remote(concurrency_groups={_KV_PULL: 1})(TPWorker)
        self.workers = [
            actor.options(
                num_cpus=bundle["CPU"],
                num_gpus=bundle.get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.placement_group, placement_group_bundle_index=first_bundle + rank
                ),
            ).remote(rank, tp_size, num_threads_per_rank)
            for rank in range(tp_size)
        ]
        self._failure: str | None = None
        # Keys of exports every rank has pulled and holds for import (see prefetch).
        self._staged: set[str] = set()
        self._lock = threading.Lock()  # guards _staged and shutting down
        try:
            address, port = self._rendezvous(first_bundle)
            self._gather(
                [w.start.remote(address, port, spec) for w in self.workers], collective=True
            )
        except BaseException:
            self.shutdown()
            raise

    def _rendezvous(self, first_bundle: int) -> tuple[str, int]:
        """Rank 0's address for the group's TCP store, once its actor is up."""
        try:
            return self._ray.get(
                self.workers[0].rendezvous_address.remote(), timeout=_START_TIMEOUT_S
            )
        except self._ray.exceptions.GetTimeoutError as e:
            raise RuntimeError(
                f"TP rank 0 did not start within {_START_TIMEOUT_S:.0f}s in bundle "
                f"{first_bundle} of its placement group: is something else holding the "
                "bundles reserved for the ranks?"
            ) from e

    def execute(self, step: StepInput) -> StepOutput:
        return self._gather([w.execute.remote(step) for w in self._ranks()], collective=True)[0]

    def export_blocks(
        self,
        block_ids: list[int],
        start_block: int = 0,
        transport: str = "object_store",
        dst_tp: int | None = None,
    ) -> list[KVPart]:
        """Each KV-head share's slice of the blocks, in share order, as `transport`
        carries it (cut for an importer of `dst_tp` shares, if given): every rank's, or,
        where ranks replicate heads, the first of each share's ranks."""
        return self._gather(
            [
                w.export_blocks.remote(block_ids, start_block, transport, dst_tp)
                for w in self._ranks()[:: self._ranks_per_share]
            ]
        )

    def prefetch(self, parts: list[KVPart]) -> list[KVPart]:
        """Has every rank pull its KV heads of a direct-transport export (KVRefs) from the
        prefill ranks and hold them for `import_blocks`; returns the parts to import.
        Safe to call from any thread while steps run: the pulls run on each rank's own
        transfer thread. KVTransferError (nothing left staged) if any rank's pull fails."""
        if not _all_refs(parts):
            return parts
        key = _export_key(parts)
        self._pull(key, parts)
        with self._lock:
            self._staged.add(key)
        return parts

    def _pull(self, key: str, parts: list[KVRef]) -> None:
        """Every rank stages its share of the export under `key`, or none does."""
        pulls = [_on_pull_thread(w.pull).remote(key, parts) for w in self._ranks()]
        errors = [e for e in self._gather(pulls) if e]
        if errors:
            for w in self.workers:
                _on_pull_thread(w.drop_staged).remote(key)
            raise KVTransferError("; ".join(errors))

    def release_prefetched(self, parts: list[KVPart]) -> None:
        """Drops a prefetched export that will not be imported (its request ended first)."""
        if not _all_refs(parts):
            return
        key = _export_key(parts)
        with self._lock:
            if key not in self._staged:
                return
            self._staged.discard(key)
        for w in self.workers:
            # Queued behind the rank's pull of it, if any (one thread, in order).
            _on_pull_thread(w.drop_staged).remote(key)

    def import_blocks(self, block_ids: list[int], parts: list[KVPart], rows: list[int]) -> None:
        """Writes each rank's KV heads of an export's blocks `rows` (every source rank's
        part, in rank order) into `block_ids`.

        KVRefs are pulled by the ranks themselves, here if `prefetch` has not done it yet
        (AsyncEngine always has, so the transfer costs no step). Parts already in this
        process are cut into one contiguous share per rank and sent to each: the pickled
        tensor does not drag the other ranks' heads along."""
        ranks = self._ranks()
        if _all_refs(parts):
            key = _export_key(parts)
            with self._lock:
                staged = key in self._staged
                self._staged.discard(key)
            if not staged:
                self._pull(key, parts)
            self._gather([w.import_staged.remote(block_ids, key, rows) for w in ranks])
            return
        local = kv_transport.fetch_all(parts, "cpu")  # to the ranks through Ray's object store
        shares = [
            kv_transport.materialize(local, rank // self._ranks_per_share, self.kv_size, rows)
            for rank in range(self.tp_size)
        ]
        self._gather(
            [
                w.import_blocks.remote(block_ids, replace(kv, data=kv.data.contiguous()))
                for w, kv in zip(ranks, shares, strict=True)
            ]
        )

    def live_exports(self) -> tuple[int, int]:
        """(objects, bytes) of the ranks' direct-transport exports still referenced."""
        # On the transfer thread: not queued behind a step.
        per_rank = self._gather([_on_pull_thread(w.live_exports).remote() for w in self._ranks()])
        return sum(n for n, _ in per_rank), sum(b for _, b in per_rank)

    def pull_stats(self) -> list[tuple[int, int, int]]:
        """Per rank: (exports pulled, bytes pulled, exports still staged)."""
        return self._gather([w.pull_stats.remote() for w in self._ranks()])

    def weight_bytes(self) -> list[int]:
        return self._gather([w.weight_bytes.remote() for w in self._ranks()])

    def visible_devices(self) -> str:
        """The GPUs the ranks were given, in CUDA_VISIBLE_DEVICES' syntax as their node
        numbers them ("" for none): what a process on that node reads telemetry of."""
        names = [
            d
            for v in self._gather([w.visible_devices.remote() for w in self._ranks()])
            for d in v.split(",")
            if d.strip()
        ]
        return ",".join(names)

    def time_all_reduce(self, numel: int, iters: int = 50) -> float:
        refs = [w.time_all_reduce.remote(numel, iters) for w in self._ranks()]
        return max(self._gather(refs, collective=True))

    def shutdown(self) -> None:
        """Kills the ranks and frees their placement group if the group reserved it (one
        it was given goes with the process it was reserved for); safe to call twice, and
        from the engine thread and a prefetching thread at once (both may see a rank die)."""
        with self._lock:
            pg, self.placement_group = self.placement_group, None
            workers, self.workers = self.workers, []
            self._failure = self._failure or "the worker group was shut down"
        if pg is None:
            return
        for w in workers:
            self._ray.kill(w)
        if self._owns_placement_group:
            self._remove_pg(pg)

    @property
    def failure(self) -> str | None:
        """Why the group is unusable (a rank died, seen by a step or a KV pull; or it was
        shut down), or None."""
        return self._failure

    def _ranks(self) -> list:
        if self._failure is not None:
            raise EngineDeadError(f"TP worker group unusable: {self._failure}")
        return self.workers

    def _gather(self, refs: list, collective: bool = False) -> list:
        """Results of one call on every rank, failing fast when a rank dies.

        Waiting on all ranks together (not rank 0 first) matters: when rank 2
        dies, rank 0 blocks inside an all-reduce, and only rank 2's reference
        tells what happened. An exception a rank's method raises ends the group only in a
        `collective` call, whose other ranks may wait in a collective for ever; elsewhere
        (a handoff's export, pull or import) it is that call's error, raised as its own
        type once every rank's call has ended, and the group stays usable.
        """
        ray = self._ray
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        pending = list(refs)
        raised = None
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(done[0])
            except ray.exceptions.RayTaskError as e:
                if collective:
                    self._fail(rank_of[done[0]], e)
                raised = raised or e
            except ray.exceptions.RayActorError as e:
                self._fail(rank_of[done[0]], e)
        if raised is not None:
            raise raised.as_instanceof_cause()
        return ray.get(refs)

    def _fail(self, rank: int, cause: Exception) -> None:
        self._failure = f"TP rank {rank} of {self.tp_size} failed"
        self.shutdown()
        raise EngineDeadError(
            f"{self._failure}; the worker group is shut down and the engine "
            f"must be restarted: {cause}"
        ) from cause


def _on_pull_thread(method):
    return method.options(concurrency_group=_KV_PULL)


def _all_refs(parts: list[KVPart]) -> bool:
    return isinstance(parts, list) and bool(parts) and all(isinstance(p, KVRef) for p in parts)


def _export_key(parts: list[KVRef]) -> str:
    # One export's parts are distinct Ray objects, so the first one names it.
    return parts[0].key


def _reserve_on_this_node(tp_size: int, bundle: dict[str, float]):
    """A placement group of the ranks' own, on this process's node."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    # STRICT_PACK: the ranks exchange activations twice per layer, so they must
    # share a node; and that node is this process's (Ray's built-in node-id label),
    # so a pool's ranks stay on the nodes its replicas were placed on.
    here = {"ray.io/node-id": ray.get_runtime_context().get_node_id()}
    pg = placement_group(
        [bundle] * tp_size, strategy="STRICT_PACK", bundle_label_selector=[here] * tp_size
    )
    try:
        ray.get(pg.ready(), timeout=_PLACEMENT_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError as e:
        remove_placement_group(pg)
        raise RuntimeError(
            f"no node has room for {tp_size} TP ranks ({bundle} each) within "
            f"{_PLACEMENT_TIMEOUT_S:.0f}s; lower the TP degree or add resources"
        ) from e
    return pg


def _current_bundles(tp_size: int, bundle: dict[str, float]):
    """The placement group this process runs in, checked to hold a bundle for each rank
    after its own first one (how a Serve replica's `placement_group_bundles` reserve its
    ranks with it)."""
    from ray.util import get_current_placement_group

    pg = get_current_placement_group()
    specs = [] if pg is None else pg.bundle_specs
    ranks = specs[1 : 1 + tp_size]
    if len(ranks) < tp_size or any(
        have.get(name, 0.0) < amount for have in ranks for name, amount in bundle.items()
    ):
        raise RuntimeError(
            f"tp_placement 'current' needs this process in a placement group whose bundles "
            f"1..{tp_size} hold {bundle} each; it runs in {specs or 'none'}. Reserve them "
            "with the process (Serve: placement_group_bundles), or use tp_placement 'own'"
        )
    return pg
