/* y[M, N] = x[M, K] @ W^T from GGUF blocks (block_matmul.c's kinds), with x rounded to
 * 16 or 8 bits per block of 32: EngineConfig.activations' "int16" and "int8", options
 * beside the exact default (block_matmul.py).
 *
 * Each block of a row of x becomes d * q, q an integer of `bits` bits and d = max|x| /
 * (2^(bits - 1) - 1). A block's dot product with a weight block is then integer, and one
 * float multiply-add scales it by the weight's scale times d. That is about half the
 * instructions of widening every weight to float32, which is what bounds one sequence's
 * decode step:
 * - 16 bits: the weights widen to int16 (Q4_1's nibbles one shuffle, a mask and a shift
 *   for all 32), and AVX2's madd multiplies 16 pairs into eight int32 pair sums. A
 *   block's sum is exact in int32 (at most 32 * 128 * 32767).
 * - 8 bits: maddubs multiplies 32 unsigned bytes by 32 signed ones into 16-bit pair
 *   sums and madd widens them. Q8_0 and Q8_16 weights are signed: their magnitudes meet
 *   x carrying the weights' signs (maddubs wants one unsigned operand).
 * Q4_1's minimum term, min_b * sum(x_b), takes x's exact float sums.
 *
 * The result differs from the exact kernel's by x's rounding: at most half a step,
 * 1/65534 (16 bits) or 1/254 (8 bits) of the block's largest value, per element. Greedy
 * output still parts from the exact path's where the top two logits nearly tie: rarely
 * at 16 bits, often at 8 (bench/activation_agreement.py).
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

/* n blocks of x as `bits`-bit integers q (32 a block, int8 or int16) and scales d, each
 * block d * q with d = max|x| / (2^(bits - 1) - 1); sums (may be NULL): each block's
 * float sum, added as block_matmul.c adds it. */
static void quantize_blocks(int bits, const float *x, int64_t n, void *q, float *d,
                            float *sums) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const float levels = bits == 16 ? 32767.0f : 127.0f;
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
    d[i] = amax / levels;
    const __m256 inv = _mm256_set1_ps(amax > 0.0f ? levels / amax : 0.0f);
    /* cvtps rounds to nearest (even), the default rounding mode. */
    const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(a0, inv));
    const __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(a1, inv));
    const __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(a2, inv));
    const __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(a3, inv));
    const __m256i lo = _mm256_packs_epi32(i0, i1), hi = _mm256_packs_epi32(i2, i3);
    if (bits == 16) { /* a permute of 64-bit groups restores each half's order */
      int16_t *out = (int16_t *)q + i * BLOCK;
      _mm256_storeu_si256((__m256i *)out, _mm256_permute4x64_epi64(lo, 0xD8));
      _mm256_storeu_si256((__m256i *)(out + 16), _mm256_permute4x64_epi64(hi, 0xD8));
    } else {
      _mm256_storeu_si256((__m256i *)((int8_t *)q + i * BLOCK),
                          _mm256_permutevar8x32_epi32(_mm256_packs_epi16(lo, hi), order));
    }
    if (sums != NULL) sums[i] = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
  }
}

/* acc plus a weight block at p (its index among the scales: sb) times x's 16-bit block. */
static inline __attribute__((always_inline)) __m256 scaled_dot16(
    int kind, const uint8_t *p, const int16_t *xq, float xd, const float *scale, int64_t sb,
    __m256 acc) {
  const __m256i x0 = _mm256_loadu_si256((const __m256i *)xq);
  const __m256i x1 = _mm256_loadu_si256((const __m256i *)(xq + 16));
  if (kind == Q4_1) {
    /* Byte j holds q[j] low and q[j + 16] high; widened to 16 bits, a mask and a shift
     * give each half. */
    const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
    const __m256i lo = _mm256_and_si256(w, _mm256_set1_epi16(0x0F));
    const __m256i sum =
        _mm256_add_epi32(_mm256_madd_epi16(lo, x0), _mm256_madd_epi16(_mm256_srli_epi16(w, 4), x1));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_set1_ps(scale[sb] * xd), acc);
  }
  const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p));
  const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p + 16)));
  if (kind == Q8_0) {
    const __m256i sum = _mm256_add_epi32(_mm256_madd_epi16(w0, x0), _mm256_madd_epi16(w1, x1));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_set1_ps(scale[sb] * xd), acc);
  }
  acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(w0, x0)),
                        _mm256_set1_ps(scale[2 * sb] * xd), acc);
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(w1, x1)),
                         _mm256_set1_ps(scale[2 * sb + 1] * xd), acc);
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

