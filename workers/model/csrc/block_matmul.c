/* y[M, N] = x[M, K] @ W^T for a weight W [N, K] kept in GGUF's blocks of 32 along K.
 *
 * Q4_1: w = scale * q + min with q in [0, 15], 16 bytes per block, byte j holding q[j]
 *       in its low nibble and q[j + 16] in its high one (GGUF's own layout).
 * Q8_0: w = scale * q with q in [-128, 127], 32 bytes per block.
 * Q8_16: Q8_0's bytes with a scale per 16 weights, two per block (Q6_K, repacked).
 *
 * The weights stay 4 / 8 bits in memory and become float32 in registers, so a decode
 * step that streams every weight once reads 6.4x / 3.8x fewer bytes than a float32
 * copy of them. The sum is float32 throughout: sum_b scale_b * (q_b . x_b) (+ min_b *
 * sum(x_b)), which equals the dequantized float32 matmul up to rounding order.
 *
 * Built by workers/model/kernels.py with -mavx2 -mfma -fopenmp; the AVX-512 forms are
 * taken at run time where avx512_usable (vector_width.c). Up to team_rows() rows of x
 * run on the work team (work_team.h); more take OpenMP, which resolves to the libgomp
 * torch already loaded, so those loops share torch's thread pool.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "block_kinds.h"
#include "simd.h"
#include "work_team.h"

#define MAX_ROWS 8    /* rows of x per pass: 4 weight vectors + 8 accumulators fit in 16 ymm */
_Static_assert(MAX_ROWS <= TEAM_DEFAULT_ROWS, "the work team takes the row-at-a-time path's calls");

static inline __attribute__((always_inline)) void unpack(int kind, const uint8_t *p, __m256 q[4]) {
  if (kind == Q4_1) {
    /* Bytes 0-7 and 8-15 widened straight from memory into 32-bit lanes (one shuffle
     * each): a lane's low nibble is q[j] and, the byte being under 256, the lane shifted
     * right by 4 is q[j + 16]. Two shuffles a block instead of six. */
    const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8)));
    const __m256i mask = _mm256_set1_epi32(0x0F);
    q[0] = _mm256_cvtepi32_ps(_mm256_and_si256(b0, mask));
    q[1] = _mm256_cvtepi32_ps(_mm256_and_si256(b1, mask));
    q[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4));
    q[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4));
  } else {
    for (int i = 0; i < 4; ++i)
      q[i] = _mm256_cvtepi32_ps(
          _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8 * i))));
  }
}

/* Rows [m0, m0 + R) of y for weight rows [n0, n1): y[m][n - col0], rows ys floats
 * apart. */
static inline __attribute__((always_inline)) void tile(
    int kind, const int R, const float *x, int64_t K, const uint8_t *qs, const float *scale,
    const float *min, const float *block_sums, float *y, int64_t ys, int64_t col0, int64_t n0,
    int64_t n1, int64_t m0) {
  const int64_t nb = K / BLOCK;
  const int64_t block_bytes = kind == Q4_1 ? BLOCK / 2 : BLOCK;
  for (int64_t n = n0; n < n1; ++n) {
    __m256 acc[MAX_ROWS];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    const uint8_t *row = qs + n * nb * block_bytes;
    for (int64_t b = 0; b < nb; ++b) {
      __m256 q[4];
      unpack(kind, row + b * block_bytes, q);
      if (kind == Q8_16) {
        const __m256 s0 = _mm256_set1_ps(scale[2 * (n * nb + b)]);
        const __m256 s1 = _mm256_set1_ps(scale[2 * (n * nb + b) + 1]);
        for (int r = 0; r < R; ++r) {
          const float *xr = x + (m0 + r) * K + b * BLOCK;
          __m256 t0 = _mm256_mul_ps(q[0], _mm256_loadu_ps(xr));
          t0 = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(xr + 8), t0);
          __m256 t1 = _mm256_mul_ps(q[2], _mm256_loadu_ps(xr + 16));
          t1 = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xr + 24), t1);
          acc[r] = _mm256_fmadd_ps(t1, s1, _mm256_fmadd_ps(t0, s0, acc[r]));
        }
        continue;
      }
      const __m256 s = _mm256_set1_ps(scale[n * nb + b]);
      for (int r = 0; r < R; ++r) {
        const float *xr = x + (m0 + r) * K + b * BLOCK;
        __m256 t = _mm256_mul_ps(q[0], _mm256_loadu_ps(xr));
        t = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(xr + 8), t);
        t = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(xr + 16), t);
        t = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xr + 24), t);
        acc[r] = _mm256_fmadd_ps(t, s, acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) {
      if (kind == Q4_1)
        acc[r] = _mm256_add_ps(acc[r], min_dot(min + n * nb, block_sums + (m0 + r) * nb, nb));
      y[(m0 + r) * ys + n - col0] = hsum(acc[r]);
    }
  }
}

