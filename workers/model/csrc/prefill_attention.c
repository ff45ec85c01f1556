/* Causal attention of a prefill chunk over its context, read from the paged cache.
 *
 * The chunk's n queries sit at context positions ctx - n .. ctx - 1 (after a cached
 * prefix of ctx - n tokens, or at the start: ctx == n); query i sees keys 0 .. ctx - n
 * + i. Keys and values come straight from the cache ([Hkv, num_slots, D] each) through
 * the context's slots, which the step has already written the chunk's own K/V into.
 *
 * One task is a KV head and a block of up to BQ query tokens: the group of query heads
 * that share the KV head, BQ * group rows, meet each block of BK keys once. A short
 * chunk (a prompt's tail after a cached prefix) takes smaller blocks, down to 16
 * tokens, so that each thread has two tasks to balance: no more, as every task copies
 * its whole context's keys and values, which for a short chunk after a long prefix
 * costs about what its products do. The keys of a block are
 * copied transposed (Kt [D][BK]) and its values in rows, so that scores are rows of
 * x Kt and the output rows of P x V, both broadcast-and-multiply-add loops over vectors
 * of 8 floats, two rows at a time (of 16, four rows, where AVX-512 runs: each key or
 * value vector loaded then serves four rows). The softmax runs online (flash
 * attention's): each row keeps its running maximum, sum and unnormalized output,
 * rescaled as a block raises the maximum, and divided by the sum at the end. Key blocks
 * wholly after a task's last query are never visited, so a fresh chunk does about half
 * a full product's work; torch's CPU kernel took the whole 512 x 512 square of a
 * 512-token prompt and masked half of it.
 *
 * Tasks run on OpenMP (a prefill is large), the longest (last) first, dynamically, so a
 * thread the OS takes away leaves its tasks to the other. A chunk of up to team_rows()
 * queries (in a step the work team runs: a short prompt, a prompt's tail after a cached
 * prefix) runs them as a work-team loop instead (work_team.h), as the step's other
 * loops then do. Each output row is one task's, so the floats do not depend on the
 * split.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"
#include "work_team.h"

#define BQ 64       /* query tokens per task at most: each copied key block serves them all */
#define BK 32       /* keys per block: four AVX2 vectors of scores a row, or two AVX-512 */
#define MAX_D 256   /* head dims up to this, multiples of 8 */
#define MAX_GROUP 16

/* Per-thread buffers of a task. */
typedef struct {
  float kt[MAX_D * BK];  /* the key block, transposed */
  float vb[BK * MAX_D];  /* the value block, in rows */
} Blocks;

/* s[r][0:BK] = (rows r, r + 1 of q) . Kt for the row pair at q0, q1 (D floats each). */
static inline void score_pair(const float *q0, const float *q1, const float *kt, int D,
                              float *s0, float *s1) {
  __m256 a[2][4];
  for (int v = 0; v < 4; ++v) a[0][v] = a[1][v] = _mm256_setzero_ps();
  for (int d = 0; d < D; ++d) {
    const __m256 b0 = _mm256_broadcast_ss(q0 + d), b1 = _mm256_broadcast_ss(q1 + d);
    for (int v = 0; v < 4; ++v) {
      const __m256 k = _mm256_loadu_ps(kt + d * BK + 8 * v);
      a[0][v] = _mm256_fmadd_ps(b0, k, a[0][v]);
      a[1][v] = _mm256_fmadd_ps(b1, k, a[1][v]);
    }
  }
  for (int v = 0; v < 4; ++v) {
    _mm256_storeu_ps(s0 + 8 * v, a[0][v]);
    _mm256_storeu_ps(s1 + 8 * v, a[1][v]);
  }
}

/* One row's scores s[0:BK] (raw products) into probabilities against its running
 * maximum *m and sum *l: keys past `last` (the row's last visible key, block-relative)
 * get none. Returns the factor the row's output so far must be scaled by. */