/* 16 bits on AVX-512 (where avx512_usable, vector_width.c): a vector of 32 int16 holds
 * two blocks' halves, so each instruction does a pair of blocks' work.
 * x's pairs are laid out [first's 0-15, second's 0-15, first's 16-31, second's 16-31]
 * (interleave_pairs), matching the weights as they widen: Q4_1's two blocks' 32 bytes
 * give both blocks' low nibbles (weights 0-15) and high ones (16-31) at once. An odd
 * last block keeps the plain layout and the AVX2 code. */
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512dq")))


/* Pairs of plain 16-bit blocks into the layout above, in place; dv[16 p + i]: pair p's
 * d, its first block's for i < 8 and its second's after. */
static void interleave_pairs(int16_t *q, const float *d, int64_t nb, float *dv) {
  for (int64_t p = 0; p + 1 < nb; p += 2) {
    int16_t *pair = q + p * BLOCK;
    int16_t swap[16];
    memcpy(swap, pair + 16, sizeof swap);
    memcpy(pair + 16, pair + 32, sizeof swap);
    memcpy(pair + 32, swap, sizeof swap);
    for (int i = 0; i < 8; ++i) {
      dv[8 * p + i] = d[p];
      dv[8 * p + 8 + i] = d[p + 1];
    }
  }
}

/* 16 lanes with lanes 0-7 = v[a] and 8-15 = v[b] for the first four floats v. */
static inline AVX512 __attribute__((always_inline)) __m512 spread(__m128 v, int a, int b) {
  const __m512i idx = _mm512_set_epi32(b, b, b, b, b, b, b, b, a, a, a, a, a, a, a, a);
  return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(v));
}

/* Two bytes' halves of a Q8_0 / Q8_16 pair (32 bytes a block) widened to int16: each
 * block's bytes [off, off + 16). */
static inline AVX512 __attribute__((always_inline)) __m512i widen_halves(const uint8_t *p,
                                                                         int off) {
  const __m256i both = _mm256_inserti128_si256(
      _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(p + off))),
      _mm_loadu_si128((const __m128i *)(p + BLOCK + off)), 1);
  return _mm512_cvtepi8_epi16(both);
}

/* acc plus a pair of weight blocks at p (the first's index among the scales: sb) times
 * x's pair xq (dv: the pair's d, spread). */
static inline AVX512 __attribute__((always_inline)) __m512 pair_dot16(
    int kind, const uint8_t *p, const int16_t *xq, const float *dv, const float *scale,
    int64_t sb, __m512 acc) {
  const __m512i x_lo = _mm512_loadu_si512(xq), x_hi = _mm512_loadu_si512(xq + 32);
  const __m512 d = _mm512_loadu_ps(dv);
  if (kind == Q4_1) {
    const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)p));
    const __m512i lo = _mm512_and_si512(w, _mm512_set1_epi16(0x0F));
    const __m512i sum = _mm512_add_epi32(_mm512_madd_epi16(lo, x_lo),
                                         _mm512_madd_epi16(_mm512_srli_epi16(w, 4), x_hi));
    const __m128 s = _mm_castpd_ps(_mm_load_sd((const double *)(scale + sb)));
    return _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sum), d), spread(s, 0, 1), acc);
  }
  const __m512i lo = _mm512_madd_epi16(widen_halves(p, 0), x_lo);
  const __m512i hi = _mm512_madd_epi16(widen_halves(p, 16), x_hi);
  if (kind == Q8_0) {
    const __m128 s = _mm_castpd_ps(_mm_load_sd((const double *)(scale + sb)));
    return _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(lo, hi)), d),
                           spread(s, 0, 1), acc);
  }
  /* Q8_16: the scales run first-lo, first-hi, second-lo, second-hi. */
  const __m128 s = _mm_loadu_ps(scale + 2 * sb);
  acc = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(lo), d), spread(s, 0, 2), acc);
  return _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(hi), d), spread(s, 1, 3), acc);
}

