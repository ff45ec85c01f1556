/* The work team (work_team.c): the threads that run a small decode step's parallel
 * loops, in which a thread the OS takes away never holds the others up (included, not
 * compiled on its own). */
#ifndef BATON_WORK_TEAM_H
#define BATON_WORK_TEAM_H

#include <stdint.h>

/* Loops of at most team_rows() rows of x go to the calling thread's team (the
 * elementwise kernels' then run on that thread alone); larger ones take OpenMP. That is
 * TEAM_DEFAULT_ROWS, or up to TEAM_MAX_ROWS in a step whose torch ops run on one
 * thread (baton_set_team_rows): elsewhere torch's OpenMP workers spin between its ops
 * and starve the team's SCHED_IDLE helpers, which suits only the shortest loops. */
#define TEAM_DEFAULT_ROWS 8
#define TEAM_MAX_ROWS 64
int team_rows(void);
/* Sets the calling thread's team_rows() (clamped to [0, TEAM_MAX_ROWS]); returns the
 * one before. */
int baton_set_team_rows(int rows);
int baton_team_max_rows(void);

/* One parallel loop of `items` items. run(ctx, item, NULL) writes an item's outputs to
 * their destination; run(ctx, item, scratch) writes them to scratch (scratch_floats(ctx)
 * floats at most) and commit(ctx, item, scratch) copies them there. An item must read
 * nothing another item of the loop writes, so that running it twice gives the same
 * floats. ctx is copied (ctx_bytes <= TEAM_CTX_BYTES), and with it every pointer a run
 * reads: they must stay readable, if not meaningful, after the loop (team_arena). */
#define TEAM_CTX_BYTES 256
typedef struct {
  void (*run)(const void *ctx, int64_t item, float *scratch);
  void (*commit)(const void *ctx, int64_t item, const float *scratch);
  int64_t (*scratch_floats)(const void *ctx);
  int64_t items;
} TeamLoop;

/* Runs loop over num_threads threads (the caller one of them) and returns when every
 * item is done; 0, or -1 when a thread or scratch memory could not be had (nothing was
 * run then). */
int team_run(const TeamLoop *loop, const void *ctx, int64_t ctx_bytes, int num_threads);

/* Memory of the calling thread's team for a loop's inputs: `bytes` of it, 32-byte
 * aligned, valid until the caller's next team_arena call but one (two loops' inputs
 * live at once) and readable until the thread exits, so that a thread still running an
 * item another finished reads old floats, never unmapped memory. NULL when out of
 * memory. */
void *team_arena(int64_t bytes);

#endif