static inline float softmax_block(float *s, int last, float scale, float *m, float *l) {
  if (last < 0) { /* nothing visible in this block */
    memset(s, 0, sizeof(float) * BK);
    return 1.0f;
  }
  const __m256 sc = _mm256_set1_ps(scale), ninf = _mm256_set1_ps(-INFINITY);
  const __m256i lim = _mm256_set1_epi32(last);
  __m256 v[4], mx = ninf;
  for (int i = 0; i < 4; ++i) {
    const __m256i idx = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                         _mm256_set1_epi32(8 * i));
    const __m256 hidden = _mm256_castsi256_ps(_mm256_cmpgt_epi32(idx, lim));
    v[i] = _mm256_blendv_ps(_mm256_mul_ps(_mm256_loadu_ps(s + 8 * i), sc), ninf, hidden);
    mx = _mm256_max_ps(mx, v[i]);
  }
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  const float block_max = _mm_cvtss_f32(h);
  const float m_new = block_max > *m ? block_max : *m;
  const __m256 mv = _mm256_set1_ps(m_new);
  __m256 sum = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    /* exp256 of -inf minus a finite maximum clamps to about 1e-38, not 0: mask it. */
    const __m256 p = _mm256_and_ps(exp256(_mm256_sub_ps(v[i], mv)),
                                   _mm256_cmp_ps(v[i], ninf, _CMP_NEQ_OQ));
    _mm256_storeu_ps(s + 8 * i, p);
    sum = _mm256_add_ps(sum, p);
  }
  const float alpha = *m == -INFINITY ? 0.0f : expf(*m - m_new);
  *l = *l * alpha + hsum(sum);
  *m = m_new;
  return alpha;
}

/* o[r] = o[r] * alpha[r] + p[r] x vb for the row pair (D floats of o each), 32 output
 * columns at a time so that each value load serves both rows. */
static inline void accumulate_pair(float *o0, float *o1, const float *p0, const float *p1,
                                   float alpha0, float alpha1, const float *vb, int D) {
  for (int c = 0; c < D; c += 32) {
    const int nv = D - c < 32 ? (D - c) / 8 : 4;
    __m256 a[2][4];
    const __m256 s0 = _mm256_set1_ps(alpha0), s1 = _mm256_set1_ps(alpha1);
    for (int v = 0; v < nv; ++v) {
      a[0][v] = _mm256_mul_ps(_mm256_loadu_ps(o0 + c + 8 * v), s0);
      a[1][v] = _mm256_mul_ps(_mm256_loadu_ps(o1 + c + 8 * v), s1);
    }
    for (int j = 0; j < BK; ++j) {
      const __m256 b0 = _mm256_broadcast_ss(p0 + j), b1 = _mm256_broadcast_ss(p1 + j);
      for (int v = 0; v < nv; ++v) {
        const __m256 x = _mm256_loadu_ps(vb + j * D + c + 8 * v);
        a[0][v] = _mm256_fmadd_ps(b0, x, a[0][v]);
        a[1][v] = _mm256_fmadd_ps(b1, x, a[1][v]);
      }
    }
    for (int v = 0; v < nv; ++v) {
      _mm256_storeu_ps(o0 + c + 8 * v, a[0][v]);
      _mm256_storeu_ps(o1 + c + 8 * v, a[1][v]);
    }
  }
}

/* The AVX-512 form (where avx512_usable, vector_width.c, and D is a multiple of 16):
 * four rows at a time, so each key or value vector loaded serves four rows, and the
 * softmax on two vectors of 16 scores a row. */
#define AVX512 __attribute__((target("avx512f,avx512dq")))
#define QUAD 4

/* softmax_block on 16-float vectors. A block wholly visible needs no mask, and one that
 * does not raise the maximum leaves the output's scale as it is (exp(0) is 1). */
