"""Owns the model and its paged KV cache; turns one scheduled step into logits (and the
prompt logprobs its chunks ask for).

The step arrives as plain data (`StepInput`) so the same runner can sit in the
engine's process or in each rank of a tensor-parallel worker group.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from workers.heap_policy import keep_freed_memory
from workers.kv import cache_copy
from workers.kv import transport as kv_transport
from workers.kv.kv_groups import KVCacheGroups
from workers.kv.transport import KVPart
from workers.model.attention_metadata import AttentionMetadata, PrefillChunk
from workers.model.loader import load_model
from workers.model.parallel import TPGroup
from workers.runner.runner_spec import RunnerSpec
from workers.runner.step_io import PromptLogprobRows, SeqChunk, StepInput, StepOutput

logger = logging.getLogger(__name__)

# Prompt positions whose logits are computed at once, for prompt logprobs: 100 MB of
# float32 logits and their log-softmax for SmolLM2's vocabulary, 250 MB for Llama 3's
# (about twice that at the peak under TP, with the all-gather's buffers).
_PROMPT_ROWS = 256


class ModelRunner:
    def __init__(
        self,
        model_dir: str | Path,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        tp: TPGroup | None = None,
        activation_bits: int = 32,
    ):
        # A step's tensors of megabytes are reused from the heap, not faulted in anew.
        keep_freed_memory()
        self.device = torch.device(device)
        self.dtype = dtype
        self.block_size = block_size
        self.tp_rank, self.tp_size = (tp.rank, tp.size) if tp is not None else (0, 1)
        self.model = load_model(model_dir, tp, max_model_len, dtype, self.device)
        if activation_bits != 32 and not self.model.round_activations(activation_bits):
            logger.info(
                "%s runs its matmuls on float32 input: rounding it to %d bits applies to "
                "GGUF weight blocks, which it has none of on this device (a model converted "
                "from a GGUF, on a CPU with AVX2, has them)",
                model_dir,
                activation_bits,
            )
        # Which share of the KV heads this rank holds, of how many: a handoff moves one
        # part per share (ranks replicating a head hold the same share).
        self.kv_rank, self.kv_size = (tp or TPGroup.single()).kv_shard(
            self.model.config.num_key_value_heads
        )
        self.num_blocks = num_blocks
        self.groups = KVCacheGroups.of(self.model.config)
        attn = self.model.attention_layers()[0]
        # One tensor [buffers, k/v, kv heads, slots, head dim]: a block holds one KV-cache
        # group's layers, layer j of each group binding [j, 0] and [j, 1] (kv_groups.py).
        # A handoff's blocks then leave or enter every layer in one indexed copy, not one
        # per layer and k/v (workers/kv/cache_copy.py). Zeros, not empty: masked-out
        # padding slots are still multiplied by a zero weight, and 0 * NaN from
        # uninitialised memory would poison it.
        self.kv_cache = torch.zeros(
            (
                self.groups.group_size,
                2,
                attn.num_kv_heads,
                num_blocks * block_size,
                attn.head_dim,
            ),
            dtype=dtype,
            device=self.device,
        )
        self.model.bind_kv_cache(
            [(*self.kv_cache[buffer], group) for group, buffer in self.groups.placement()]
        )
        # Steps of up to this many rows leave torch's ops on one thread (LLMEngine).
        self.small_step_rows = self.model.small_step_rows()

    @classmethod
    def from_spec(cls, spec: RunnerSpec, tp: TPGroup | None = None) -> ModelRunner:
        return cls(
            spec.model_dir,
            spec.num_blocks,
            spec.block_size,
            spec.max_model_len,
            spec.dtype,
            spec.device,
            tp,
            spec.activation_bits,
        )

    @torch.inference_mode()
    def execute(self, step: StepInput) -> StepOutput:
        """Runs the step; returns the sampling chunks' logits and the prompt logprobs
        the chunks ask for."""
        decodes = [i for i, c in enumerate(step.chunks) if len(c.token_ids) == 1]
        prefills = [i for i, c in enumerate(step.chunks) if len(c.token_ids) > 1]
        token_ids: list[int] = []
        positions: list[int] = []
        last_row: dict[int, int] = {}  # chunk index -> row of its last token
        first_row: dict[int, int] = {}  # and of its first
        for row, i in enumerate(decodes):
            c = step.chunks[i]
            token_ids.append(c.token_ids[0])
            positions.append(c.start_pos)
            first_row[i] = last_row[i] = row
        for i in prefills:
            c = step.chunks[i]
            start, n = len(token_ids), len(c.token_ids)
            token_ids.extend(c.token_ids)
            positions.extend(range(c.start_pos, c.start_pos + n))
            first_row[i], last_row[i] = start, start + n - 1
        decoding = [step.chunks[i] for i in decodes]
        # The decodes' positions and context lengths are every group's: made once.
        decode_pos = torch.tensor(positions[: len(decodes)], dtype=torch.long)
        lengths = decode_pos + 1
        device_lengths = lengths.to(self.device)
        meta = [
            self._metadata(
                group, decoding, decode_pos, lengths, device_lengths, step, prefills, first_row
            )
            for group in range(self.groups.num_groups)
        ]
        # The rows sampled from, each with its chunk: the last of a sampling chunk's (and
        # those of its drafts).
        sampled = [
            (row, step.chunks[i])
            for i, c in enumerate(step.chunks)
            if c.sample
            for row in range(last_row[i] - c.num_drafts, last_row[i] + 1)
        ]
        last_meta = None
        if len(sampled) < len(token_ids) and not any(c.prompt_targets for c in step.chunks):
            # The other rows matter only for their K/V: the last layer computes the
            # sampled rows alone (at least one row, for a step that samples none).
            last = max(last_row, key=last_row.get)  # the chunk of the step's last row
            selected = sampled or [(last_row[last], step.chunks[last])]
            last_meta = self._selecting(meta, selected, positions)
        hidden = self.model(
            torch.tensor(token_ids, device=self.device),
            torch.tensor(positions, device=self.device),
            meta,
            last_meta,
        )
        if last_meta is None:
            rows_t = torch.tensor([r for r, _ in sampled], dtype=torch.long, device=self.device)
            sampled_hidden = hidden[rows_t]
        else:
            sampled_hidden = hidden[: len(sampled)]
        # The sampler runs on the host with host generators, as for a TP group's logits.
        logits = self.model.compute_logits(sampled_hidden).float().cpu()
        prompt = {
            i: self._prompt_logprobs(hidden, first_row[i] + c.prompt_from, c)
            for i, c in enumerate(step.chunks)
            if c.prompt_targets
        }
        return StepOutput(logits, prompt)

    def _metadata(
        self,
        group: int,
        decodes: list[SeqChunk],
        decode_pos: torch.Tensor,
        lengths: torch.Tensor,
        device_lengths: torch.Tensor,
        step: StepInput,
        prefills: list[int],
        first_row: dict[int, int],
    ) -> AttentionMetadata:
        """KV-cache group `group`'s view of the step: the slots its tokens write, in the
        flat batch's order, and the block tables and contexts its layers read (the
        decodes' positions and context lengths `lengths`, on the host and the device,
        are shared by every group)."""
        slot_mapping: list[torch.Tensor] = []
        meta = AttentionMetadata(
            slot_mapping=torch.empty(0, dtype=torch.long), block_size=self.block_size
        )
        if decodes:
            tables = self._decode_tables(decodes, group, lengths)
            rows, pos, size = torch.arange(len(decodes)), decode_pos, self.block_size
            slot_mapping.append(tables[rows, pos // size] * size + pos % size)
            meta.num_decode = len(decodes)
            meta.decode_tables = tables.to(self.device)
            meta.decode_lengths = device_lengths
        for i in prefills:
            c = step.chunks[i]
            n = len(c.token_ids)
            slots = self._slots(c.block_tables[group], c.start_pos + n)
            slot_mapping.append(slots[c.start_pos :])
            context = slots.to(self.device) if c.start_pos else None
            meta.prefills.append(PrefillChunk(first_row[i], n, context))
        meta.slot_mapping = torch.cat(slot_mapping).to(self.device)
        return meta

    def _selecting(
        self,
        meta: list[AttentionMetadata],
        selected: list[tuple[int, SeqChunk]],
        positions: list[int],
    ) -> list[AttentionMetadata]:
        """Each group's metadata for a last layer that computes only the `selected` rows
        (row, its chunk): each row's context as a decoding query's, up to its position."""
        rows = torch.tensor([r for r, _ in selected], dtype=torch.long)
        lengths = torch.tensor([positions[r] + 1 for r, _ in selected], dtype=torch.long)
        device_lengths = lengths.to(self.device)
        chunks = [c for _, c in selected]
        contexts = [
            AttentionMetadata(
                slot_mapping=torch.empty(0, dtype=torch.long),
                block_size=self.block_size,
                num_decode=len(selected),
                decode_tables=self._decode_tables(chunks, group, lengths).to(self.device),
                decode_lengths=device_lengths,
            )
            for group in range(len(meta))
        ]
        rows = rows.to(self.device)
        return [m.select_rows(rows, c) for m, c in zip(meta, contexts, strict=True)]

    def _prompt_logprobs(self, hidden: torch.Tensor, first: int, c: SeqChunk) -> PromptLogprobRows:
        """The targets' logprobs and the top-n, `_PROMPT_ROWS` positions at a time: only
        that many vocabulary-wide rows are held at once, whatever the chunk's length."""
        targets = torch.tensor(c.prompt_targets, dtype=torch.long, device=self.device)
        parts = []
        for i in range(0, len(targets), _PROMPT_ROWS):
            j = min(i + _PROMPT_ROWS, len(targets))
            logprobs = self.model.compute_logits(hidden[first + i : first + j])
            logprobs = logprobs.float().log_softmax(dim=-1)
            top = logprobs.topk(c.prompt_top_n, dim=-1)  # n = 0: empty [m, 0] tensors
            chosen = logprobs.gather(1, targets[i:j].unsqueeze(1)).squeeze(1)
            ranks = (logprobs >= chosen.unsqueeze(1)).sum(dim=1)
            parts.append((chosen, top.indices, top.values, ranks))
        return PromptLogprobRows(*(torch.cat(t).cpu() for t in zip(*parts, strict=True)))

    def export_blocks(
        self,
        block_ids: list[int],
        start_block: int = 0,
        transport: str = "object_store",
        dst_tp: int | None = None,
    ) -> list[KVPart]:
        """This rank's slice of the blocks' K/V, ready to leave the process by `transport`
        (a list, like a TPWorkerGroup's one part per rank), cut for an importer of TP
        degree `dst_tp` if given (see workers/kv/transport.py, head_cuts)."""
        kv = cache_copy.export_blocks(self, block_ids, start_block)
        heads = kv.data.shape[2] * self.kv_size
        cuts = kv_transport.head_cuts(heads, self.kv_rank, self.kv_size, dst_tp)
        return [kv_transport.publish(kv, transport, cuts)]

    def live_exports(self) -> tuple[int, int]:
        """(objects, bytes) of this rank's direct-transport exports still referenced."""
        return kv_transport.live_exports()

    def prefetch(self, parts: list[KVPart]) -> list[KVPart]:
        """The export's parts held in this process (a transfer for KVRefs); thread-safe."""
        return list(kv_transport.fetch_all(parts, self.device))

    def release_prefetched(self, parts: list[KVPart]) -> None:
        """Nothing to release: prefetched parts live in the list `prefetch` returned."""

    def import_blocks(self, block_ids: list[int], parts: list[KVPart], rows: list[int]) -> None:
        """Writes this rank's KV heads of an export's blocks `rows` (every source rank's
        part, in rank order) into `block_ids`."""
        kv = kv_transport.materialize(parts, self.kv_rank, self.kv_size, rows, self.device)
        cache_copy.import_blocks(self, block_ids, kv)

    def _slots(self, block_table: list[int], num_tokens: int) -> torch.Tensor:
        """Cache slots of positions [0, num_tokens); those of blocks behind a sliding
        window (negative entries, none held) point into block 0 and are never read."""
        pos = torch.arange(num_tokens)
        blocks = torch.tensor(block_table, dtype=torch.long).clamp_(min=0)
        return blocks[pos // self.block_size] * self.block_size + pos % self.block_size

    def _decode_tables(
        self, decodes: list[SeqChunk], group: int, lengths: torch.Tensor
    ) -> torch.Tensor:
        """Group `group`'s block tables [B, max_blocks] for contexts of `lengths` (padded
        with block 0, as are the entries behind a sliding window)."""
        max_blocks = -(-int(lengths.max()) // self.block_size)
        tables = torch.zeros(len(decodes), max_blocks, dtype=torch.long)
        for row, c in enumerate(decodes):
            used = c.block_tables[group][:max_blocks]
            tables[row, : len(used)] = torch.tensor(used, dtype=torch.long)
        return tables.clamp_(min=0)
