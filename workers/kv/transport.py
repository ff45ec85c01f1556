"""How a handoff's KV blocks travel from the prefill ranks to the decode ranks.

The transport is a config choice (`EngineConfig.kv_transport`):

- "object_store": the exporting process returns the `KVBlocks` themselves, so they
  ride in Ray's object store like any task result (copied in by the exporter, out by
  each reader). Works between any two processes.
- "nixl": Ray Direct Transport over NVIDIA NIXL (UCX underneath: shared memory or
  RDMA; GPU memory stays on the GPU). Each exporting rank keeps its slice in its own
  RDT store and hands out a `KVRef`; each decode rank pulls, one-sided, only what
  holds KV heads it owns (cut to its heads when the exporter knew the decode TP
  degree), straight from the prefill ranks that hold them
  (the decode replica itself at TP 1; each rank actor at TP > 1, see
  `workers/runner/tp_group.py`). Nothing has to be set up between the two sides
  beforehand, so pools can scale freely.

Ray's collective transports (gloo, nccl) do not fit elastic pools: both actors must
belong to one collective group created up front, and Ray's torch-gloo group is the
process's default torch.distributed group (one per process, fixed membership), which
every TP rank already uses for its own all-reduces.

An exported slice lives as long as a reference to it does: once decode has imported
it and dropped the handle, Ray frees it on the prefill rank; if decode dies first, its
borrowed references die with it and the slice is freed all the same. So the importer
drops its references as soon as the import is done, not when the request ends:
until then the slice is prefill memory outside its KV block budget. `live_exports`
tells what a process still holds.

Every process that exports or fetches over nixl first installs its own NIXL agent
(`nixl_agent.install_nixl_agent`), one whose progress thread does not spin.

A process fetches one direct-transport object at a time (`_fetch_lock`): Ray 2.60's
nixl fetch loads the exporter's agent metadata into a per-process cache without a
lock, and two threads fetching from one exporter at once crashed the importer
(a segfault in NIXL's `add_remote_agent`, 8 threads fetching from one exporter) or
failed the transfer (`NIXL_ERR_INVALID_PARAM` from `loadRemoteMD`). A decode replica
pulls its handoffs on threads of its own, so they would meet there. The cost: a
transfer that hangs (its exporter's node cut off but not yet declared dead) holds up
the process's other pulls until Ray fails it.
"""

from __future__ import annotations

import importlib.util
import math
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import torch

from workers.kv.blocks import KVBlocks, select_blocks
from workers.kv.nixl_agent import install_nixl_agent

TRANSPORTS = ("object_store", "nixl")

# This process's exported slices that Ray still holds for an importer (see live_exports).
_exported: weakref.WeakSet[torch.Tensor] = weakref.WeakSet()
_exported_lock = threading.Lock()  # exports run on the engine thread, live_exports on any
_fetch_lock = threading.Lock()  # one direct-transport fetch per process (see above)


@dataclass(frozen=True)
class KVRef:
    """A `KVBlocks` left in the process that exported it: its metadata (the same
    properties as KVBlocks') and Ray references to its data, one per run of its KV heads:
    `pieces` holds (first head, end head, ray.ObjectRef), in order, covering them all. A
    Ray object is fetched whole, so an exporter told the importer's TP degree cuts its
    slice where the importing ranks' heads split (`head_cuts`): each importing rank then
    fetches exactly its own heads."""

    pieces: tuple[tuple[int, int, Any], ...]
    shape: tuple[int, ...]
    dtype: torch.dtype
    tp_rank: int
    tp_size: int
    start_block: int = 0
    # Where the data is in its exporter ("cpu", "cuda:0"): Ray's nixl receiver allocates
    # on the source's device type unless told the importer's (see _fetch_heads).
    device: str = "cpu"

    @property
    def key(self) -> str:
        """Names this part (its first object's id): distinct for every export."""
        return self.pieces[0][2].hex()

    @property
    def num_blocks(self) -> int:
        return self.shape[3]

    @property
    def nbytes(self) -> int:
        return self.dtype.itemsize * math.prod(self.shape)


