"""The work team (csrc/work_team.c) on its own: a C program built from it runs loops whose
items the test controls, so that a helper can be made late on an item at will.

- every item of every loop is done once the lead returns, whatever the thread count;
- a helper late on an item is overtaken: the lead runs the item itself and returns, and
  the helper's result, arriving after, is dropped rather than written over a loop that
  has moved on;
- the team goes on serving loops after that;
- helpers run in SCHED_IDLE, so that a thread waking on a busy machine takes a helper's
  core rather than the lead's; the lead keeps its policy.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from workers.model import kernels

CSRC = Path(kernels.__file__).parent / "csrc"

pytestmark = pytest.mark.skipif(
    kernels.library() is None or shutil.which("cc") is None,
    reason="needs a C compiler and Baton's CPU kernels",
)

# Item i of loop k writes 1000 * k + i. A helper (run with scratch) writes the same
# value to its scratch, except on the late item of a late loop: it sleeps first, then
# writes -1, which must never reach the outputs.
HARNESS = r"""
#define _GNU_SOURCE
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include "work_team.h"

typedef struct { float *y; int loop; int late_item; } Ctx;
static _Atomic int helper_started_late_item;
static _Atomic int helper_items, helper_items_not_idle, lead_items_idle;

static void nap(long ms) {
  struct timespec t = {ms / 1000, (ms % 1000) * 1000000L};
  nanosleep(&t, NULL);
}

static void run(const void *c, int64_t i, float *scratch) {
  const Ctx *ctx = c;
  const float value = 1000.0f * ctx->loop + (float)i;
  const int idle = sched_getscheduler(0) == SCHED_IDLE;
  if (scratch == NULL) {
    atomic_fetch_add(&lead_items_idle, idle);
    /* The lead's first item waits, so that the helpers claim the others. */
    if (ctx->late_item >= 0 && i == 0) nap(20);
    ctx->y[i] = value;
    return;
  }
  atomic_fetch_add(&helper_items, 1);
  atomic_fetch_add(&helper_items_not_idle, !idle);
  if (i == ctx->late_item) {
    atomic_store(&helper_started_late_item, 1);
    nap(300);
    scratch[0] = -1.0f;
    return;
  }
  scratch[0] = value;
}
static void commit(const void *c, int64_t i, const float *scratch) {
  ((const Ctx *)c)->y[i] = scratch[0];
}
static int64_t scratch_floats(const void *c) { (void)c; return 1; }

static int check(const float *y, int loop, int items) {
  for (int i = 0; i < items; ++i)
    if (y[i] != 1000.0f * loop + (float)i) {
      printf("loop %d item %d: %g\n", loop, i, y[i]);
      return 1;
    }
  return 0;
}

int main(int argc, char **argv) {
  const int threads = atoi(argv[1]), items = 64;
  float y[64];
  const TeamLoop team = {run, commit, scratch_floats, items};
  /* Plain loops. */
  for (int loop = 1; loop <= 200; ++loop) {
    const Ctx ctx = {y, loop, -1};
    if (team_run(&team, &ctx, sizeof ctx, threads) != 0) return 2;
    if (check(y, loop, items)) return 1;
  }
  if (threads == 1) { printf("ok\n"); return 0; }
  /* A late helper: retried until a helper did start the late item (it claims items
   * while the lead's first one naps). */
  int loop = 1000;
  for (; loop < 1010 && !atomic_load(&helper_started_late_item); ++loop) {
    const Ctx ctx = {y, loop, items - 1};
    if (team_run(&team, &ctx, sizeof ctx, threads) != 0) return 2;
    if (check(y, loop, items)) return 1;
  }
  if (!atomic_load(&helper_started_late_item)) {
    printf("no helper took the late item\n");
    return 3;
  }
  printf("lead returned\n");
  /* More loops while the late helper sleeps and after it wakes. */
  for (int more = 0; more < 400; ++more, ++loop) {
    const Ctx ctx = {y, loop, -1};
    if (team_run(&team, &ctx, sizeof ctx, threads) != 0) return 2;
    if (check(y, loop, items)) return 1;
    if (more == 200) {
      nap(400); /* the late helper's commit comes, and must fail */
      if (check(y, loop, items)) return 1;
    }
  }
  if (check(y, loop - 1, items)) return 1;
  printf("helper items %d, not SCHED_IDLE %d; lead items in SCHED_IDLE %d\n",
         atomic_load(&helper_items), atomic_load(&helper_items_not_idle),
         atomic_load(&lead_items_idle));
  printf("ok\n");
  return 0;
}
"""


@pytest.fixture(scope="module")
def harness(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("team")
    (folder / "harness.c").write_text(HARNESS)
    binary = folder / "harness"
    subprocess.run(
        ["cc", "-O2", "-pthread", f"-I{CSRC}", "-o", str(binary),
         str(folder / "harness.c"), str(CSRC / "work_team.c")],
        check=True,
    )  # fmt: skip
    return binary


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_every_item_of_every_loop_is_done_when_the_lead_returns(harness, threads):
    out = subprocess.run([str(harness), str(threads)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip().endswith("ok")
    if threads > 1:
        assert "lead returned" in out.stdout


def test_helpers_run_in_sched_idle_and_the_lead_keeps_its_policy(harness):
    """A thread that wakes on a busy machine then preempts a helper, not the lead."""
    out = subprocess.run([str(harness), "2"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    counts = re.search(
        r"helper items (\d+), not SCHED_IDLE (\d+); lead items in SCHED_IDLE (\d+)", out.stdout
    )
    helper_items, not_idle, lead_idle = map(int, counts.groups())
    assert helper_items > 0 and not_idle == 0 and lead_idle == 0, out.stdout
