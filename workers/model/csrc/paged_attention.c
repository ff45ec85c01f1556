/* Decode attention straight from a paged KV cache: one query token per sequence.
 *
 * q      [B, Hq, D]                 the step's queries
 * cache  [Hkv, num_slots, D]        K and V of one layer; slot = block * block_size + offset
 * tables [B, max_blocks]            each sequence's block table (padding past its length unused)
 * lengths[B]                        tokens of context, the new one included
 * window                            keys each query sees, itself included (0: all of them):
 *                                   a sliding-window layer's, read from length - window on
 * out    [B, Hq, D]
 *
 * Each (sequence, KV head) reads its keys and values once, through the block table, for
 * all the query heads of its group, with a running (online) softmax per query head: no
 * gathered copy of the context, no padding, no mask. The arithmetic is float32 like the
 * SDPA it replaces; only the order of the sums differs.
 *
 * baton_write_kv stores a step's new keys and values into their slots beforehand.
 *
 * Built with the other csrc/ files by workers/model/kernels.py.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "simd.h"
#include "work_team.h"

#define MAX_DIM 256   /* head dims up to this, multiples of 8 */
#define MAX_GROUP 16  /* query heads per KV head */

/* The 8 sums of 8 vectors, as one vector. */
static inline __m256 hsum8x8(const __m256 v[8]) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  /* a holds (v0 v1 v2 v3) sums of the low lanes then of the high lanes; so does b. */
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

/* s[j] = scale * (q . k_j) for the n <= CHUNK contiguous keys k [n, D]. */
static inline __attribute__((always_inline)) void scores(const float *q, const float *k, int n,
                                                         const int D, float scale, float *s) {
  int j = 0;
  for (; j + 8 <= n; j += 8) {
    __m256 acc[8];
    for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
    for (int d = 0; d < D; d += 8) {
      const __m256 qd = _mm256_loadu_ps(q + d);
      for (int i = 0; i < 8; ++i)
        acc[i] = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k + (j + i) * D + d), acc[i]);
    }
    _mm256_storeu_ps(s + j, _mm256_mul_ps(hsum8x8(acc), _mm256_set1_ps(scale)));
  }
  for (; j < n; ++j) {
    __m256 acc = _mm256_setzero_ps();
    for (int d = 0; d < D; d += 8)
      acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k + j * D + d), acc);
    s[j] = hsum(acc) * scale;
  }
}

/* acc[0:D] = acc * rescale + sum_j p[j] * v_j over the n contiguous values v [n, D];
 * with D constant, the accumulator stays in registers. */
static inline __attribute__((always_inline)) void accumulate(float *acc, float rescale,
                                                             const float *p, const float *v,
                                                             int n, const int D) {
  const __m256 r = _mm256_set1_ps(rescale);
  for (int d0 = 0; d0 < D; d0 += 64) {
    const int w = D - d0 < 64 ? D - d0 : 64;
    __m256 a[8];
    for (int d = 0; d < w; d += 8) a[d / 8] = _mm256_mul_ps(_mm256_loadu_ps(acc + d0 + d), r);
    for (int j = 0; j < n; ++j) {
      const __m256 pj = _mm256_set1_ps(p[j]);
      for (int d = 0; d < w; d += 8)
        a[d / 8] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + j * D + d0 + d), a[d / 8]);
    }
    for (int d = 0; d < w; d += 8) _mm256_storeu_ps(acc + d0 + d, a[d / 8]);
  }
}

#define CHUNK 32 /* keys scored before one softmax update */

/* One (sequence, KV head): its G query heads' outputs. A block id outside [0,
 * num_blocks) ends the keys early: callers check tables first, so only a work-team
 * helper reading a later loop's table (work_team.c) meets one, and its result is
 * dropped. */
