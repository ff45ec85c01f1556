/* The work team: threads for a small step's parallel loops (matmuls of up to
 * TEAM_MAX_ROWS rows, decode attention, a short chunk's prefill attention), in which a
 * thread the OS takes away never holds the step up.
 *
 * An OpenMP loop ends at a barrier: every thread of the team must arrive. A one-row
 * step runs about 150 such loops of 20-50 us each, and on a machine its serving
 * processes share, they preempt one of the step's threads about every token; the
 * other thread then spins at the barrier until it is back, and through the service a
 * two-thread step took 1.7x its in-process time. Here only the calling thread (the
 * lead) must finish a loop:
 * - The lead publishes the loop and runs items itself at once; helpers that are
 *   awake claim items too, and a sleeping helper joins when it wakes.
 * - A helper computes an item into scratch of its own, then commits it (copies it to
 *   its destination) only if it still owns it.
 * - When no item is left to claim, the lead takes over any item a helper has held
 *   for longer than one of the lead's own items took: it marks it taken, so the
 *   helper's commit fails, and runs it into the destination itself.
 * So a loop's outputs are each one thread's, computed once or twice but written once,
 * and the same floats whoever ran them.
 *
 * Helpers run in SCHED_IDLE, the lead in the policy it has. Linux places a waking
 * thread on a core that runs only SCHED_IDLE threads as on an idle one, and there it
 * preempts at once; so the serving threads each token wakes take a helper's core, whose
 * items the lead takes over, rather than the lead's, which alone advances the step.
 * Any other work on the machine (a prefill replica's step) gets the helper's core the
 * same way. Lowering a thread's own policy needs no privilege.
 *
 * Every item's state word carries the loop's sequence number, and a claim or commit is
 * a compare-and-swap on it, so a helper resuming an item of a loop long finished fails
 * and goes back to waiting. Helpers spin a little between loops (a step's loops come
 * back to back) and then sleep on a futex. Each calling thread has a team of its own
 * (thread-local: a TP rank's thread, the engine thread), its helpers stopped when it
 * exits.
 */
#define _GNU_SOURCE
#include "work_team.h"

#include <immintrin.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define MAX_HELPERS 63
#define MAX_ITEMS 4096
#define SPIN_NS 100000 /* a helper's wait for the next loop before it sleeps */
#define MIN_PATIENCE_NS 20000 /* for a helper's item when the lead ran none to time */

enum { CLAIMED = 1, TAKEN = 2, COMMITTING = 3, DONE = 4 };
static inline uint64_t word(uint64_t seq, uint64_t status) { return seq << 3 | status; }
static inline uint64_t seq_of(uint64_t w) { return w >> 3; }
static inline uint64_t status_of(uint64_t w) { return w & 7; }

typedef struct {
  TeamLoop loop;
  int helpers; /* helpers taking part: the first this many */
  _Alignas(8) unsigned char ctx[TEAM_CTX_BYTES];
} Published;

typedef struct Retired {
  struct Retired *next;
  void *memory;
} Retired;

typedef struct Team {
  _Atomic uint64_t seq;       /* the loop published last */
  _Atomic uint32_t wake;      /* bumped with seq; helpers sleep on it */
  _Atomic int sleepers;
  _Atomic int stop;
  _Atomic int64_t next;       /* the next item to claim of loop seq */
  Published published[2];     /* by seq's parity; a helper checks seq after copying */
  _Atomic uint64_t state[MAX_ITEMS];
  int num_helpers;
  pthread_t threads[MAX_HELPERS];
  void *arena[2];
  int64_t arena_bytes[2];
  int arena_turn;
  Retired *retired; /* grown-out arenas, freed with the team */
} Team;

typedef struct {
  Team *team;
  int index;
} HelperArgs;

static int64_t now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static void futex_wait(_Atomic uint32_t *addr, uint32_t expected) {
  syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAIT_PRIVATE, expected, NULL, NULL, 0);
}

static void futex_wake_all(_Atomic uint32_t *addr) {
  syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAKE_PRIVATE, MAX_HELPERS, NULL, NULL, 0);
}