static void chunk(int kind, const float *x, int64_t M, int64_t K, const uint8_t *qs,
                  const float *scale, const float *min, const float *block_sums, float *y,
                  int64_t ys, int64_t col0, int64_t n0, int64_t n1) {
  int64_t m0 = 0;
  for (; m0 + MAX_ROWS <= M; m0 += MAX_ROWS)
    tile(kind, MAX_ROWS, x, K, qs, scale, min, block_sums, y, ys, col0, n0, n1, m0);
  /* The constant R lets the compiler keep each remainder's accumulators in registers. */
  switch (M - m0) {
#define REST(R) \
  case R: tile(kind, R, x, K, qs, scale, min, block_sums, y, ys, col0, n0, n1, m0); break;
    REST(7) REST(6) REST(5) REST(4) REST(3) REST(2) REST(1)
#undef REST
    default: break;
  }
}

/* tile() on AVX-512, where avx512_usable (vector_width.c): a block's 32 weights are two
 * vectors of 16 floats rather than four of 8, which halves the instructions a weight
 * costs. The same products, summed in another order. */
#define AVX512 __attribute__((target("avx512f,avx512dq")))

static inline AVX512 __attribute__((always_inline)) void unpack512(int kind, const uint8_t *p,
                                                                  __m512 q[2]) {
  if (kind == Q4_1) {
    /* Byte j's low nibble is q[j], its high one q[j + 16]. */
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    q[0] = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(0x0F)));
    q[1] = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
  } else {
    q[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
    q[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 16))));
  }
}