static inline __attribute__((always_inline)) void one_head_group(
    const float *q, const float *k_cache, const float *v_cache, const int64_t *table,
    int64_t num_blocks, int64_t length, int64_t window, int G, const int D, int block_size,
    float scale, float *out) {
  float acc[MAX_GROUP][MAX_DIM];
  float running_max[MAX_GROUP], denom[MAX_GROUP], s[CHUNK] = {0};
  for (int g = 0; g < G; ++g) {
    running_max[g] = -INFINITY;
    denom[g] = 0.0f;
    for (int d = 0; d < D; ++d) acc[g][d] = 0.0f;
  }
  /* Runs of keys contiguous in the cache: within a block, at most CHUNK at a time. */
  for (int64_t t = window > 0 && length > window ? length - window : 0; t < length;) {
    const int64_t offset = t % block_size;
    int64_t n = block_size - offset;
    if (n > length - t) n = length - t;
    if (n > CHUNK) n = CHUNK;
    const int64_t block = table[t / block_size];
    if (block < 0 || block >= num_blocks) break;
    const int64_t slot = block * block_size + offset;
    const float *k = k_cache + slot * D, *v = v_cache + slot * D;
    for (int g = 0; g < G; ++g) {
      scores(q + g * D, k, (int)n, D, scale, s);
      float chunk_max = s[0];
      for (int j = 1; j < n; ++j) chunk_max = s[j] > chunk_max ? s[j] : chunk_max;
      float rescale = 1.0f;
      if (chunk_max > running_max[g]) {
        rescale = expf(running_max[g] - chunk_max);
        running_max[g] = chunk_max;
      }
      /* Eight at a time; lanes past n are zeroed, so neither the sum nor the values
       * see them. */
      const __m256 shift = _mm256_set1_ps(running_max[g]);
      const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
      __m256 total = _mm256_setzero_ps();
      for (int j = 0; j < n; j += 8) {
        const __m256i left = _mm256_set1_epi32((int)n - j);  /* lane i lives if i < left */
        const __m256 live = _mm256_castsi256_ps(_mm256_cmpgt_epi32(left, lanes));
        const __m256 e = _mm256_and_ps(exp256(_mm256_sub_ps(_mm256_loadu_ps(s + j), shift)), live);
        _mm256_storeu_ps(s + j, e);
        total = _mm256_add_ps(total, e);
      }
      denom[g] = denom[g] * rescale + hsum(total);
      accumulate(acc[g], rescale, s, v, (int)n, D);
    }
    t += n;
  }
  for (int g = 0; g < G; ++g) {
    const float inv = 1.0f / denom[g];
    for (int d = 0; d < D; ++d) out[g * D + d] = acc[g][d] * inv;
  }
}

/* Item b * Hkv + h: sequence b's KV head h, its G query heads' outputs into out. */
static void head_group(const float *q, const float *k_cache, const float *v_cache,
                       int64_t num_slots, const int64_t *tables, int64_t max_blocks,
                       const int64_t *lengths, int Hq, int Hkv, int G, int D, int block_size,
                       float scale, int64_t window, int64_t item, float *out) {
  const int64_t b = item / Hkv, h = item % Hkv;
  const float *qh = q + (b * Hq + h * G) * D;
  const float *kh = k_cache + h * num_slots * D, *vh = v_cache + h * num_slots * D;
  const int64_t *table = tables + b * max_blocks;
  const int64_t num_blocks = num_slots / block_size;
  int64_t length = lengths[b];
  if (length > max_blocks * block_size) length = max_blocks * block_size; /* as one_head_group */
  /* Constant head dims of common models let the accumulators live in registers. */
  if (D == 64)
    one_head_group(qh, kh, vh, table, num_blocks, length, window, G, 64, block_size, scale, out);
  else if (D == 128)
    one_head_group(qh, kh, vh, table, num_blocks, length, window, G, 128, block_size, scale, out);
  else if (D == 256)
    one_head_group(qh, kh, vh, table, num_blocks, length, window, G, 256, block_size, scale, out);
  else
    one_head_group(qh, kh, vh, table, num_blocks, length, window, G, D, block_size, scale, out);
}

/* A step's attention as a work-team loop (work_team.h). */
typedef struct {
  const float *q, *k_cache, *v_cache;
  const int64_t *tables, *lengths;
  float *out;
  int64_t num_slots, max_blocks, window;
  int Hq, Hkv, G, D, block_size;
  float scale;
} AttentionLoop;

static void attention_run(const void *ctx, int64_t item, float *scratch) {
  const AttentionLoop *l = ctx;
  head_group(l->q, l->k_cache, l->v_cache, l->num_slots, l->tables, l->max_blocks, l->lengths,
             l->Hq, l->Hkv, l->G, l->D, l->block_size, l->scale, l->window, item,
             scratch != NULL ? scratch : l->out + item * l->G * l->D);
}