static AVX512 float softmax_block512(float *restrict s, int last, float scale, float *restrict m,
                                     float *restrict l) {
  if (last < 0) {
    memset(s, 0, sizeof(float) * BK);
    return 1.0f;
  }
  const __m512 sc = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-INFINITY);
  __mmask16 seen[2] = {0xffff, 0xffff};
  if (last < BK - 1) {
    const __m512i lim = _mm512_set1_epi32(last);
    const __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    seen[0] = _mm512_cmple_epi32_mask(idx, lim);
    seen[1] = _mm512_cmple_epi32_mask(_mm512_add_epi32(idx, _mm512_set1_epi32(16)), lim);
  }
  __m512 v[2];
  for (int i = 0; i < 2; ++i)
    v[i] = _mm512_mask_mul_ps(ninf, seen[i], _mm512_loadu_ps(s + 16 * i), sc);
  const float block_max = _mm512_reduce_max_ps(_mm512_max_ps(v[0], v[1]));
  float alpha = 1.0f;
  if (block_max > *m) {
    alpha = *m == -INFINITY ? 0.0f : expf(*m - block_max);
    *m = block_max;
  }
  const __m512 mv = _mm512_set1_ps(*m);
  __m512 sum = _mm512_setzero_ps();
  for (int i = 0; i < 2; ++i) {
    const __m512 p = _mm512_maskz_mov_ps(seen[i], exp512(_mm512_sub_ps(v[i], mv)));
    _mm512_storeu_ps(s + 16 * i, p);
    sum = _mm512_add_ps(sum, p);
  }
  *l = *l * alpha + _mm512_reduce_add_ps(sum);
  return alpha;
}

/* s[i][0:BK] = q[i] . Kt for four rows (D floats each); s holds QUAD rows of BK. */
static AVX512 void score_quad512(const float *const q[QUAD], const float *kt, int D, float *s) {
  __m512 a[QUAD][2];
  for (int i = 0; i < QUAD; ++i) a[i][0] = a[i][1] = _mm512_setzero_ps();
  for (int d = 0; d < D; ++d) {
    const __m512 k0 = _mm512_loadu_ps(kt + d * BK), k1 = _mm512_loadu_ps(kt + d * BK + 16);
    for (int i = 0; i < QUAD; ++i) {
      const __m512 b = _mm512_set1_ps(q[i][d]);
      a[i][0] = _mm512_fmadd_ps(b, k0, a[i][0]);
      a[i][1] = _mm512_fmadd_ps(b, k1, a[i][1]);
    }
  }
  for (int i = 0; i < QUAD; ++i) {
    _mm512_storeu_ps(s + i * BK, a[i][0]);
    _mm512_storeu_ps(s + i * BK + 16, a[i][1]);
  }
}

/* Columns [c, c + 16 * NV) of o[i] = o[i] * alpha[i] + p[i] x vb for four rows (rows
 * of o D floats apart, of p BK). */
static inline AVX512 __attribute__((always_inline)) void accumulate_cols512(
    float *o, const float *p, const float alpha[QUAD], const float *vb, int D, int c, int NV) {
  __m512 a[QUAD][4];
  for (int i = 0; i < QUAD; ++i) {
    const __m512 sc = _mm512_set1_ps(alpha[i]);
    for (int v = 0; v < NV; ++v)
      a[i][v] = _mm512_mul_ps(_mm512_loadu_ps(o + i * D + c + 16 * v), sc);
  }
  for (int j = 0; j < BK; ++j) {
    __m512 x[4];
    for (int v = 0; v < NV; ++v) x[v] = _mm512_loadu_ps(vb + j * D + c + 16 * v);
    for (int i = 0; i < QUAD; ++i) {
      const __m512 b = _mm512_set1_ps(p[i * BK + j]);
      for (int v = 0; v < NV; ++v) a[i][v] = _mm512_fmadd_ps(b, x[v], a[i][v]);
    }
  }
  for (int i = 0; i < QUAD; ++i)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(o + i * D + c + 16 * v, a[i][v]);
}

static AVX512 void accumulate_quad512(float *o, const float *p, const float alpha[QUAD],
                                      const float *vb, int D) {
  int c = 0;
  for (; c + 64 <= D; c += 64) accumulate_cols512(o, p, alpha, vb, D, c, 4);
  switch ((D - c) / 16) { /* the last 16, 32 or 48 columns */
    case 3: accumulate_cols512(o, p, alpha, vb, D, c, 3); break;
    case 2: accumulate_cols512(o, p, alpha, vb, D, c, 2); break;
    case 1: accumulate_cols512(o, p, alpha, vb, D, c, 1); break;
  }
}