KVPart = KVBlocks | KVRef


class KVTransferError(RuntimeError):
    """A KVRef could not be fetched (its exporter died, or the transfer failed): the
    prompt must be computed again; the importer itself is fine."""


def check_transport(transport: str, field: str = "kv_transport") -> None:
    """ValueError unless `transport` is known and usable in this environment; the message
    names the caller's `field`."""
    if transport not in TRANSPORTS:
        raise ValueError(f"{field} must be one of {TRANSPORTS}, got {transport!r}")
    if transport == "nixl" and importlib.util.find_spec("nixl") is None:
        raise ValueError(
            f"{field}='nixl' needs the nixl package in every replica's environment "
            f"(pip install nixl), or use {field}='object_store'"
        )


def publish(kv: KVBlocks, transport: str, cuts: Sequence[int] = ()) -> KVPart:
    """What the exporting process returns for its slice under `transport`; a direct
    transport puts each run of heads between `cuts` (see `head_cuts`) in an object of
    its own."""
    check_transport(transport)
    if transport == "object_store":
        return kv.cpu()
    import ray

    install_nixl_agent()
    bounds = [0, *cuts, kv.data.shape[2]]
    pieces = []
    for lo, hi in pairwise(bounds):
        data = kv.data if not cuts else kv.data[:, :, lo:hi].contiguous()
        pieces.append((lo, hi, ray.put(data, _tensor_transport=transport)))
        with _exported_lock:
            _exported.add(data)  # Ray keeps this very tensor until the last reference is gone
    return KVRef(
        tuple(pieces),
        tuple(kv.data.shape),
        kv.data.dtype,
        kv.tp_rank,
        kv.tp_size,
        kv.start_block,
        device=str(kv.data.device),
    )