static void attention_commit(const void *ctx, int64_t item, const float *scratch) {
  const AttentionLoop *l = ctx;
  memcpy(l->out + item * l->G * l->D, scratch, sizeof(float) * (size_t)(l->G * l->D));
}

static int64_t attention_scratch(const void *ctx) {
  const AttentionLoop *l = ctx;
  return (int64_t)l->G * l->D;
}

/* Returns 0; -1 for a head dim or group size the kernel does not take (the caller falls
 * back to another way); -2 for a length or block id out of range (a broken caller). */
int baton_paged_decode_attention(const float *q, const float *k_cache, const float *v_cache,
                                 int64_t num_slots, const int64_t *tables, int64_t max_blocks,
                                 const int64_t *lengths, int64_t B, int Hq, int Hkv, int D,
                                 int block_size, float scale, int64_t window, float *out,
                                 int num_threads) {
  if (D % 8 != 0 || D > MAX_DIM || Hkv <= 0 || Hq % Hkv != 0 || Hq / Hkv > MAX_GROUP ||
      block_size <= 0)
    return -1;
  if (window < 0) return -2;
  const int64_t num_blocks = num_slots / block_size;
  for (int64_t b = 0; b < B; ++b) {
    if (lengths[b] < 1 || lengths[b] > max_blocks * block_size) return -2;
    for (int64_t i = 0; i < (lengths[b] + block_size - 1) / block_size; ++i)
      if (tables[b * max_blocks + i] < 0 || tables[b * max_blocks + i] >= num_blocks) return -2;
  }
  const int G = Hq / Hkv;
  if (num_threads > 1 && B <= team_rows()) {
    /* The step's queries, tables and lengths in the team's arena: a helper late on an
     * item reads them. */
    float *qa = team_arena(sizeof(float) * (size_t)(B * Hq * D) +
                           sizeof(int64_t) * (size_t)(B * max_blocks + B));
    if (qa != NULL) {
      int64_t *ta = (int64_t *)(qa + B * Hq * D), *la = ta + B * max_blocks;
      memcpy(qa, q, sizeof(float) * (size_t)(B * Hq * D));
      memcpy(ta, tables, sizeof(int64_t) * (size_t)(B * max_blocks));
      memcpy(la, lengths, sizeof(int64_t) * (size_t)B);
      const AttentionLoop loop = {qa, k_cache, v_cache, ta, la, out, num_slots, max_blocks,
                                  window, Hq, Hkv, G, D, block_size, scale};
      const TeamLoop team = {attention_run, attention_commit, attention_scratch, B * Hkv};
      if (team_run(&team, &loop, sizeof loop, num_threads) == 0) return 0;
    }
  }
#pragma omp parallel for schedule(dynamic) num_threads(num_threads)
  for (int64_t item = 0; item < B * Hkv; ++item)
    head_group(q, k_cache, v_cache, num_slots, tables, max_blocks, lengths, Hq, Hkv, G, D,
               block_size, scale, window, item, out + item * G * D);
  return 0;
}

/* The step's new K and V into their cache slots: cache[h][slots[t]] = k[t][h] (and v).
 * k and v hold each token's Hkv heads of D floats contiguously, token t at row_stride
 * floats from token t - 1 (views into the QKV projection's output, read in place).
 * Returns 0, or -2 for a slot out of range (nothing is written then). */
int baton_write_kv(const float *k, int64_t k_row_stride, const float *v, int64_t v_row_stride,
                   const int64_t *slots, int64_t T, int Hkv, int D, float *k_cache,
                   float *v_cache, int64_t num_slots) {
  for (int64_t t = 0; t < T; ++t)
    if (slots[t] < 0 || slots[t] >= num_slots) return -2;
  for (int64_t t = 0; t < T; ++t)
    for (int h = 0; h < Hkv; ++h) {
      const int64_t at = (h * num_slots + slots[t]) * D;
      memcpy(k_cache + at, k + t * k_row_stride + h * D, sizeof(float) * (size_t)D);
      memcpy(v_cache + at, v + t * v_row_stride + h * D, sizeof(float) * (size_t)D);
    }
  return 0;
}