/* One task: KV head h, query tokens [t0, t1). Rows are (token, head of the group). */
static inline __attribute__((always_inline)) void task(
    int wide, const float *q, int64_t q_stride, int64_t n, const float *k_cache,
    const float *v_cache, int64_t num_slots, const int64_t *slots, int64_t ctx, int Hq, int Hkv,
    int D, float scale, float *out, int h, int64_t t0, int64_t t1, Blocks *blk, float *o,
    float *s, float *m, float *l) {
  const int G = Hq / Hkv;
  const int64_t rows = (t1 - t0) * G;
  const int64_t offset = ctx - n; /* query i's position is offset + i */
  for (int64_t r = 0; r < rows + QUAD - 1; ++r) { /* the spare rows too */
    m[r] = -INFINITY;
    l[r] = 0.0f;
  }
  memset(o, 0, sizeof(float) * (size_t)((rows + QUAD - 1) * D));
  const float *kh = k_cache + (int64_t)h * num_slots * D;
  const float *vh = v_cache + (int64_t)h * num_slots * D;
  const int64_t keys = offset + t1; /* the last query sees keys [0, keys) */
  for (int64_t k0 = 0; k0 < keys; k0 += BK) {
    const int kn = keys - k0 < BK ? (int)(keys - k0) : BK;
    for (int j = 0; j < BK; ++j) {
      if (j < kn) {
        /* The caller checked every slot; a work-team helper late on a finished loop may
         * read its copy after the lead's next loop overwrote it: its floats are then
         * dropped, but its reads must stay inside the cache. */
        int64_t slot = slots[k0 + j];
        if (slot < 0 || slot >= num_slots) slot = 0;
        const float *key = kh + slot * D;
        for (int d = 0; d < D; ++d) blk->kt[d * BK + j] = key[d];
        memcpy(blk->vb + j * D, vh + slot * D, sizeof(float) * (size_t)D);
      } else { /* past the context: zero keys, masked below, and zero values */
        for (int d = 0; d < D; ++d) blk->kt[d * BK + j] = 0.0f;
        memset(blk->vb + j * D, 0, sizeof(float) * (size_t)D);
      }
    }
    if (wide)
      for (int64_t r = 0; r < rows; r += QUAD) {
        /* A partial last group is padded with copies of the task's last row, computed
         * into the buffers' spare rows and never read. */
        const float *qs[QUAD];
        int64_t last[QUAD];
        float alpha[QUAD];
        for (int i = 0; i < QUAD; ++i) {
          const int64_t row = r + i < rows ? r + i : rows - 1;
          last[i] = offset + t0 + row / G - k0;
          qs[i] = q + (t0 + row / G) * q_stride + (h * G + row % G) * D;
        }
        if (last[QUAD - 1] < 0) continue; /* the block is past every row's position */
        score_quad512(qs, blk->kt, D, s);
        for (int i = 0; i < QUAD; ++i) {
          const int c = last[i] < kn - 1 ? (int)last[i] : kn - 1;
          alpha[i] = softmax_block512(s + i * BK, c, scale, m + r + i, l + r + i);
        }
        accumulate_quad512(o + r * D, s, alpha, blk->vb, D);
      }
    else
      for (int64_t r = 0; r < rows; r += 2) {
        /* An odd last row pairs with a copy of itself in the buffers' spare row. */
        const int64_t r1 = r + 1, t1_row = r1 < rows ? r1 : r;
        const int64_t last0 = offset + t0 + r / G - k0, last1 = offset + t0 + t1_row / G - k0;
        if (last1 < 0) continue; /* the block is past both rows' positions */
        const float *q0 = q + (t0 + r / G) * q_stride + (h * G + r % G) * D;
        const float *q1 = q + (t0 + t1_row / G) * q_stride + (h * G + t1_row % G) * D;
        float *s0 = s, *s1 = s + BK;
        score_pair(q0, q1, blk->kt, D, s0, s1);
        const int c0 = last0 < kn - 1 ? (int)last0 : kn - 1;
        const int c1 = last1 < kn - 1 ? (int)last1 : kn - 1;
        const float a0 = softmax_block(s0, c0, scale, m + r, l + r);
        const float a1 = softmax_block(s1, c1, scale, m + r1, l + r1);
        accumulate_pair(o + r * D, o + r1 * D, s0, s1, a0, a1, blk->vb, D);
      }
  }
  for (int64_t r = 0; r < rows; ++r) {
    float *dst = out + ((t0 + r / G) * Hq + h * G + r % G) * D;
    const float inv = 1.0f / l[r];
    for (int d = 0; d < D; ++d) dst[d] = o[r * D + d] * inv;
  }
}

