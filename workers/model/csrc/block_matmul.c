/* y[M, N] = x[M, K] @ W^T for a weight W [N, K] kept in GGUF's blocks of 32 along K.
 *
 * Q4_1: w = scale * q + min with q in [0, 15], 16 bytes per block, byte j holding q[j]
 *       in its low nibble and q[j + 16] in its high one (GGUF's own layout).
 * Q8_0: w = scale * q with q in [-128, 127], 32 bytes per block.
 *
 * The weights stay 4 / 8 bits in memory and become float32 in registers, so a decode
 * step that streams every weight once reads 6.4x / 3.8x fewer bytes than a float32
 * copy of them. The sum is float32 throughout: sum_b scale_b * (q_b . x_b) (+ min_b *
 * sum(x_b)), which equals the dequantized float32 matmul up to rounding order.
 *
 * Built by workers/model/block_matmul.py with -mavx2 -mfma -fopenmp; OpenMP resolves to
 * the libgomp torch already loaded, so these loops share torch's thread pool.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#define BLOCK 32
#define MAX_ROWS 8    /* rows of x per pass: 4 weight vectors + 8 accumulators fit in 16 ymm */
#define N_CHUNK 16    /* weight rows one thread takes at a time; they stay in L1 across passes */

enum { Q4_1 = 0, Q8_0 = 1 };

static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

static inline __attribute__((always_inline)) void unpack(int kind, const uint8_t *p, __m256 q[4]) {
  if (kind == Q4_1) {
    const __m128i b = _mm_loadu_si128((const __m128i *)p);
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(b, mask);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
    q[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    q[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    q[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    q[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
  } else {
    for (int i = 0; i < 4; ++i)
      q[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8 * i))));
  }
}

/* Rows [m0, m0 + R) of y for weight rows [n0, n1). */
static inline __attribute__((always_inline)) void tile(
    int kind, const int R, const float *x, int64_t K, const uint8_t *qs, const float *scale,
    const float *min, const float *block_sums, float *y, int64_t N, int64_t n0, int64_t n1,
    int64_t m0) {
  const int64_t nb = K / BLOCK;
  const int64_t block_bytes = kind == Q4_1 ? BLOCK / 2 : BLOCK;
  for (int64_t n = n0; n < n1; ++n) {
    __m256 acc[MAX_ROWS];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    const uint8_t *row = qs + n * nb * block_bytes;
    for (int64_t b = 0; b < nb; ++b) {
      __m256 q[4];
      unpack(kind, row + b * block_bytes, q);
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
      float out = hsum(acc[r]);
      if (kind == Q4_1) {
        const float *mins = min + n * nb, *sums = block_sums + (m0 + r) * nb;
        for (int64_t b = 0; b < nb; ++b) out += mins[b] * sums[b];
      }
      y[(m0 + r) * N + n] = out;
    }
  }
}

static void chunk(int kind, const float *x, int64_t M, int64_t K, const uint8_t *qs,
                  const float *scale, const float *min, const float *block_sums, float *y,
                  int64_t N, int64_t n0, int64_t n1) {
  int64_t m0 = 0;
  for (; m0 + MAX_ROWS <= M; m0 += MAX_ROWS)
    tile(kind, MAX_ROWS, x, K, qs, scale, min, block_sums, y, N, n0, n1, m0);
  /* The constant R lets the compiler keep each remainder's accumulators in registers. */
  switch (M - m0) {
#define REST(R) case R: tile(kind, R, x, K, qs, scale, min, block_sums, y, N, n0, n1, m0); break;
    REST(7) REST(6) REST(5) REST(4) REST(3) REST(2) REST(1)
#undef REST
    default: break;
  }
}

/* kind: Q4_1 or Q8_0; min is ignored (may be NULL) for Q8_0. Returns 0, or -1 when
 * K is not a whole number of blocks or scratch memory ran out. */
int baton_block_matmul(int kind, const float *x, int64_t M, int64_t K, const uint8_t *qs,
                       const float *scale, const float *min, float *y, int64_t N,
                       int num_threads) {
  if (K % BLOCK != 0 || (kind != Q4_1 && kind != Q8_0)) return -1;
  const int64_t nb = K / BLOCK;
  float *block_sums = NULL;
  if (kind == Q4_1) {
    block_sums = malloc(sizeof(float) * (size_t)(M * nb));
    if (block_sums == NULL) return -1;
    for (int64_t i = 0; i < M * nb; ++i) {
      const float *v = x + i * BLOCK;
      __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(v), _mm256_loadu_ps(v + 8)),
                               _mm256_add_ps(_mm256_loadu_ps(v + 16), _mm256_loadu_ps(v + 24)));
      block_sums[i] = hsum(s);
    }
  }
  const int64_t chunks = (N + N_CHUNK - 1) / N_CHUNK;
#pragma omp parallel for schedule(static) num_threads(num_threads)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t n0 = c * N_CHUNK, n1 = n0 + N_CHUNK < N ? n0 + N_CHUNK : N;
    if (kind == Q4_1)
      chunk(Q4_1, x, M, K, qs, scale, min, block_sums, y, N, n0, n1);
    else
      chunk(Q8_0, x, M, K, qs, scale, min, block_sums, y, N, n0, n1);
  }
  free(block_sums);
  return 0;
}
