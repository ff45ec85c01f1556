"""One tensor-parallel rank: a member of the torch.distributed group that owns
its shard of the weights and its slice of every KV-cache block.

A rank pulls handed-over KV blocks itself, straight from the prefill ranks over Ray
Direct Transport (`pull`). The group calls `pull` and `drop_staged` in a concurrency
group of their own, so a transfer runs on its own thread while the rank computes
steps; the data waits here, staged under the export's key, until the engine imports
it into freshly allocated blocks between steps (`import_staged`) or gives up on the
request (`drop_staged`).
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import replace
from datetime import timedelta

import torch
import torch.distributed as dist

from workers.kv import cache_copy
from workers.kv import transport as kv_transport
from workers.kv.blocks import KVBlocks, select_blocks
from workers.kv.transport import KVPart, KVRef
from workers.model.parallel import TPGroup
from workers.runner.model_runner import ModelRunner
from workers.runner.runner_spec import RunnerSpec
from workers.runner.step_io import StepInput, StepOutput
from workers.torch_threads import use_num_threads

# A rank stuck in a collective because a peer died gives up after this long;
# the group notices the dead peer much sooner (see TPWorkerGroup._gather).
COLLECTIVE_TIMEOUT = timedelta(seconds=120)


class TPWorker:
    """Runs as a Ray actor, one per rank, inside the group's placement group."""

    def __init__(self, rank: int, world_size: int, num_threads: int):
        self.rank = rank
        self.world_size = world_size
        # Set again in each thread that computes: this actor's methods run on threads of
        # its concurrency groups, not the one running __init__ (workers/torch_threads.py).
        self.num_threads = num_threads
        self.runner: ModelRunner | None = None
        self.tp: TPGroup | None = None
        # Export key -> this rank's share of it, pulled and waiting for its import.
        # Written by the kv_pull thread, popped by the default one (single dict
        # operations, atomic under the GIL).
        self._staged: dict[str, KVBlocks] = {}
        self.num_pulls = 0
        self.num_pulled_bytes = 0

    def rendezvous_address(self) -> tuple[str, int]:
        """Rank 0's node address and a port free on it, for the group's TCP store."""
        import ray

        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def start(self, address: str, port: int, spec: RunnerSpec) -> None:
        use_num_threads(self.num_threads)
        backend = "nccl" if spec.device.startswith("cuda") else "gloo"
        device = spec.device
        if backend == "nccl":
            # Ray hands each rank its own GPU, visible as device 0.
            device = "cuda:0"
            torch.cuda.set_device(0)
        dist.init_process_group(
            backend,
            init_method=f"tcp://{address}:{port}",
            rank=self.rank,
            world_size=self.world_size,
            timeout=COLLECTIVE_TIMEOUT,
        )
        self.tp = TPGroup(self.rank, self.world_size, dist.group.WORLD)
        self.runner = ModelRunner.from_spec(replace(spec, device=device), self.tp)

    def execute(self, step: StepInput) -> StepOutput | None:
        """Every rank runs the step; only rank 0 returns its output (the sampling rows'
        full-vocab logits and any prompt logprobs, on the host)."""
        output = self._runner().execute(step)
        return output if self.rank == 0 else None

    def export_blocks(
        self, block_ids: list[int], start_block: int, transport: str, dst_tp: int | None
    ) -> KVPart:
        """This rank's slice of the blocks; under a direct transport it stays here until
        the importer pulls it from this rank."""
        return self._runner().export_blocks(block_ids, start_block, transport, dst_tp)[0]

    def import_blocks(self, block_ids: list[int], kv: KVBlocks) -> None:
        """Writes this rank's share, already cut for it, into `block_ids`."""
        cache_copy.import_blocks(self._runner(), block_ids, kv)

    def pull(self, key: str, parts: list[KVRef]) -> str | None:
        """Fetches the source parts that hold this rank's KV heads of an export (all
        its blocks) and stages the share under `key`. Returns None, or why it failed:
        a failed transfer is the request's problem, never a reason to fail the rank."""
        try:
            device = self.runner.device if self.runner is not None else "cpu"
            kv_rank, kv_size = self._kv_share()
            share = kv_transport.materialize(parts, kv_rank, kv_size, None, device)
            share = replace(share, data=share.data.contiguous())
        except (ValueError, RuntimeError) as e:  # KVTransferError and OOM are RuntimeErrors
            return f"TP rank {self.rank}: {e}"
        self._staged[key] = share
        self.num_pulls += 1
        sources = kv_transport.head_ranges(parts, kv_rank, kv_size)
        moved = (kv_transport.fetched_bytes(parts[r], a, b) for r, a, b in sources)
        self.num_pulled_bytes += sum(moved)
        return None

    def _kv_share(self) -> tuple[int, int]:
        """(this rank's share of the KV heads, shares); from the pull thread too."""
        if self.runner is None:
            raise RuntimeError(f"TP rank {self.rank} was not started")
        return self.runner.kv_rank, self.runner.kv_size

    def drop_staged(self, key: str) -> None:
        self._staged.pop(key, None)

    def import_staged(self, block_ids: list[int], key: str, rows: list[int]) -> None:
        """Writes the export's blocks `rows` of the share staged under `key` into
        `block_ids` and forgets it."""
        share = self._staged.pop(key, None)
        if share is None:
            raise RuntimeError(f"TP rank {self.rank} has no KV staged under {key!r}")
        kv = replace(share, data=select_blocks(share.data, rows))
        cache_copy.import_blocks(self._runner(), block_ids, kv)

    def live_exports(self) -> tuple[int, int]:
        return kv_transport.live_exports()

    def pull_stats(self) -> tuple[int, int, int]:
        """(pulls, bytes pulled, exports still staged) of this rank."""
        return self.num_pulls, self.num_pulled_bytes, len(self._staged)

    def weight_bytes(self) -> int:
        """Bytes of model weights this rank holds (all layouts it keeps)."""
        model = self._runner().model
        total = sum(p.numel() * p.element_size() for p in model.parameters())
        for module in model.modules():
            for name in ("packed", "weight_t"):
                t = getattr(module, name, None)
                if t is not None:
                    total += t.numel() * t.element_size()
            for name in ("blocks", "panels"):
                copy = getattr(module, name, None)
                total += 0 if copy is None else copy.nbytes
        return total

    def visible_devices(self) -> str:
        """The GPUs Ray gave this rank, as its CUDA_VISIBLE_DEVICES names them ("" for
        none)."""
        return os.environ.get("CUDA_VISIBLE_DEVICES", "")

    def time_all_reduce(self, numel: int, iters: int) -> float:
        """Mean seconds of one all-reduce of `numel` floats, as the layers issue them."""
        assert self.tp is not None
        runner = self._runner()
        x = torch.ones(numel, device=runner.device, dtype=runner.dtype)  # nccl: on the GPU
        self.tp.all_reduce(x)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            self.tp.all_reduce(x)
        return (time.perf_counter() - start) / iters

    def _runner(self) -> ModelRunner:
        """The started runner, for a method about to compute on the calling thread."""
        if self.runner is None:
            raise RuntimeError(f"TP rank {self.rank} was not started")
        use_num_threads(self.num_threads)
        return self.runner