#define TASK_ARGS                                                                         \
  const float *q, int64_t q_stride, int64_t n, const float *k_cache, const float *v_cache, \
      int64_t num_slots, const int64_t *slots, int64_t ctx, int Hq, int Hkv, int D,         \
      float scale, float *out, int h, int64_t t0, int64_t t1, Blocks *blk, float *o,        \
      float *s, float *m, float *l
#define TASK_CALL(WIDE) \
  task(WIDE, q, q_stride, n, k_cache, v_cache, num_slots, slots, ctx, Hq, Hkv, D, scale, out, \
       h, t0, t1, blk, o, s, m, l)
static void task_avx2(TASK_ARGS) { TASK_CALL(0); }
static AVX512 void task_avx512(TASK_ARGS) { TASK_CALL(1); }

/* A call's arguments, and its lead's buffers on the work team. */
typedef struct {
  const float *q, *k_cache, *v_cache;
  const int64_t *slots;
  float *out, *lead_work;
  int64_t q_stride, n, num_slots, ctx, bq, blocks;
  int Hq, Hkv, D, wide;
  float scale;
} Prefill;

/* Rows of o, m and l a task of bq queries takes, with the spare ones a last pair or
 * group of four takes. */
static int64_t task_rows(int64_t bq, int G) { return bq * G + QUAD - 1; }

/* Task i's query tokens [t0, t1): the last queries, with the most keys, first. */
static void task_tokens(const Prefill *a, int64_t i, int64_t *t0, int64_t *t1) {
  *t0 = (a->blocks - 1 - i / a->Hkv) * a->bq;
  *t1 = *t0 + a->bq < a->n ? *t0 + a->bq : a->n;
}

/* Task i into out, with the key and value blocks at blk and o, m, l and s (a group's
 * rows of scores) from o. */
static void run_task(const Prefill *a, int64_t i, float *out, Blocks *blk, float *o,
                     int64_t rows) {
  int64_t t0, t1;
  task_tokens(a, i, &t0, &t1);
  float *m = o + rows * a->D, *l = m + rows, *s = l + rows;
  (a->wide ? task_avx512 : task_avx2)(a->q, a->q_stride, a->n, a->k_cache, a->v_cache,
                                      a->num_slots, a->slots, a->ctx, a->Hq, a->Hkv, a->D,
                                      a->scale, out, (int)(i % a->Hkv), t0, t1, blk, o, s, m, l);
}

/* Floats of a task's buffers, with room to align them to 64 bytes. */
static int64_t work_floats(const Prefill *a) {
  return (int64_t)(sizeof(Blocks) / sizeof(float)) +
         task_rows(a->bq, a->Hq / a->Hkv) * (a->D + 2) + QUAD * BK + 16;
}

static void run_in(const Prefill *a, int64_t i, float *out, float *work) {
  Blocks *blk = (Blocks *)(((uintptr_t)work + 63) & ~(uintptr_t)63);
  run_task(a, i, out, blk, (float *)(blk + 1), task_rows(a->bq, a->Hq / a->Hkv));
}

/* On the work team a helper writes a task's rows at their places in a copy of out at
 * the head of its scratch (its buffers after it), and commits those rows. */
static void team_task(const void *ctx, int64_t i, float *scratch) {
  const Prefill *a = ctx;
  if (scratch == NULL)
    run_in(a, i, a->out, a->lead_work);
  else
    run_in(a, i, scratch, scratch + a->n * a->Hq * a->D);
}