/* Claims item i for loop seq from whatever older state it holds; false when another
 * thread claimed it for seq first. */
static int claim(Team *t, int64_t i, uint64_t seq, uint64_t status) {
  uint64_t w = atomic_load(&t->state[i]);
  while (seq_of(w) < seq)
    if (atomic_compare_exchange_weak(&t->state[i], &w, word(seq, status))) return 1;
  return 0;
}

/* A helper's part in loop seq: claim, compute into scratch, commit if still owned. */
static void help(Team *t, const Published *p, uint64_t seq, float **scratch,
                 int64_t *scratch_floats) {
  const int64_t need = p->loop.scratch_floats(p->ctx);
  if (need > *scratch_floats) {
    float *grown = realloc(*scratch, sizeof(float) * (size_t)need);
    if (grown == NULL) return; /* the lead runs every item then */
    *scratch = grown;
    *scratch_floats = need;
  }
  for (;;) {
    if (atomic_load(&t->seq) != seq) return;
    const int64_t i = atomic_fetch_add(&t->next, 1);
    if (i >= p->loop.items) return;
    if (!claim(t, i, seq, CLAIMED)) continue;
    p->loop.run(p->ctx, i, *scratch);
    uint64_t expected = word(seq, CLAIMED);
    if (!atomic_compare_exchange_strong(&t->state[i], &expected, word(seq, COMMITTING)))
      continue; /* the lead took it over */
    p->loop.commit(p->ctx, i, *scratch);
    atomic_store(&t->state[i], word(seq, DONE));
  }
}

static void *helper_main(void *arg) {
  HelperArgs args = *(HelperArgs *)arg;
  free(arg);
  const struct sched_param no_priority = {0};
  sched_setscheduler(0, SCHED_IDLE, &no_priority); /* this thread; best effort */
  Team *t = args.team;
  float *scratch = NULL;
  int64_t scratch_floats = 0;
  uint64_t seen = atomic_load(&t->seq);
  while (!atomic_load(&t->stop)) {
    const uint32_t wake = atomic_load(&t->wake);
    const uint64_t seq = atomic_load(&t->seq);
    if (seq != seen) {
      seen = seq;
      Published p;
      memcpy(&p, &t->published[seq & 1], sizeof p);
      if (atomic_load(&t->seq) != seq) continue; /* overwritten while copied */
      if (args.index < p.helpers) help(t, &p, seq, &scratch, &scratch_floats);
      continue;
    }
    const int64_t until = now_ns() + SPIN_NS;
    while (atomic_load(&t->seq) == seen && !atomic_load(&t->stop) && now_ns() < until)
      _mm_pause();
    if (atomic_load(&t->seq) != seen) continue;
    atomic_fetch_add(&t->sleepers, 1);
    if (atomic_load(&t->wake) == wake && atomic_load(&t->seq) == seen && !atomic_load(&t->stop))
      futex_wait(&t->wake, wake);
    atomic_fetch_sub(&t->sleepers, 1);
  }
  free(scratch);
  return NULL;
}

static pthread_key_t team_key;
static pthread_once_t team_key_once = PTHREAD_ONCE_INIT;
static __thread Team *thread_team;

static void team_free(void *arg) {
  Team *t = arg;
  atomic_store(&t->stop, 1);
  atomic_fetch_add(&t->wake, 1);
  futex_wake_all(&t->wake);
  for (int h = 0; h < t->num_helpers; ++h) pthread_join(t->threads[h], NULL);
  for (Retired *r = t->retired; r != NULL;) {
    Retired *next = r->next;
    free(r->memory);
    free(r);
    r = next;
  }
  free(t->arena[0]);
  free(t->arena[1]);
  free(t);
}

static void make_key(void) { pthread_key_create(&team_key, team_free); }

/* The calling thread's team with at least `helpers` helpers; NULL when a thread could
 * not be started. */
