/* y[M, N] = x[M, K] @ W^T from GGUF blocks (block_matmul.c's kinds), with x rounded to
 * 8 bits per block of 32: the q8-activations option (block_matmul.py).
 *
 * Each block of a row of x becomes d * q, q int8 in [-127, 127], d = max|x| / 127. A
 * block's dot product with a weight block is then integer: AVX2's maddubs multiplies
 * 32 unsigned bytes by 32 signed ones into 16-bit pair sums, madd widens them to eight
 * int32 sums, and one float multiply-add scales those by the weight's scale times d.
 * That is about half the instructions of widening every weight to float32, which is
 * what bounds one sequence's decode step. Q4_1's minimum term, min_b * sum(x_b),
 * takes x's exact float sums. Q8_0 and Q8_16 weights are signed: their magnitudes meet
 * x carrying the weights' signs (maddubs wants one unsigned operand).
 *
 * The result differs from the exact kernel by x's rounding (at most half a step of
 * 1/127 of a block's largest value, per element), so it is an option, off by default.
 * It takes one row of x: one sequence's decode step, which streams every weight for a
 * single dot product each. With more rows each unpacked weight block serves several,
 * which the exact kernel already exploits; those go to baton_block_matmul unchanged.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "block_kinds.h"
#include "simd.h"
#include "work_team.h"

/* n blocks of x as q (32 int8 each) and d; sums (may be NULL): each block's float sum,
 * added as block_matmul.c adds it. */
static void quantize_blocks(const float *x, int64_t n, int8_t *q, float *d, float *sums) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  /* packs_epi32 then packs_epi16 leave each 128-bit lane holding 4 values of each of
   * the four vectors in turn; this puts the 32-bit groups back in order. */
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t i = 0; i < n; ++i) {
    const float *v = x + i * BLOCK;
    const __m256 a0 = _mm256_loadu_ps(v), a1 = _mm256_loadu_ps(v + 8);
    const __m256 a2 = _mm256_loadu_ps(v + 16), a3 = _mm256_loadu_ps(v + 24);
    const __m256 m8 = _mm256_max_ps(
        _mm256_max_ps(_mm256_andnot_ps(sign, a0), _mm256_andnot_ps(sign, a1)),
        _mm256_max_ps(_mm256_andnot_ps(sign, a2), _mm256_andnot_ps(sign, a3)));
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    const float amax = _mm_cvtss_f32(m);
    d[i] = amax / 127.0f;
    const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    /* cvtps rounds to nearest (even), the default rounding mode. */
    const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(a0, inv));
    const __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(a1, inv));
    const __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(a2, inv));
    const __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(a3, inv));
    const __m256i packed =
        _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
    _mm256_storeu_si256((__m256i *)(q + i * BLOCK), _mm256_permutevar8x32_epi32(packed, order));
    if (sums != NULL) sums[i] = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
  }
}

/* A Q4_1 block's 32 nibbles as bytes in weight order (byte j holds q[j] low, q[j + 16]
 * high). */
static inline __m256i unpack_q4(const uint8_t *p) {
  const __m128i raw = _mm_loadu_si128((const __m128i *)p);
  const __m256i both = _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw);
  return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

/* Eight float sums of u * s over a block (u unsigned, s signed bytes): lanes 0-3 cover
 * its first 16 bytes, lanes 4-7 its last 16 (Q8_16's two scales). A pair's sum stays
 * within int16: at most 2 * 128 * 127. */