/* rows() for 16 bits on AVX-512, x in pairs. */
static inline AVX512 __attribute__((always_inline)) void rows16_avx512(
    int kind, const int16_t *xq, const float *xd, const float *dv, const float *xs, int64_t K,
    const uint8_t *qs, const float *scale, const float *min, float *y, int64_t col0, int64_t n0,
    int64_t n1) {
  const int64_t nb = K / BLOCK;
  const int64_t block_bytes = kind == Q4_1 ? BLOCK / 2 : BLOCK;
  for (int64_t n = n0; n < n1; ++n) {
    __m512 even = _mm512_setzero_ps(), odd = _mm512_setzero_ps();
    const uint8_t *row = qs + n * nb * block_bytes;
    const int64_t sb = n * nb;
    int64_t b = 0;
    for (; b + 3 < nb; b += 4) {
      even = pair_dot16(kind, row + b * block_bytes, xq + b * BLOCK, dv + 8 * b, scale, sb + b,
                        even);
      odd = pair_dot16(kind, row + (b + 2) * block_bytes, xq + (b + 2) * BLOCK, dv + 8 * (b + 2),
                       scale, sb + b + 2, odd);
    }
    if (b + 1 < nb) {
      even = pair_dot16(kind, row + b * block_bytes, xq + b * BLOCK, dv + 8 * b, scale, sb + b,
                        even);
      b += 2;
    }
    even = _mm512_add_ps(even, odd);
    __m256 acc = _mm256_add_ps(_mm512_castps512_ps256(even), _mm512_extractf32x8_ps(even, 1));
    if (b < nb)
      acc = scaled_dot16(kind, row + b * block_bytes, xq + b * BLOCK, xd[b], scale, sb + b, acc);
    if (kind == Q4_1) acc = _mm256_add_ps(acc, min_dot(min + sb, xs, nb));
    y[n - col0] = hsum(acc);
  }
}

static AVX512 void rows16_avx512_of(int kind, const int16_t *xq, const float *xd,
                                    const float *dv, const float *xs, int64_t K,
                                    const uint8_t *qs, const float *scale, const float *min,
                                    float *y, int64_t col0, int64_t n0, int64_t n1) {
  if (kind == Q4_1)
    rows16_avx512(Q4_1, xq, xd, dv, xs, K, qs, scale, min, y, col0, n0, n1);
  else if (kind == Q8_0)
    rows16_avx512(Q8_0, xq, xd, dv, xs, K, qs, scale, min, y, col0, n0, n1);
  else
    rows16_avx512(Q8_16, xq, xd, dv, xs, K, qs, scale, min, y, col0, n0, n1);
}

/* y[n - col0] for weight rows [n0, n1), x in `bits`-bit blocks. Blocks go two at a
 * time into two chains of adds (8 bits: the first's product the second's addend), so
 * each chain of dependent adds on an accumulator is half as long. */
static inline __attribute__((always_inline)) void rows(
    int bits, int kind, const void *xq, const float *xd, const float *xs, int64_t K,
    const uint8_t *qs, const float *scale, const float *min, float *y, int64_t col0, int64_t n0,
    int64_t n1) {
  const int64_t nb = K / BLOCK;
  const int64_t block_bytes = kind == Q4_1 ? BLOCK / 2 : BLOCK;
  const int8_t *x8 = xq;
  const int16_t *x16 = xq;
  for (int64_t n = n0; n < n1; ++n) {
    __m256 acc = _mm256_setzero_ps();
    const uint8_t *row = qs + n * nb * block_bytes;
    const int64_t sb = n * nb;
    int64_t b = 0;
    if (bits == 16) {
      __m256 odd = _mm256_setzero_ps();
      for (; b + 1 < nb; b += 2) {
        acc = scaled_dot16(kind, row + b * block_bytes, x16 + b * BLOCK, xd[b], scale, sb + b,
                           acc);
        odd = scaled_dot16(kind, row + (b + 1) * block_bytes, x16 + (b + 1) * BLOCK, xd[b + 1],
                           scale, sb + b + 1, odd);
      }
      if (b < nb)
        acc = scaled_dot16(kind, row + b * block_bytes, x16 + b * BLOCK, xd[b], scale, sb + b,
                           acc);
      acc = _mm256_add_ps(acc, odd);
    } else {
      for (; b + 1 < nb; b += 2) {
        __m256i w0, a0, w1, a1;
        load_weight(kind, row + b * block_bytes, &w0, &a0);
        load_weight(kind, row + (b + 1) * block_bytes, &w1, &a1);
        const __m256 p0 = scaled_dot(kind, w0, a0, x8 + b * BLOCK, xd[b], scale, sb + b,
                                     _mm256_setzero_ps());
        acc = _mm256_add_ps(acc, scaled_dot(kind, w1, a1, x8 + (b + 1) * BLOCK, xd[b + 1],
                                            scale, sb + b + 1, p0));
      }
      if (b < nb) {
        __m256i w0, a0;
        load_weight(kind, row + b * block_bytes, &w0, &a0);
        acc = scaled_dot(kind, w0, a0, x8 + b * BLOCK, xd[b], scale, sb + b, acc);
      }
    }
    if (kind == Q4_1) acc = _mm256_add_ps(acc, min_dot(min + sb, xs, nb));
    y[n - col0] = hsum(acc);
  }
}

