"""CoreShare: the machine's cores split among the engines busy on it, through a table in
shared memory (here a file of the test's own, so nothing else on the machine counts)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from conftest import write_tiny_gguf
from engine_helpers import GREEDY, _engine

from workers.engine.core_share import _SLOT, NUM_SLOTS, CoreShare, machine_cores
from workers.model import kernels
from workers.model.gguf_import import convert_gguf
from workers.torch_threads import kernel_threads


@pytest.fixture
def table(tmp_path):
    return tmp_path / "cores"


def test_a_lone_busy_engine_takes_every_core_and_busy_ones_split_them(table):
    a, b = CoreShare(cores=4, path=table), CoreShare(cores=4, path=table)
    assert a.threads() == 4  # b is idle
    assert b.threads() == 2 and a.threads() == 2
    c = CoreShare(cores=4, path=table)
    assert c.threads() == 1  # 4 // 3, and never under one
    c.idle()
    b.idle()
    assert a.threads() == 4
    b.close()
    a.close()
    c.close()


def test_at_least_one_thread_however_many_are_busy(table):
    shares = [CoreShare(cores=2, path=table) for _ in range(5)]
    assert [s.threads() for s in shares][-1] == 1
    for s in shares:
        s.close()


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_dead_process_slot_counts_no_more_and_is_claimed_again(table):
    first = CoreShare(cores=2, path=table)
    first.threads()
    first_slot = first._slot
    # As a replica killed with -9 leaves it: its pid, busy.
    dead = _dead_pid()
    _SLOT.pack_into(first._table, first_slot * _SLOT.size, dead, 1)
    other = CoreShare(cores=2, path=table)
    assert other.threads() == 2
    assert other._slot == first_slot  # the dead one's
    other.close()


def test_closed_slots_are_free_again_and_past_a_full_table_an_engine_takes_one_thread(
    table, caplog
):
    shares = [CoreShare(cores=2, path=table) for _ in range(NUM_SLOTS)]
    with caplog.at_level("WARNING", logger="workers.engine.core_share"):
        alone = CoreShare(cores=2, path=table)
    assert "set the engines' thread counts instead of 'auto'" in caplog.text
    assert alone.threads() == 1
    alone.idle()
    alone.close()
    shares.pop().close()
    again = CoreShare(cores=2, path=table)
    again.close()
    again.close()  # once only
    del shares  # collected shares give their slots back too
    assert all(
        _SLOT.unpack_from(table.read_bytes(), i * _SLOT.size) == (0, 0) for i in range(NUM_SLOTS)
    )


def test_without_a_table_an_engine_takes_one_thread(tmp_path):
    share = CoreShare(cores=2, path=tmp_path / "missing" / "cores")
    assert share.threads() == 1
    share.close()


def test_machine_cores_are_what_this_process_may_run_on():
    assert 1 <= machine_cores() <= len(os.sched_getaffinity(0))


def test_an_auto_engine_is_busy_while_it_has_work_and_idle_after(model_dir):
    engine = _engine(model_dir, num_threads="auto")
    try:
        assert engine.cores is not None and not engine.cores._busy
        engine.add_request("r", [1, 2, 3], GREEDY)
        engine.step()  # the prompt's three tokens: the engine's share of the cores
        assert engine.cores._busy
        assert torch.get_num_threads() == engine.cores.threads()
        engine.step()  # one sequence's decode step: the share too
        assert torch.get_num_threads() == engine.cores.threads() == engine.cores.cores
        while engine.has_unfinished():
            engine.step()
        assert not engine.cores._busy
    finally:
        engine.shutdown()
    assert engine.cores._table.closed


@pytest.mark.skipif(kernels.library() is None, reason="needs Baton's CPU kernels")
def test_small_steps_run_torch_on_one_thread_and_the_kernels_on_the_share(tmp_path):
    """A model in GGUF blocks runs a step of up to 64 rows in Baton's kernels, on their
    work team; torch's ops then take one thread, so no OpenMP worker spins beside it.
    Both counts are the thread's own again after the step."""
    limit = kernels.team_max_rows()
    assert limit == 64
    write_tiny_gguf(tmp_path / "tiny.gguf", quantized=True)
    engine = _engine(convert_gguf(tmp_path / "tiny.gguf", tmp_path / "model"), num_threads=2)
    seen = []  # (the step's rows, torch's count, the kernels') during each model run
    execute = engine.runner.execute

    def recording(step):
        rows = sum(len(c.token_ids) for c in step.chunks)
        seen.append((rows, torch.get_num_threads(), kernel_threads()))
        return execute(step)

    engine.runner.execute = recording
    try:
        engine.add_request("r", list(range(1, limit + 13)), GREEDY)
        engine.step()  # the prompt's 76 tokens
        engine.step()  # one sequence's decode step
        engine.add_request("s", list(range(1, 21)), GREEDY)
        while engine.has_unfinished():
            engine.step()
        assert {rows <= limit for rows, _, _ in seen} == {True, False}
        assert all((t, k) == ((1 if rows <= limit else 2), 2) for rows, t, k in seen), seen
        assert torch.get_num_threads() == kernel_threads() == 2
    finally:
        engine.shutdown()