static void team_commit(const void *ctx, int64_t i, const float *scratch) {
  const Prefill *a = ctx;
  const int G = a->Hq / a->Hkv, h = (int)(i % a->Hkv);
  int64_t t0, t1;
  task_tokens(a, i, &t0, &t1);
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t at = (t * a->Hq + h * G) * a->D;
    memcpy(a->out + at, scratch + at, sizeof(float) * (size_t)(G * a->D));
  }
}

static int64_t team_scratch(const void *ctx) {
  const Prefill *a = ctx;
  return a->n * a->Hq * a->D + work_floats(a);
}

/* The call on the work team; -1 when its memory could not be had (nothing ran). */
static int run_on_team(Prefill a, int64_t tasks, int num_threads) {
  /* q's rows and the slots in the team's arena, as a helper late on a task reads them,
   * then the lead's buffers. */
  const int64_t q_floats = (a.n - 1) * a.q_stride + a.Hq * a.D;
  const int64_t q_room = (q_floats + 1) / 2 * 2; /* the slots after it 8-byte aligned */
  float *arena = team_arena(sizeof(float) * (size_t)(q_room + work_floats(&a)) +
                            sizeof(int64_t) * (size_t)a.ctx);
  if (arena == NULL) return -1;
  memcpy(arena, a.q, sizeof(float) * (size_t)q_floats);
  int64_t *slots = (int64_t *)(arena + q_room);
  memcpy(slots, a.slots, sizeof(int64_t) * (size_t)a.ctx);
  a.q = arena;
  a.slots = slots;
  a.lead_work = (float *)(slots + a.ctx);
  const TeamLoop team = {team_task, team_commit, team_scratch, tasks};
  if (team_run(&team, &a, sizeof a, num_threads) == 0) return 0;
  for (int64_t i = 0; i < tasks; ++i) team_task(&a, i, NULL);
  return 0;
}

/* out [n, Hq, D] (contiguous) = attention of q (token t, head i at q + t * q_stride +
 * i * D) over the context's ctx slots, the chunk's n queries its last. Returns 0, -1
 * when scratch memory ran out, -2 for a shape the kernel does not take. */
int baton_prefill_attention(const float *q, int64_t q_stride, int64_t n, const float *k_cache,
                            const float *v_cache, int64_t num_slots, const int64_t *slots,
                            int64_t ctx, int Hq, int Hkv, int D, float scale, float *out,
                            int num_threads) {
  if (D % 8 != 0 || D > MAX_D || Hkv < 1 || Hq % Hkv != 0 || Hq / Hkv > MAX_GROUP || n > ctx)
    return -2;
  for (int64_t i = 0; i < ctx; ++i)
    if (slots[i] < 0 || slots[i] >= num_slots) return -2;
  if (n == 0) return 0;
  const int G = Hq / Hkv;
  int64_t bq = BQ;
  while (bq > 16 && (n + bq - 1) / bq * Hkv < 2 * (int64_t)num_threads) bq /= 2;
  const int64_t blocks = (n + bq - 1) / bq, tasks = blocks * Hkv;
  const Prefill a = {q,   k_cache,   v_cache, slots, out, NULL, q_stride, n,  num_slots,
                     ctx, bq,        blocks,  Hq,    Hkv, D,    avx512_usable() && D % 16 == 0,
                     scale};
  if (num_threads > 1 && n <= team_rows()) return run_on_team(a, tasks, num_threads);
  int status = 0;
#pragma omp parallel num_threads(num_threads)
  {
    /* 64-byte aligned, so that no AVX-512 load of a key, value or output row straddles
     * two cache lines. */
    Blocks *blk = aligned_alloc(64, sizeof(Blocks));
    const int64_t rows = task_rows(BQ, G);
    const size_t o_bytes = sizeof(float) * (size_t)(rows * (D + 2) + QUAD * BK);
    float *o = aligned_alloc(64, (o_bytes + 63) / 64 * 64);
    if (blk == NULL || o == NULL) {
#pragma omp atomic write
      status = -1;
    }
#pragma omp for schedule(dynamic)
    for (int64_t i = 0; i < tasks; ++i)
      if (blk != NULL && o != NULL) run_task(&a, i, out, blk, o, rows);
    free(blk);
    free(o);
  }
  return status;
}