/* Weight rows [n0, n1) (rows' bits and kind constants). */
static void rows_of(int bits, int kind, const void *xq, const float *xd, const float *xs,
                    int64_t K, const uint8_t *qs, const float *scale, const float *min, float *y,
                    int64_t col0, int64_t n0, int64_t n1) {
#define ROWS(BITS, KIND) rows(BITS, KIND, xq, xd, xs, K, qs, scale, min, y, col0, n0, n1)
  if (bits == 16) {
    if (kind == Q4_1)
      ROWS(16, Q4_1);
    else if (kind == Q8_0)
      ROWS(16, Q8_0);
    else
      ROWS(16, Q8_16);
  } else {
    if (kind == Q4_1)
      ROWS(8, Q4_1);
    else if (kind == Q8_0)
      ROWS(8, Q8_0);
    else
      ROWS(8, Q8_16);
  }
#undef ROWS
}

/* The product as a work-team loop (work_team.h): an item is `width` weight rows. */
typedef struct {
  int bits, kind;
  const void *xq;
  /* dv: 16 bits on AVX-512, x in pairs (NULL otherwise). */
  const float *xd, *dv, *xs, *scale, *min;
  const uint8_t *qs;
  float *y;
  int64_t K, N, width;
} RoundedLoop;

/* y[n - col0] for weight rows [n0, n1). */
static void loop_rows(const RoundedLoop *l, float *y, int64_t col0, int64_t n0, int64_t n1) {
  if (l->dv != NULL)
    rows16_avx512_of(l->kind, l->xq, l->xd, l->dv, l->xs, l->K, l->qs, l->scale, l->min, y, col0,
                     n0, n1);
  else
    rows_of(l->bits, l->kind, l->xq, l->xd, l->xs, l->K, l->qs, l->scale, l->min, y, col0, n0,
            n1);
}

static void rounded_run(const void *ctx, int64_t item, float *scratch) {
  const RoundedLoop *l = ctx;
  const int64_t n0 = item * l->width, n1 = n0 + l->width < l->N ? n0 + l->width : l->N;
  loop_rows(l, scratch == NULL ? l->y : scratch, scratch == NULL ? 0 : n0, n0, n1);
}

static void rounded_commit(const void *ctx, int64_t item, const float *scratch) {
  const RoundedLoop *l = ctx;
  const int64_t n0 = item * l->width, n1 = n0 + l->width < l->N ? n0 + l->width : l->N;
  memcpy(l->y + n0, scratch, sizeof(float) * (size_t)(n1 - n0));
}

static int64_t rounded_scratch(const void *ctx) { return ((const RoundedLoop *)ctx)->width; }

/* As baton_block_matmul, which it calls for more than one row of x, with that row
 * rounded to `bits` (16 or 8) bits per block. Returns 0, or -1 when K is not a whole
 * number of blocks, the kind or bits are unknown or scratch memory ran out. */
int baton_block_matmul_rounded(int bits, int kind, const float *x, int64_t M, int64_t K,
                               const uint8_t *qs, const float *scale, const float *min,
                               float *y, int64_t N, int num_threads) {
  if (K % BLOCK != 0 || (kind != Q4_1 && kind != Q8_0 && kind != Q8_16)) return -1;
  if (bits != 16 && bits != 8) return -1;
  if (M != 1) return baton_block_matmul(kind, x, M, K, qs, scale, min, y, N, num_threads);
  const int64_t nb = K / BLOCK;
  const int wide = bits == 16 && avx512_usable();
  /* x's rounding in the team's arena: a helper late on an item reads it. */
  const int64_t floats = (wide ? 10 : 2) * nb;
  float *xd = team_arena(sizeof(float) * (size_t)floats + (size_t)(K * bits / 8));
  if (xd == NULL) return -1;
  float *xs = xd + nb, *dv = wide ? xs + nb : NULL;
  void *xq = xd + floats;
  quantize_blocks(bits, x, nb, xq, xd, kind == Q4_1 ? xs : NULL);
  if (wide) interleave_pairs(xq, xd, nb, dv);
  const int64_t chunks = (N + N_CHUNK - 1) / N_CHUNK;
  const int64_t width = N_CHUNK * chunks_per_grab(chunks, num_threads);
  const RoundedLoop loop = {bits, kind, xq, xd, dv, xs, scale, min, qs, y, K, N, width};
  const TeamLoop team = {rounded_run, rounded_commit, rounded_scratch, (N + width - 1) / width};
  if (num_threads > 1 && team_run(&team, &loop, sizeof loop, num_threads) == 0) return 0;
  loop_rows(&loop, y, 0, 0, N);
  return 0;
}