def head_cuts(num_heads: int, src_rank: int, src_tp: int, dst_tp: int | None) -> list[int]:
    """Where rank `src_rank` of `src_tp` cuts its run of `num_heads` KV heads (all ranks
    together) so that no rank of `dst_tp` needs part of a piece: the importing ranks'
    boundaries that fall inside it, relative to its first head. None: the importer is
    unknown, no cuts."""
    if dst_tp is None:
        return []
    if dst_tp < 1 or num_heads % dst_tp:
        raise ValueError(f"dst_tp must divide the {num_heads} KV heads, got {dst_tp}")
    lo, hi = src_rank * num_heads // src_tp, (src_rank + 1) * num_heads // src_tp
    bounds = (d * num_heads // dst_tp for d in range(1, dst_tp))
    return [b - lo for b in bounds if lo < b < hi]


def live_exports() -> tuple[int, int]:
    """(objects, bytes) this process exported over a direct transport that some reference
    still keeps alive: handoffs whose importer has not let go yet (a cut part is one
    object per piece)."""
    with _exported_lock:
        tensors = list(_exported)
    return len(tensors), sum(t.nbytes for t in tensors)


def fetch(part: KVPart, device: str | torch.device = "cpu") -> KVBlocks:
    """The part's data in this process (a transfer for a KVRef). `device`: the
    importer's; a KVRef on another kind of device arrives straight on it."""
    if isinstance(part, KVBlocks):
        return part
    data = _fetch_heads(part, 0, part.shape[2], device)
    return KVBlocks(data, part.tp_rank, part.tp_size, part.start_block)


def fetch_all(parts: Sequence[KVPart], device: str | torch.device = "cpu") -> list[KVBlocks]:
    return [fetch(p, device) for p in parts]


def fetched_bytes(part: KVPart, lo: int, hi: int) -> int:
    """Bytes a fetch of heads [lo, hi) of a KVRef moves: all of each piece it touches."""
    if isinstance(part, KVBlocks):
        return 0
    per_head = part.nbytes // part.shape[2]
    return sum((b - a) * per_head for a, b, _ in part.pieces if a < hi and lo < b)


def _fetch_heads(part: KVRef, lo: int, hi: int, device: str | torch.device) -> torch.Tensor:
    """Heads [lo, hi) of the part, fetching only the pieces that hold them (in one
    ray.get, so they travel together), onto the kind of device `device` is."""
    import ray
    import ray.experimental.rdt as rdt

    install_nixl_agent()
    wanted = [(a, b, ref) for a, b, ref in part.pieces if a < hi and lo < b]
    try:
        if torch.device(device).type != torch.device(part.device).type:
            # Else Ray allocates the receive buffers on the exporter's kind of device: a
            # GPU prefill's KV would need CUDA in a CPU decode replica (or take GPU 0).
            for _, _, ref in wanted:
                rdt.set_target_device_for_ref(ref, str(device))
        with _fetch_lock:
            datas = ray.get([ref for _, _, ref in wanted])
    except Exception as e:  # what Ray raises depends on the transport and the failure
        cause = getattr(e, "cause", None) or e  # a task error's own exception, no traceback
        raise KVTransferError(
            f"could not fetch TP rank {part.tp_rank}'s KV slice: {type(cause).__name__}: {cause}"
        ) from e
    for (a, b, _), data in zip(wanted, datas, strict=True):
        expected = (*part.shape[:2], b - a, *part.shape[3:])
        if tuple(data.shape) != expected:
            raise RuntimeError(
                f"KV slice of rank {part.tp_rank} arrived with shape {tuple(data.shape)}, "
                f"its exporter announced {expected}"
            )
    data = datas[0] if len(datas) == 1 else torch.cat(datas, dim=2)
    first = wanted[0][0]
    return data[:, :, lo - first : hi - first]


def head_ranges(parts: Sequence[KVPart], dst_rank: int, dst_tp: int) -> list[tuple[int, int, int]]:
    """(source part, first head, end head) within each source part that rank `dst_rank`
    of `dst_tp` takes its KV heads from, in order.

    Ranks own contiguous, equal runs of KV heads (rank r of t holds heads
    [r * H / t, (r + 1) * H / t)), so a destination rank's run is cut from the source
    runs it overlaps.
    """
    src_tp = len(parts)
    heads = parts[0].shape[2] * src_tp
    if not 0 <= dst_rank < dst_tp or heads % dst_tp:
        raise ValueError(
            f"rank {dst_rank} of a TP degree of {dst_tp} cannot take a share of {heads} KV heads"
        )
    lo, hi = dst_rank * heads // dst_tp, (dst_rank + 1) * heads // dst_tp
    ranges = []
    for r in range(src_tp):
        part_lo, part_hi = r * heads // src_tp, (r + 1) * heads // src_tp
        a, b = max(lo, part_lo), min(hi, part_hi)
        if a < b:
            ranges.append((r, a - part_lo, b - part_lo))
    return ranges


def materialize(
    parts: Sequence[KVPart],
    dst_rank: int,
    dst_tp: int,
    rows: Sequence[int] | None = None,
    device: str | torch.device = "cpu",
) -> KVBlocks:
    """Rank `dst_rank` of `dst_tp`'s share of one export (all source ranks' parts, in
    rank order, already checked to agree): its KV heads of the export's blocks `rows`
    (indices into the export, in order; None: all of them). Fetches only what holds
    some of those heads: the pieces that do (see KVRef), or of an export cut for another
    TP degree, the parts that do, whole; onto `device`'s kind of device (the importer's)."""
    pieces = []
    for r, a, b in head_ranges(parts, dst_rank, dst_tp):
        part = parts[r]
        if isinstance(part, KVBlocks):
            data = part.data[:, :, a:b]
        else:
            data = _fetch_heads(part, a, b, device)
        pieces.append(select_blocks(data, rows))
    data = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=2)
    return KVBlocks(data, dst_rank, dst_tp, parts[0].start_block)
