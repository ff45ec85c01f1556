"""What the engine needs of a runner: one step, and the block copies of a KV handoff.

`ModelRunner` (in the engine's process) and `TPWorkerGroup` (one Ray actor per rank)
both are one; the engine holds either as a `Runner`.
"""

from __future__ import annotations

from typing import Protocol

from workers.kv.transport import KVPart
from workers.runner.step_io import StepInput, StepOutput


class Runner(Protocol):
    def execute(self, step: StepInput) -> StepOutput: ...

    def export_blocks(
        self, block_ids: list[int], start_block: int, transport: str, dst_tp: int | None
    ) -> list[KVPart]: ...

    def prefetch(self, parts: list[KVPart]) -> list[KVPart]:
        """Moves an export's data to where import_blocks reads it (callable from any
        thread); returns the parts to import."""
        ...

    def release_prefetched(self, parts: list[KVPart]) -> None:
        """Frees what prefetch moved, for an export that will not be imported."""
        ...

    def import_blocks(self, block_ids: list[int], parts: list[KVPart], rows: list[int]) -> None:
        """Writes the export's blocks `rows` (indices into it) into `block_ids`."""
        ...

    def live_exports(self) -> tuple[int, int]:
        """(objects, bytes) exported over a direct transport that importers still hold."""
        ...
