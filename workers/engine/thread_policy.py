"""Serving threads yield the CPU to the threads that step an engine.

On a machine an engine shares with its serving path (its replica's Ray and Serve threads,
the router, the ingress), every token wakes several serving threads. Linux puts a woken
thread on the core of the thread that woke it and lets it preempt the one running there,
so an engine thread decoding one sequence was preempted about six times a token and
waited behind those threads with its caches cooling. A thread of the SCHED_BATCH policy
never preempts on waking: it runs on an idle core, or when the running thread's time
slice ends, and gets the same share of CPU time (its nice value is unchanged). So a
serving process puts all its threads in SCHED_BATCH (`yield_to_engine_threads`) before
it builds an engine, and the engine's thread puts itself back (`run_as_engine_thread`).
A thread inherits its creator's policy, so the OpenMP workers an engine thread starts
are normal too, and the threads Ray starts later are batch.

Moving between the two policies needs no privilege. Where the OS has no SCHED_BATCH
(not Linux) both do nothing.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

_TASKS = "/proc/self/task"


def yield_to_engine_threads() -> int:
    """Puts every thread of this process in SCHED_BATCH; returns how many it moved."""
    if not hasattr(os, "SCHED_BATCH") or not os.path.isdir(_TASKS):
        return 0
    moved = 0
    for tid in os.listdir(_TASKS):
        try:
            os.sched_setscheduler(int(tid), os.SCHED_BATCH, os.sched_param(0))
            moved += 1
        except OSError as e:  # a thread that ended meanwhile, or a policy refused
            logger.debug("thread %s stays in its scheduling policy: %s", tid, e)
    return moved


def run_as_engine_thread() -> None:
    """Puts the calling thread in SCHED_OTHER: batch threads waking on its core wait for
    it rather than preempt it."""
    if not hasattr(os, "SCHED_OTHER"):
        return
    try:
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    except OSError as e:
        logger.warning("the engine thread keeps its scheduling policy: %s", e)
