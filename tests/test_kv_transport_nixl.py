"""The nixl transport of the KV handoff (Ray Direct Transport), between real processes:
data left with its exporter until pulled, concurrent and cross-device pulls, engines
handing off across TP degrees, prefetched KV released, a part that cannot be fetched."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest
import torch
from tiny_model import make_tiny_model

from workers.engine.config import EngineConfig
from workers.kv.blocks import KVBlocks
from workers.kv.transport import KVRef, KVTransferError, fetch, fetch_all, publish

# The nixl tests run their transfers in actors they kill afterwards, so no NIXL agent
# outlives its test.


@pytest.mark.slow
def test_nixl_leaves_the_data_with_its_exporter_until_fetched(ray_cluster):
    ray = ray_cluster

    @ray.remote(num_cpus=0)
    class Exporter:
        def __init__(self):
            self.data = torch.randn(2, 2, 3, 4, 16, 8)

        def export(self, cuts: tuple[int, ...] = ()) -> list:
            return [publish(KVBlocks(self.data, 1, 3, 2), "nixl", cuts)]

        def expected(self) -> torch.Tensor:
            return self.data

    @ray.remote(num_cpus=0)
    class Importer:
        def fetch(self, parts: list) -> KVBlocks:
            return fetch_all(parts)[0]

        def fetch_as(self, part: KVRef, shape: tuple[int, ...]) -> str:
            try:
                fetch(KVRef(part.pieces, shape, part.dtype, 1, 3, 2))
            except RuntimeError as e:
                return str(e)
            return "fetched"

    exporter, importer = Exporter.remote(), Importer.remote()
    try:
        (part,) = ray.get(exporter.export.remote())
        assert isinstance(part, KVRef)
        assert (part.tp_rank, part.tp_size, part.start_block, part.num_blocks) == (1, 3, 2, 4)
        assert part.nbytes == 2 * 2 * 3 * 4 * 16 * 8 * 4
        kv = ray.get(importer.fetch.remote([part]))
        assert torch.equal(kv.data, ray.get(exporter.expected.remote()))
        assert (kv.tp_rank, kv.tp_size, kv.start_block) == (1, 3, 2)
        assert "announced" in ray.get(importer.fetch_as.remote(part, (1, 2, 3)))
        # Cut after its first head: two objects, fetched and joined again.
        (cut,) = ray.get(exporter.export.remote((1,)))
        assert [(a, b) for a, b, _ in cut.pieces] == [(0, 1), (1, 3)]
        assert torch.equal(ray.get(importer.fetch.remote([cut])).data, kv.data)
    finally:
        ray.kill(exporter)
        ray.kill(importer)


@pytest.mark.slow
def test_concurrent_nixl_fetches_from_one_exporter_all_arrive(ray_cluster):
    """A decode replica pulls its handoffs on threads of its own. Ray's nixl fetch caches
    the exporter's agent metadata without a lock: unserialized, these fetches crashed
    the importing process (a segfault in NIXL's add_remote_agent)."""
    ray = ray_cluster

    @ray.remote(num_cpus=0)
    class Exporter:
        def export(self, seed: int) -> KVRef:
            # Fresh memory each time, released once fetched: the exporter's agent
            # metadata changes version as handoffs come and go.
            data = torch.randn(2, 2, 3, 4, 16, 8, generator=torch.Generator().manual_seed(seed))
            return publish(KVBlocks(data, 0, 1, 0), "nixl")

    @ray.remote(num_cpus=0)
    class Importer:
        def fetch_many(self, exporter, seeds: list[int]) -> list[bool]:
            def one(seed: int) -> bool:
                kv = fetch(ray.get(exporter.export.remote(seed)))
                expected = torch.randn(
                    2, 2, 3, 4, 16, 8, generator=torch.Generator().manual_seed(seed)
                )
                return torch.equal(kv.data, expected)

            with ThreadPoolExecutor(8) as pool:
                return list(pool.map(one, seeds))

    exporter, importer = Exporter.remote(), Importer.remote()
    try:
        assert ray.get(importer.fetch_many.remote(exporter, list(range(64)))) == [True] * 64
    finally:
        ray.kill(exporter)
        ray.kill(importer)


@pytest.mark.slow
def test_a_nixl_part_from_another_kind_of_device_is_fetched_onto_the_importers(ray_cluster):
    # A GPU prefill's KV into a CPU decode: Ray's receiver would allocate on CUDA unless
    # told the importer's device. Here a CPU export is labelled as a GPU's, so the fetch
    # goes through Ray's cross-device path and must still deliver the data to the CPU.
    ray = ray_cluster

    @ray.remote(num_cpus=0)
    class Exporter:
        def __init__(self):
            self.data = torch.randn(2, 2, 3, 4, 16, 8)

        def export(self) -> tuple[KVRef, torch.Tensor]:
            return publish(KVBlocks(self.data, 0, 1, 0), "nixl", (1,)), self.data

    @ray.remote(num_cpus=0)
    class Importer:
        def fetch(self, part: KVRef) -> tuple[torch.Tensor, list[str]]:
            import ray.experimental.rdt as rdt

            targets, original = [], rdt.set_target_device_for_ref

            def spy(ref, device):
                targets.append(device)
                original(ref, device)

            rdt.set_target_device_for_ref = spy
            try:
                return fetch(part, "cpu").data, targets
            finally:
                rdt.set_target_device_for_ref = original

    exporter, importer = Exporter.remote(), Importer.remote()
    try:
        part, data = ray.get(exporter.export.remote())
        assert part.device == "cpu"
        got, targets = ray.get(importer.fetch.remote(part))
        assert torch.equal(got, data) and targets == []  # same kind: Ray's default
        got, targets = ray.get(importer.fetch.remote(replace(part, device="cuda:0")))
        assert torch.equal(got, data) and targets == ["cpu", "cpu"]  # one per piece
    finally:
        ray.kill(exporter)
        ray.kill(importer)


@pytest.mark.slow
def test_engines_hand_off_over_nixl_between_tp_degrees(ray_cluster, tmp_path):
    ray = ray_cluster
    model_dir = str(make_tiny_model(tmp_path))

    @ray.remote(num_cpus=0)
    class Engines:
        """A prefill and a decode engine, in a process killed afterwards."""

        def handoffs(self, prefill_tp: int, decode_tp: int, prefetch: bool, cut: bool) -> dict:
            from workers.engine.llm_engine import LLMEngine
            from workers.engine.sampling_params import SamplingParams

            def engine(**kw) -> LLMEngine:
                return LLMEngine(EngineConfig(model=model_dir, num_kv_blocks=64, **kw))

            def drain(e: LLMEngine, rid: str) -> list[int]:
                tokens = []
                while e.has_unfinished():
                    for out in e.step():
                        tokens += out.new_token_ids if out.request_id == rid else []
                return tokens

            single = engine()
            prefill = engine(tensor_parallel_size=prefill_tp, kv_transport="nixl")
            decode = engine(tensor_parallel_size=decode_tp)
            params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
            results, exported = [], []
            try:
                for i, n in enumerate([7, 16, 41]):
                    prompt = [3 + (i * 31 + j * 7) % 300 for j in range(n)]
                    single.add_request("s", prompt, params)
                    expected = drain(single, "s")
                    prefill.add_request(f"r{i}", prompt, params, prefill_only=True)
                    first = drain(prefill, f"r{i}")
                    handle, parts = prefill.export_kv(f"r{i}", dst_tp=decode_tp if cut else None)
                    exported.append([p.nbytes for p in parts])
                    if prefetch:  # as AsyncEngine does, before the request reaches the engine
                        parts = decode.prefetch_kv(parts)
                    decode.add_prefilled_request(f"r{i}", prompt, params, handle, parts)
                    prefill.release_handoff(f"r{i}")
                    got = first + drain(decode, f"r{i}")[1:]  # decode repeats the first token
                    results.append((expected, got, all(isinstance(p, KVRef) for p in parts)))
                assert decode.stats().num_free_blocks == decode.stats().num_total_blocks
                pulls = decode.runner.pull_stats() if decode_tp > 1 else None
            finally:
                # The TP groups' placement groups belong to the driver, not to this
                # actor: only a shutdown gives their CPUs back.
                for e in (single, prefill, decode):
                    e.shutdown()
            return {"results": results, "exported": exported, "pulls": pulls}

    # cut: the export is cut for the decode ranks (what a decode replica asks for).
    cases = [(2, 1, True, False), (1, 2, False, False), (1, 2, True, True), (2, 2, True, True)]
    for prefill_tp, decode_tp, prefetch, cut in cases:
        engines = Engines.remote()
        try:
            run = ray.get(engines.handoffs.remote(prefill_tp, decode_tp, prefetch, cut))
        finally:
            ray.kill(engines)
        for expected, got, direct in run["results"]:
            assert got == expected
            # A TP decode group imports the refs themselves: its ranks pull, not the engine.
            assert direct == (decode_tp > 1 or not prefetch)
        if decode_tp > 1:
            # Rank to rank: every decode rank pulled each export once, and nothing stays
            # staged. What it moved: at 2 -> 2, part r alone; at 1 -> 2, the one part
            # whole, or cut for the decode ranks, the half holding its heads.
            one_part = sum(sizes[0] for sizes in run["exported"])
            moved = one_part // 2 if (prefill_tp, cut) == (1, True) else one_part
            assert run["pulls"] == [(3, moved, 0)] * decode_tp


@pytest.mark.slow
def test_prefetched_kv_is_released_when_its_request_does_not_import_it(ray_cluster, tmp_path):
    ray = ray_cluster
    model_dir = str(make_tiny_model(tmp_path))

    @ray.remote(num_cpus=0)
    class Engines:
        def staged_after_each_way_out(self) -> dict:
            import time
            from dataclasses import replace

            from workers.engine.llm_engine import LLMEngine
            from workers.engine.sampling_params import SamplingParams

            def engine(**kw) -> LLMEngine:
                return LLMEngine(EngineConfig(model=model_dir, **{"num_kv_blocks": 64, **kw}))

            prefill = engine(kv_transport="nixl")
            # Four blocks of 16 tokens: room for one request at a time.
            decode = engine(tensor_parallel_size=2, num_kv_blocks=4)
            params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
            prompt = list(range(3, 40))
            staged = {}

            def export(rid: str, tokens: list[int]):
                prefill.add_request(rid, tokens, params, prefill_only=True)
                while prefill.has_unfinished():
                    prefill.step()
                return prefill.export_kv(rid)

            def drain() -> None:
                while decode.has_unfinished():
                    decode.step()

            def now() -> list[int]:
                return [s for _, _, s in decode.runner.pull_stats()]

            def settled() -> list[int]:
                # Drops are posted to the ranks without waiting: poll until they land.
                deadline = time.monotonic() + 30
                while (counts := now()) != [0, 0] and time.monotonic() < deadline:
                    time.sleep(0.05)
                return counts

            try:
                handle, parts = export("a", prompt)
                parts = decode.prefetch_kv(parts)
                staged["prefetched"] = now()
                bad = replace(handle, num_tokens=handle.num_tokens + 1)
                try:
                    decode.add_prefilled_request("a", prompt, params, bad, parts)
                except ValueError:
                    staged["refused"] = settled()

                # Decode computed this two-block prompt itself meanwhile: the import
                # needs no block, and its pulled export is dropped.
                two_blocks = list(range(3, 35))
                decode.add_request("warm", two_blocks, params)
                drain()
                b_handle, b_parts = export("b", two_blocks)
                b_parts = decode.prefetch_kv(b_parts)
                decode.add_prefilled_request("b", two_blocks, params, b_handle, b_parts)
                drain()
                staged["all_cached"] = settled()

                # An import waiting for blocks that is aborted drops its pull.
                decode.add_request("filler", list(range(3, 53)), params)
                decode.step()  # the filler's prompt takes all four blocks
                parts = decode.prefetch_kv(parts)
                decode.add_prefilled_request("a", prompt, params, handle, parts)
                staged["waiting"] = (now(), decode.stats().imports_waiting)
                decode.abort("a")
                staged["aborted"] = settled()
                decode.abort("filler")

                wrong = ray.put(torch.zeros(1))
                lost = [replace(parts[0], pieces=((0, parts[0].shape[2], wrong),))]
                try:
                    decode.prefetch_kv(lost)
                except KVTransferError as e:
                    staged["failed"] = (settled(), str(e))
                stats = decode.stats()
                staged["free"] = (stats.num_free_blocks, stats.num_total_blocks)
            finally:
                prefill.shutdown()
                decode.shutdown()
            return staged

    engines = Engines.remote()
    try:
        staged = ray.get(engines.staged_after_each_way_out.remote())
    finally:
        ray.kill(engines)
    assert staged["prefetched"] == [1, 1] and staged["waiting"] == ([1, 1], 1)
    assert staged["refused"] == staged["all_cached"] == staged["aborted"] == [0, 0]
    # A part whose data is not what its exporter announced is a transfer error, and the
    # group is still usable afterwards (its stats were read after it).
    assert staged["failed"][0] == [0, 0] and "announced" in staged["failed"][1]
    assert staged["free"][0] == staged["free"][1]


@pytest.mark.slow
def test_a_part_that_cannot_be_fetched_is_a_transfer_error(ray_cluster):
    ray = ray_cluster

    @ray.remote(num_cpus=0)
    def lost() -> torch.Tensor:
        raise OSError("exporter gone")

    part = KVRef(((0, 1, lost.remote()),), (1, 2, 1, 1, 4, 8), torch.float32, 1, 2)
    with pytest.raises(KVTransferError, match="rank 1.*exporter gone"):
        fetch(part)