static Team *team_for(int helpers) {
  if (thread_team == NULL) {
    pthread_once(&team_key_once, make_key);
    Team *t = calloc(1, sizeof(Team));
    if (t == NULL) return NULL;
    if (pthread_setspecific(team_key, t) != 0) {
      free(t);
      return NULL;
    }
    thread_team = t;
  }
  Team *t = thread_team;
  if (helpers > MAX_HELPERS) helpers = MAX_HELPERS;
  while (t->num_helpers < helpers) {
    HelperArgs *args = malloc(sizeof(HelperArgs));
    if (args == NULL) return NULL;
    args->team = t;
    args->index = t->num_helpers;
    if (pthread_create(&t->threads[t->num_helpers], NULL, helper_main, args) != 0) {
      free(args);
      return NULL;
    }
    t->num_helpers++;
  }
  return t;
}

void *team_arena(int64_t bytes) {
  Team *t = team_for(0);
  if (t == NULL) return NULL;
  const int turn = t->arena_turn;
  t->arena_turn ^= 1;
  if (bytes > t->arena_bytes[turn]) {
    const int64_t size = (bytes + 4095) / 4096 * 4096 * 2;
    void *grown = aligned_alloc(32, (size_t)size);
    Retired *r = malloc(sizeof(Retired));
    if (grown == NULL || r == NULL) {
      free(grown);
      free(r);
      return NULL;
    }
    /* A helper may still read the old one: it stays mapped until the team goes. */
    r->memory = t->arena[turn];
    r->next = t->retired;
    t->retired = r;
    t->arena[turn] = grown;
    t->arena_bytes[turn] = size;
  }
  return t->arena[turn];
}

int team_run(const TeamLoop *loop, const void *ctx, int64_t ctx_bytes, int num_threads) {
  if (ctx_bytes > TEAM_CTX_BYTES || loop->items > MAX_ITEMS) return -1;
  Team *t = team_for(num_threads - 1);
  if (t == NULL) return -1;
  const uint64_t seq = atomic_load(&t->seq) + 1;
  Published *p = &t->published[seq & 1];
  p->loop = *loop;
  p->helpers = num_threads - 1;
  memcpy(p->ctx, ctx, (size_t)ctx_bytes);
  atomic_store(&t->next, 0);
  atomic_store(&t->seq, seq);
  atomic_fetch_add(&t->wake, 1);
  if (atomic_load(&t->sleepers) > 0) futex_wake_all(&t->wake);

  /* The lead's own items, timed: a helper holding one longer than that is late. */
  int64_t ran = 0, spent = 0;
  for (;;) {
    const int64_t i = atomic_fetch_add(&t->next, 1);
    if (i >= loop->items) break;
    if (!claim(t, i, seq, TAKEN)) continue;
    const int64_t start = now_ns();
    loop->run(p->ctx, i, NULL);
    spent += now_ns() - start;
    ran++;
    atomic_store(&t->state[i], word(seq, DONE));
  }
  const int64_t patience = ran > 0 ? spent / ran : MIN_PATIENCE_NS;
  /* Every item done, or taken over. */
  for (int64_t i = 0; i < loop->items; ++i) {
    const int64_t since = now_ns();
    for (;;) {
      uint64_t w = atomic_load(&t->state[i]);
      if (w == word(seq, DONE)) break;
      const uint64_t status = status_of(w);
      /* Unclaimed (its claim lost to a helper's stale count) or late: take it over. */
      const int take = seq_of(w) < seq || (status == CLAIMED && now_ns() - since >= patience);
      if (take && atomic_compare_exchange_strong(&t->state[i], &w, word(seq, TAKEN))) {
        loop->run(p->ctx, i, NULL);
        atomic_store(&t->state[i], word(seq, DONE));
        break;
      }
      _mm_pause();
    }
  }
  return 0;
}

static __thread int thread_team_rows = TEAM_DEFAULT_ROWS;

int team_rows(void) { return thread_team_rows; }

int baton_set_team_rows(int rows) {
  const int before = thread_team_rows;
  thread_team_rows = rows < 0 ? 0 : rows > TEAM_MAX_ROWS ? TEAM_MAX_ROWS : rows;
  return before;
}

/* TEAM_MAX_ROWS, for the Python side (kernels.py). */
int baton_team_max_rows(void) { return TEAM_MAX_ROWS; }