static inline __m256 block_dot(__m256i u, __m256i s) {
  const __m256i pairs = _mm256_maddubs_epi16(u, s);
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

/* acc plus a weight block (its index among the scales: sb) times x's block: eight float
 * lanes, scaled by the weight's scale(s) times x's d. */
static inline __attribute__((always_inline)) __m256 scaled_dot(
    int kind, __m256i w, __m256i w_abs, const int8_t *xq, float xd, const float *scale,
    int64_t sb, __m256 acc) {
  const __m256i xv = _mm256_loadu_si256((const __m256i *)xq);
  __m256 s;
  if (kind == Q8_16)
    s = _mm256_set_m128(_mm_set1_ps(scale[2 * sb + 1] * xd), _mm_set1_ps(scale[2 * sb] * xd));
  else
    s = _mm256_set1_ps(scale[sb] * xd);
  const __m256 dot = kind == Q4_1 ? block_dot(w, xv) : block_dot(w_abs, _mm256_sign_epi8(xv, w));
  return _mm256_fmadd_ps(dot, s, acc);
}

static inline __attribute__((always_inline)) void load_weight(int kind, const uint8_t *p,
                                                              __m256i *w, __m256i *w_abs) {
  if (kind == Q4_1) {
    *w = unpack_q4(p);
    *w_abs = *w;
  } else {
    *w = _mm256_loadu_si256((const __m256i *)p);
    *w_abs = _mm256_sign_epi8(*w, *w);
  }
}

/* y[n - col0] for weight rows [n0, n1). Blocks go two at a time, the first's product the
 * second's addend, so the chain of dependent adds on the accumulator is half as long. */
static inline __attribute__((always_inline)) void rows(
    int kind, const int8_t *xq, const float *xd, const float *xs, int64_t K, const uint8_t *qs,
    const float *scale, const float *min, float *y, int64_t col0, int64_t n0, int64_t n1) {
  const int64_t nb = K / BLOCK;
  const int64_t block_bytes = kind == Q4_1 ? BLOCK / 2 : BLOCK;
  for (int64_t n = n0; n < n1; ++n) {
    __m256 acc = _mm256_setzero_ps();
    const uint8_t *row = qs + n * nb * block_bytes;
    const int64_t sb = n * nb;
    int64_t b = 0;
    for (; b + 1 < nb; b += 2) {
      __m256i w0, a0, w1, a1;
      load_weight(kind, row + b * block_bytes, &w0, &a0);
      load_weight(kind, row + (b + 1) * block_bytes, &w1, &a1);
      const __m256 p0 = scaled_dot(kind, w0, a0, xq + b * BLOCK, xd[b], scale, sb + b,
                                   _mm256_setzero_ps());
      acc = _mm256_add_ps(acc, scaled_dot(kind, w1, a1, xq + (b + 1) * BLOCK, xd[b + 1], scale,
                                          sb + b + 1, p0));
    }
    if (b < nb) {
      __m256i w0, a0;
      load_weight(kind, row + b * block_bytes, &w0, &a0);
      acc = scaled_dot(kind, w0, a0, xq + b * BLOCK, xd[b], scale, sb + b, acc);
    }
    if (kind == Q4_1) acc = _mm256_add_ps(acc, min_dot(min + sb, xs, nb));
    y[n - col0] = hsum(acc);
  }
}

/* Weight rows [n0, n1) (rows' kind a constant). */
static void rows_of(int kind, const int8_t *xq, const float *xd, const float *xs, int64_t K,
                    const uint8_t *qs, const float *scale, const float *min, float *y,
                    int64_t col0, int64_t n0, int64_t n1) {
  if (kind == Q4_1)
    rows(Q4_1, xq, xd, xs, K, qs, scale, min, y, col0, n0, n1);
  else if (kind == Q8_0)
    rows(Q8_0, xq, xd, xs, K, qs, scale, min, y, col0, n0, n1);
  else
    rows(Q8_16, xq, xd, xs, K, qs, scale, min, y, col0, n0, n1);
}

/* The product as a work-team loop (work_team.h): an item is `width` weight rows. */
typedef struct {
  int kind;
  const int8_t *xq;
  const float *xd, *xs, *scale, *min;
  const uint8_t *qs;
  float *y;
  int64_t K, N, width;
} Q8Loop;

static void q8_run(const void *ctx, int64_t item, float *scratch) {
  const Q8Loop *l = ctx;
  const int64_t n0 = item * l->width, n1 = n0 + l->width < l->N ? n0 + l->width : l->N;
  rows_of(l->kind, l->xq, l->xd, l->xs, l->K, l->qs, l->scale, l->min,
          scratch == NULL ? l->y : scratch, scratch == NULL ? 0 : n0, n0, n1);
}

static void q8_commit(const void *ctx, int64_t item, const float *scratch) {
  const Q8Loop *l = ctx;
  const int64_t n0 = item * l->width, n1 = n0 + l->width < l->N ? n0 + l->width : l->N;
  memcpy(l->y + n0, scratch, sizeof(float) * (size_t)(n1 - n0));
}

static int64_t q8_scratch(const void *ctx) { return ((const Q8Loop *)ctx)->width; }

/* As baton_block_matmul, which it calls for more than one row of x. Returns 0, or -1
 * when K is not a whole number of blocks, the kind is unknown or scratch memory ran
 * out. */
int baton_block_matmul_q8(int kind, const float *x, int64_t M, int64_t K, const uint8_t *qs,
                          const float *scale, const float *min, float *y, int64_t N,
                          int num_threads) {
  if (K % BLOCK != 0 || (kind != Q4_1 && kind != Q8_0 && kind != Q8_16)) return -1;
  if (M != 1) return baton_block_matmul(kind, x, M, K, qs, scale, min, y, N, num_threads);
  const int64_t nb = K / BLOCK;
  /* x's rounding in the team's arena: a helper late on an item reads it. */
  float *xd = team_arena(sizeof(float) * (size_t)(2 * nb) + (size_t)K);
  if (xd == NULL) return -1;
  float *xs = xd + nb;
  int8_t *xq = (int8_t *)(xs + nb);
  quantize_blocks(x, nb, xq, xd, kind == Q4_1 ? xs : NULL);
  const int64_t chunks = (N + N_CHUNK - 1) / N_CHUNK;
  const int64_t width = N_CHUNK * chunks_per_grab(chunks, num_threads);
  const Q8Loop loop = {kind, xq, xd, xs, scale, min, qs, y, K, N, width};
  const TeamLoop team = {q8_run, q8_commit, q8_scratch, (N + width - 1) / width};
  if (num_threads > 1 && team_run(&team, &loop, sizeof loop, num_threads) == 0) return 0;
  rows_of(kind, xq, xd, xs, K, qs, scale, min, y, 0, 0, N);
  return 0;
}