static inline AVX512 __attribute__((always_inline)) void tile512(
    int kind, const int R, const float *x, int64_t K, const uint8_t *qs, const float *scale,
    const float *min, const float *block_sums, float *y, int64_t ys, int64_t col0, int64_t n0,
    int64_t n1, int64_t m0) {
  const int64_t nb = K / BLOCK;
  const int64_t block_bytes = kind == Q4_1 ? BLOCK / 2 : BLOCK;
  for (int64_t n = n0; n < n1; ++n) {
    __m512 acc[MAX_ROWS];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    const uint8_t *row = qs + n * nb * block_bytes;
    for (int64_t b = 0; b < nb; ++b) {
      __m512 q[2];
      unpack512(kind, row + b * block_bytes, q);
      if (kind == Q8_16) {
        const __m512 s0 = _mm512_set1_ps(scale[2 * (n * nb + b)]);
        const __m512 s1 = _mm512_set1_ps(scale[2 * (n * nb + b) + 1]);
        for (int r = 0; r < R; ++r) {
          const float *xr = x + (m0 + r) * K + b * BLOCK;
          const __m512 t0 = _mm512_mul_ps(q[0], _mm512_loadu_ps(xr));
          const __m512 t1 = _mm512_mul_ps(q[1], _mm512_loadu_ps(xr + 16));
          acc[r] = _mm512_fmadd_ps(t1, s1, _mm512_fmadd_ps(t0, s0, acc[r]));
        }
        continue;
      }
      const __m512 s = _mm512_set1_ps(scale[n * nb + b]);
      for (int r = 0; r < R; ++r) {
        const float *xr = x + (m0 + r) * K + b * BLOCK;
        __m512 t = _mm512_mul_ps(q[0], _mm512_loadu_ps(xr));
        t = _mm512_fmadd_ps(q[1], _mm512_loadu_ps(xr + 16), t);
        acc[r] = _mm512_fmadd_ps(t, s, acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) {
      __m256 sum =
          _mm256_add_ps(_mm512_castps512_ps256(acc[r]), _mm512_extractf32x8_ps(acc[r], 1));
      if (kind == Q4_1)
        sum = _mm256_add_ps(sum, min_dot(min + n * nb, block_sums + (m0 + r) * nb, nb));
      y[(m0 + r) * ys + n - col0] = hsum(sum);
    }
  }
}

static AVX512 void chunk512(int kind, const float *x, int64_t M, int64_t K, const uint8_t *qs,
                            const float *scale, const float *min, const float *block_sums,
                            float *y, int64_t ys, int64_t col0, int64_t n0, int64_t n1) {
  int64_t m0 = 0;
  for (; m0 + MAX_ROWS <= M; m0 += MAX_ROWS)
    tile512(kind, MAX_ROWS, x, K, qs, scale, min, block_sums, y, ys, col0, n0, n1, m0);
  switch (M - m0) {
#define REST(R) \
  case R: tile512(kind, R, x, K, qs, scale, min, block_sums, y, ys, col0, n0, n1, m0); break;
    REST(7) REST(6) REST(5) REST(4) REST(3) REST(2) REST(1)
#undef REST
    default: break;
  }
}

/* Batches over MAX_ROWS rows are compute-bound, and weight-row-at-a-time dot products
 * would unpack every block once per MAX_ROWS rows. Instead a few weight rows at a time
 * are dequantized into a small float32 buffer and multiplied into every row of x at
 * once: x is held transposed, [K][padded M], so one vector carries 8 of its rows and
 * each weight is broadcast against them (an outer-product micro-kernel, as in BLAS). */
#define KC 128  /* columns per slice: a slice of transposed x (KC x 32 floats) stays in L1 */
#define NC 48   /* weight rows per task */
#define NR 3    /* weight rows per micro-kernel: 3 x 4 accumulators + 4 weights fit 16 ymm */
#define MT 32   /* rows of x per tile: the micro-kernel's 4 vectors */

/* Rows in the tile of transposed x holding row m: MT but for the last, narrower tile. */
static inline int64_t tile_width(int64_t mp, int64_t m) {
  const int64_t m0 = m / MT * MT;
  return mp - m0 < MT ? mp - m0 : MT;
}

/* w[r][0:kn] = the dequantized weight rows n0 + r, columns [k0, k0 + kn), r < nr.
 * Multiply then add, never fused, so the values equal the float32 copy made from the
 * blocks by gguf-py (the build passes -ffp-contract=off). */
static inline __attribute__((always_inline)) void dequantize_rows(
    int kind, const uint8_t *qs, const float *scale, const float *min, int64_t nb, int64_t n0,
    int nr, int64_t k0, int64_t kn, float *w) {
  const int64_t block_bytes = kind == Q4_1 ? BLOCK / 2 : BLOCK;
  for (int r = 0; r < nr; ++r) {
    for (int64_t k = 0; k < kn; k += BLOCK) {
      const int64_t i = (n0 + r) * nb + (k0 + k) / BLOCK;
      __m256 q[4];
      unpack(kind, qs + i * block_bytes, q);
      /* Q8_16: the first two vectors take the block's first scale, the others its second. */
      const __m256 s = _mm256_set1_ps(kind == Q8_16 ? scale[2 * i] : scale[i]);
      const __m256 s_hi = kind == Q8_16 ? _mm256_set1_ps(scale[2 * i + 1]) : s;
      const __m256 m = kind == Q4_1 ? _mm256_set1_ps(min[i]) : _mm256_setzero_ps();
      for (int j = 0; j < 4; ++j) {
        __m256 v = _mm256_mul_ps(q[j], j < 2 ? s : s_hi);
        if (kind == Q4_1) v = _mm256_add_ps(v, m);
        _mm256_storeu_ps(w + r * KC + k + 8 * j, v);
      }
    }
  }
}

/* acc[r][0:8 NV] (+)= sum_k w[r][k] * xt[k][0:8 NV] for r < R, k < kn (xt's rows xs
 * floats apart), accumulating into yt [R][ys] (rows of y transposed); the first slice
 * starts from zero. */
static inline __attribute__((always_inline)) void outer_product(
    const int NV, const int R, const float *xt, int64_t xs, const float *w, int64_t kn,
    float *yt, int64_t ys, int first) {
  __m256 acc[NR][4];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v)
      acc[r][v] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(yt + r * ys + 8 * v);
  for (int64_t k = 0; k < kn; ++k) {
    __m256 b[NR];
    for (int r = 0; r < R; ++r) b[r] = _mm256_broadcast_ss(w + r * KC + k);
    for (int v = 0; v < NV; ++v) {
      const __m256 xv = _mm256_loadu_ps(xt + k * xs + 8 * v);
      for (int r = 0; r < R; ++r) acc[r][v] = _mm256_fmadd_ps(b[r], xv, acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) _mm256_storeu_ps(yt + r * ys + 8 * v, acc[r][v]);
}

/* Rows [0, 8 nv) of transposed x against weight rows [n0, n0 + nr). */
static void outer_product_any(int nv, int nr, const float *xt, int64_t xs, const float *w,
                              int64_t kn, float *yt, int64_t ys, int first) {
  /* Constant shapes let the compiler keep the accumulators in registers. */
#define CASE(V, R) \
  if (nv == V && nr == R) return outer_product(V, R, xt, xs, w, kn, yt, ys, first);
  CASE(4, 3) CASE(4, 2) CASE(4, 1) CASE(3, 3) CASE(3, 2) CASE(3, 1)
  CASE(2, 3) CASE(2, 2) CASE(2, 1) CASE(1, 3) CASE(1, 2) CASE(1, 1)
#undef CASE
}

/* dst[j][i] = src[i][j] for i < rows, j < cols (both at most 8): 8 x 8 in registers
 * when whole, element by element at the edges. */
static inline void transpose8(const float *src, int64_t src_stride, float *dst,
                              int64_t dst_stride, int64_t rows, int64_t cols) {
  if (rows < 8 || cols < 8) {
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < cols; ++j) dst[j * dst_stride + i] = src[i * src_stride + j];
    return;
  }
  __m256 r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * src_stride);
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  /* r[0..3] hold columns (0 1 2 3 | 4 5 6 7) of rows 0-3, r[4..7] of rows 4-7. */
  for (int j = 0; j < 4; ++j) {
    _mm256_storeu_ps(dst + j * dst_stride, _mm256_permute2f128_ps(r[j], r[j + 4], 0x20));
    _mm256_storeu_ps(dst + (j + 4) * dst_stride, _mm256_permute2f128_ps(r[j], r[j + 4], 0x31));
  }
}

/* y[m][n - col0] = yt[n - n0][m] for m < M, n in [n0, n1) (rows of y ys floats apart,
 * of yt mp). Eight rows of y at a time, all their columns, so that each of y's cache
 * lines is written whole before the next rows: where ys is a multiple of 1,024 floats
 * (the gate/up projection's 3,072, the LM head's 49,152), every row of y falls in the
 * same L1 set, and going down the rows eight columns at a time lost each line between
 * its two halves. */
static inline void store_transposed(const float *yt, int64_t mp, int64_t M, float *y,
                                    int64_t ys, int64_t col0, int64_t n0, int64_t n1) {
  for (int64_t m = 0; m < M; m += 8)
    for (int64_t n = n0; n < n1; n += 8)
      transpose8(yt + (n - n0) * mp + m, mp, y + m * ys + n - col0, ys,
                 n1 - n < 8 ? n1 - n : 8, M - m < 8 ? M - m : 8);
}

/* Weight rows [n0, n1) against all M rows of x, transposed and padded to mp rows in
 * tiles of MT: tile m0 is [K][tile width] at xt + m0 * K (see tile_width). */
static void panel_chunk(int kind, const float *xt, int64_t M, int64_t mp, int64_t K,
                        const uint8_t *qs, const float *scale, const float *min, float *y,
                        int64_t ys, int64_t col0, int64_t n0, int64_t n1, float *w,
                        float *yt) {
  const int64_t nb = K / BLOCK;
  /* A tile of x at a time, so that its slice (KC x MT floats, contiguous) stays in L1
   * however many rows there are; this chunk's weights stay in L2 across the tiles. */
  for (int64_t m0 = 0; m0 < mp; m0 += MT) {
    const int64_t tw = tile_width(mp, m0);
    for (int64_t k0 = 0; k0 < K; k0 += KC) {
      const int64_t kn = K - k0 < KC ? K - k0 : KC;
      for (int64_t n = n0; n < n1; n += NR) {
        const int nr = n1 - n < NR ? (int)(n1 - n) : NR;
        dequantize_rows(kind, qs, scale, min, nb, n, nr, k0, kn, w);
        outer_product_any((int)tw / 8, nr, xt + m0 * K + k0 * tw, tw, w, kn,
                          yt + (n - n0) * mp + m0, mp, k0 == 0);
      }
    }
  }
  store_transposed(yt, mp, M, y, ys, col0, n0, n1);
}

/* The panel on AVX-512 (where avx512_usable): a vector carries 16 rows of x, so one
 * broadcast weight feeds twice the rows, and a micro-kernel takes NR512 weight rows
 * (2 x 12 accumulators and 2 vectors of x fit 32 zmm). Same products, same layout of
 * transposed x (tiles of MT rows, padded to 16). */
#define NR512 12
_Static_assert(NC % NR512 == 0 && MT % 16 == 0, "a chunk is whole micro-kernels");

static inline AVX512 __attribute__((always_inline)) void dequantize_rows512(
    int kind, const uint8_t *qs, const float *scale, const float *min, int64_t nb, int64_t n0,
    int nr, int64_t k0, int64_t kn, float *w) {
  const int64_t block_bytes = kind == Q4_1 ? BLOCK / 2 : BLOCK;
  for (int r = 0; r < nr; ++r) {
    for (int64_t k = 0; k < kn; k += BLOCK) {
      const int64_t i = (n0 + r) * nb + (k0 + k) / BLOCK;
      __m512 q[2];
      unpack512(kind, qs + i * block_bytes, q);
      /* Q8_16: the first 16 weights take the block's first scale, the others its second. */
      const __m512 s = _mm512_set1_ps(kind == Q8_16 ? scale[2 * i] : scale[i]);
      const __m512 s_hi = kind == Q8_16 ? _mm512_set1_ps(scale[2 * i + 1]) : s;
      __m512 lo = _mm512_mul_ps(q[0], s), hi = _mm512_mul_ps(q[1], s_hi);
      if (kind == Q4_1) {
        const __m512 m = _mm512_set1_ps(min[i]);
        lo = _mm512_add_ps(lo, m);
        hi = _mm512_add_ps(hi, m);
      }
      _mm512_storeu_ps(w + r * KC + k, lo);
      _mm512_storeu_ps(w + r * KC + k + 16, hi);
    }
  }
}

/* outer_product() with 16 rows of x a vector: NV vectors, R weight rows. */
static inline AVX512 __attribute__((always_inline)) void outer_product512(
    const int NV, const int R, const float *xt, int64_t xs, const float *w, int64_t kn,
    float *yt, int64_t ys, int first) {
  __m512 acc[NR512][MT / 16];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v)
      acc[r][v] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(yt + r * ys + 16 * v);
  for (int64_t k = 0; k < kn; ++k) {
    __m512 xv[MT / 16];
    for (int v = 0; v < NV; ++v) xv[v] = _mm512_loadu_ps(xt + k * xs + 16 * v);
    for (int r = 0; r < R; ++r) {
      const __m512 b = _mm512_set1_ps(w[r * KC + k]);
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_fmadd_ps(b, xv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(yt + r * ys + 16 * v, acc[r][v]);
}

static AVX512 void outer_product512_any(int nv, int nr, const float *xt, int64_t xs,
                                        const float *w, int64_t kn, float *yt, int64_t ys,
                                        int first) {
#define CASE(V, R) \
  if (nv == V && nr == R) return outer_product512(V, R, xt, xs, w, kn, yt, ys, first);
  CASE(2, 12) CASE(1, 12) CASE(2, 11) CASE(1, 11) CASE(2, 10) CASE(1, 10) CASE(2, 9)
  CASE(1, 9) CASE(2, 8) CASE(1, 8) CASE(2, 7) CASE(1, 7) CASE(2, 6) CASE(1, 6) CASE(2, 5)
  CASE(1, 5) CASE(2, 4) CASE(1, 4) CASE(2, 3) CASE(1, 3) CASE(2, 2) CASE(1, 2) CASE(2, 1)
  CASE(1, 1)
#undef CASE
}

/* panel_chunk() on AVX-512 (mp a multiple of 16). */
static inline AVX512 __attribute__((always_inline)) void panel_body512(
    int kind, const float *xt, int64_t M, int64_t mp, int64_t K, const uint8_t *qs,
    const float *scale, const float *min, float *y, int64_t ys, int64_t col0, int64_t n0,
    int64_t n1, float *w, float *yt) {
  const int64_t nb = K / BLOCK;
  for (int64_t k0 = 0; k0 < K; k0 += KC) {
    const int64_t kn = K - k0 < KC ? K - k0 : KC;
    for (int64_t n = n0; n < n1; n += NR512) {
      const int nr = n1 - n < NR512 ? (int)(n1 - n) : NR512;
      dequantize_rows512(kind, qs, scale, min, nb, n, nr, k0, kn, w);
      for (int64_t m0 = 0; m0 < mp; m0 += MT) {
        const int64_t tw = tile_width(mp, m0);
        outer_product512_any((int)tw / 16, nr, xt + m0 * K + k0 * tw, tw, w, kn,
                             yt + (n - n0) * mp + m0, mp, k0 == 0);
      }
    }
  }
  store_transposed(yt, mp, M, y, ys, col0, n0, n1);
}

/* panel_body512() with the kind a constant in each call. */
static AVX512 void panel_chunk512(int kind, const float *xt, int64_t M, int64_t mp, int64_t K,
                                  const uint8_t *qs, const float *scale, const float *min,
                                  float *y, int64_t ys, int64_t col0, int64_t n0, int64_t n1,
                                  float *w, float *yt) {
  if (kind == Q4_1)
    panel_body512(Q4_1, xt, M, mp, K, qs, scale, min, y, ys, col0, n0, n1, w, yt);
  else if (kind == Q8_0)
    panel_body512(Q8_0, xt, M, mp, K, qs, scale, min, y, ys, col0, n0, n1, w, yt);
  else
    panel_body512(Q8_16, xt, M, mp, K, qs, scale, min, y, ys, col0, n0, n1, w, yt);
}

/* Weight rows [n0, n1) for every row of x, written to y (rows ys floats apart, its
 * first column weight row col0), on either width, the kind a constant in each call. */
static void panel_rows(int wide, int kind, const float *xt, int64_t M, int64_t mp, int64_t K,
                       const uint8_t *qs, const float *scale, const float *min, float *y,
                       int64_t ys, int64_t col0, int64_t n0, int64_t n1, float *w, float *yt) {
  if (wide)
    panel_chunk512(kind, xt, M, mp, K, qs, scale, min, y, ys, col0, n0, n1, w, yt);
  else if (kind == Q4_1)
    panel_chunk(Q4_1, xt, M, mp, K, qs, scale, min, y, ys, col0, n0, n1, w, yt);
  else if (kind == Q8_0)
    panel_chunk(Q8_0, xt, M, mp, K, qs, scale, min, y, ys, col0, n0, n1, w, yt);
  else
    panel_chunk(Q8_16, xt, M, mp, K, qs, scale, min, y, ys, col0, n0, n1, w, yt);
}

/* Columns [k_lo, k_hi) of x (whole blocks) transposed into xt's tiles (see
 * panel_chunk). */
static void transpose_x(const float *x, int64_t M, int64_t mp, int64_t K, int64_t k_lo,
                        int64_t k_hi, float *xt) {
  for (int64_t k0 = k_lo; k0 < k_hi; k0 += BLOCK)
    for (int64_t m = 0; m < M; m += 8)
      for (int64_t k = k0; k < k0 + BLOCK; k += 8)
        transpose8(x + m * K + k, K, xt + m / MT * MT * K + k * tile_width(mp, m) + m % MT,
                   tile_width(mp, m), M - m < 8 ? M - m : 8, 8);
}

/* A team helper's item, output columns [n0, n1) of M rows packed in its scratch
 * ([M][n1 - n0]), copied to their places in y (rows N floats apart). */
static void commit_columns(const float *scratch, int64_t M, int64_t n0, int64_t n1, float *y,
                           int64_t N) {
  for (int64_t m = 0; m < M; ++m)
    memcpy(y + m * N + n0, scratch + m * (n1 - n0), sizeof(float) * (size_t)(n1 - n0));
}

/* Up to team_rows() rows the panel runs as a work-team loop (work_team.h), an item NC
 * weight rows, so that a thread the OS takes away never holds the step up; its buffers
 * then fit on the stack. The lead transposes x into the team's arena alone (a helper
 * late on an item reads it). */
typedef struct {
  int wide, kind;
  const float *xt, *scale, *min;
  const uint8_t *qs;
  float *y;
  int64_t M, mp, K, N;
} PanelLoop;

static void panel_run(const void *ctx, int64_t item, float *scratch) {
  const PanelLoop *l = ctx;
  const int64_t n0 = item * NC, n1 = n0 + NC < l->N ? n0 + NC : l->N;
  float w[NR512 * KC] __attribute__((aligned(64)));
  float yt[NC * TEAM_MAX_ROWS] __attribute__((aligned(64)));
  if (scratch == NULL)
    panel_rows(l->wide, l->kind, l->xt, l->M, l->mp, l->K, l->qs, l->scale, l->min, l->y, l->N,
               0, n0, n1, w, yt);
  else
    panel_rows(l->wide, l->kind, l->xt, l->M, l->mp, l->K, l->qs, l->scale, l->min, scratch,
               n1 - n0, n0, n0, n1, w, yt);
}

static void panel_commit(const void *ctx, int64_t item, const float *scratch) {
  const PanelLoop *l = ctx;
  const int64_t n0 = item * NC, n1 = n0 + NC < l->N ? n0 + NC : l->N;
  commit_columns(scratch, l->M, n0, n1, l->y, l->N);
}

static int64_t panel_scratch(const void *ctx) { return ((const PanelLoop *)ctx)->M * NC; }

static int panel_team(int wide, int kind, const float *x, int64_t M, int64_t mp, int64_t K,
                      const uint8_t *qs, const float *scale, const float *min, float *y,
                      int64_t N, int num_threads) {
  float *xt = team_arena(sizeof(float) * K * mp);
  if (xt == NULL) return -1;
  if (mp != M) memset(xt, 0, sizeof(float) * (size_t)(K * mp)); /* the padding rows */
  transpose_x(x, M, mp, K, 0, K, xt);
  const PanelLoop loop = {wide, kind, xt, scale, min, qs, y, M, mp, K, N};
  const TeamLoop team = {panel_run, panel_commit, panel_scratch, (N + NC - 1) / NC};
  if (team_run(&team, &loop, sizeof loop, num_threads) == 0) return 0;
  for (int64_t c = 0; c < team.items; ++c) panel_run(&loop, c, NULL);
  return 0;
}

static int panel_matmul(int kind, const float *x, int64_t M, int64_t K, const uint8_t *qs,
                        const float *scale, const float *min, float *y, int64_t N,
                        int num_threads) {
  const int wide = avx512_usable();
  const int64_t mp = wide ? (M + 15) / 16 * 16 : (M + 7) / 8 * 8;
  if (num_threads > 1 && M <= team_rows())
    return panel_team(wide, kind, x, M, mp, K, qs, scale, min, y, N, num_threads);
  float *xt = calloc((size_t)(K * mp), sizeof(float));
  if (xt == NULL) return -1;
  const int64_t chunks = (N + NC - 1) / NC;
  int status = 0;
#pragma omp parallel num_threads(num_threads)
  {
    float *w = malloc(sizeof(float) * (wide ? NR512 : NR) * KC);
    float *yt = malloc(sizeof(float) * (size_t)(NC * mp));
    if (w == NULL || yt == NULL) {
#pragma omp atomic write
      status = -1;
    }
#pragma omp for schedule(static)
    for (int64_t k0 = 0; k0 < K; k0 += BLOCK) transpose_x(x, M, mp, K, k0, k0 + BLOCK, xt);
    /* Dynamic: on a machine shared with other processes (a serving replica's own
     * router, say) a thread the OS takes away leaves its remaining chunks to the
     * others instead of holding every thread at the barrier until it is back. */
#pragma omp for schedule(dynamic)
    for (int64_t c = 0; c < chunks; ++c) {
      if (w == NULL || yt == NULL) continue;
      const int64_t n0 = c * NC, n1 = n0 + NC < N ? n0 + NC : N;
      panel_rows(wide, kind, xt, M, mp, K, qs, scale, min, y, N, 0, n0, n1, w, yt);
    }
    free(w);
    free(yt);
  }
  free(xt);
  return status;
}

/* Weight rows [n0, n1) for every row of x, 16 at a time (chunk's kind a constant);
 * wide: on AVX-512. */
static void rows_of(int wide, int kind, const float *x, int64_t M, int64_t K, const uint8_t *qs,
                    const float *scale, const float *min, const float *block_sums, float *y,
                    int64_t ys, int64_t col0, int64_t n0, int64_t n1) {
  for (int64_t c0 = n0; c0 < n1; c0 += N_CHUNK) {
    const int64_t c1 = c0 + N_CHUNK < n1 ? c0 + N_CHUNK : n1;
    if (wide)
      chunk512(kind, x, M, K, qs, scale, min, block_sums, y, ys, col0, c0, c1);
    else if (kind == Q4_1)
      chunk(Q4_1, x, M, K, qs, scale, min, block_sums, y, ys, col0, c0, c1);
    else if (kind == Q8_0)
      chunk(Q8_0, x, M, K, qs, scale, min, block_sums, y, ys, col0, c0, c1);
    else
      chunk(Q8_16, x, M, K, qs, scale, min, block_sums, y, ys, col0, c0, c1);
  }
}

/* A few rows of x as a work-team loop (work_team.h): an item is `width` weight rows. */
typedef struct {
  int wide, kind;
  const float *x, *block_sums, *scale, *min;
  const uint8_t *qs;
  float *y;
  int64_t M, K, N, width;
} RowsLoop;

static void rows_run(const void *ctx, int64_t item, float *scratch) {
  const RowsLoop *l = ctx;
  const int64_t n0 = item * l->width, n1 = n0 + l->width < l->N ? n0 + l->width : l->N;
  if (scratch == NULL)
    rows_of(l->wide, l->kind, l->x, l->M, l->K, l->qs, l->scale, l->min, l->block_sums, l->y,
            l->N, 0, n0, n1);
  else
    rows_of(l->wide, l->kind, l->x, l->M, l->K, l->qs, l->scale, l->min, l->block_sums,
            scratch, n1 - n0, n0, n0, n1);
}

static void rows_commit(const void *ctx, int64_t item, const float *scratch) {
  const RowsLoop *l = ctx;
  const int64_t n0 = item * l->width, n1 = n0 + l->width < l->N ? n0 + l->width : l->N;
  commit_columns(scratch, l->M, n0, n1, l->y, l->N);
}

static int64_t rows_scratch(const void *ctx) {
  const RowsLoop *l = ctx;
  return l->M * l->width;
}

/* x's block sums (Q4_1's minimum term): sums[i] over the M * K / BLOCK blocks. */
static void block_sums_of(const float *x, int64_t blocks, float *sums) {
  for (int64_t i = 0; i < blocks; ++i) {
    const float *v = x + i * BLOCK;
    __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(v), _mm256_loadu_ps(v + 8)),
                             _mm256_add_ps(_mm256_loadu_ps(v + 16), _mm256_loadu_ps(v + 24)));
    sums[i] = hsum(s);
  }
}

/* kind: Q4_1, Q8_0 or Q8_16; min is ignored (may be NULL) but for Q4_1. Returns 0, or
 * -1 when K is not a whole number of blocks, the kind is unknown or scratch memory ran
 * out. */
int baton_block_matmul(int kind, const float *x, int64_t M, int64_t K, const uint8_t *qs,
                       const float *scale, const float *min, float *y, int64_t N,
                       int num_threads) {
  if (K % BLOCK != 0 || (kind != Q4_1 && kind != Q8_0 && kind != Q8_16)) return -1;
  if (M == 0) return 0; /* no rows: a prefill chunk that samples nothing asks no logits */
  if (M > MAX_ROWS) return panel_matmul(kind, x, M, K, qs, scale, min, y, N, num_threads);
  const int64_t nb = K / BLOCK;
  const int64_t chunks = (N + N_CHUNK - 1) / N_CHUNK;
  const int64_t width = N_CHUNK * chunks_per_grab(chunks, num_threads);
  /* x and its block sums in the team's arena: a helper late on an item reads them. */
  float *arena = team_arena(sizeof(float) * (M * K + M * nb));
  if (arena == NULL) return -1;
  memcpy(arena, x, sizeof(float) * (size_t)(M * K));
  if (kind == Q4_1) block_sums_of(arena, M * nb, arena + M * K);
  const int wide = avx512_usable();
  const RowsLoop loop = {wide, kind, arena, arena + M * K, scale, min, qs, y, M, K, N, width};
  const TeamLoop team = {rows_run, rows_commit, rows_scratch, (N + width - 1) / width};
  if (num_threads > 1 && team_run(&team, &loop, sizeof loop, num_threads) == 0) return 0;
  rows_of(wide, kind, arena, M, K, qs, scale, min, arena + M * K, y, N, 0, 0, N);
  return 0;
}
