/* y[M, N] = x[M, K] @ W^T (+ bias) in float32, for a weight W [N, K] laid out once in
 * column panels: panel p holds output columns [48 p, 48 p + 48) as [K][48] floats,
 * the last one padded with zeros.
 *
 * A micro-kernel keeps 8 rows of y by one panel (8 x 3 vectors of 16) in registers and
 * walks all of K: each step loads the panel's 48 weights of one column of W^T and
 * broadcasts each of the 8 rows' x against them. Every output is one chain of fused
 * multiply-adds over k = 0 .. K-1, whatever M is and however the work is split, as in
 * block_matmul.c's panel (whose outputs on the same float32 weights are these).
 *
 * A call is split into tasks of one panel by up to MC rows, handed out by OpenMP as
 * threads come free (schedule(dynamic)): on a machine shared with other processes a
 * thread the OS takes away leaves its tasks to the others, where a static split holds
 * every thread at the call's end until it is back. OpenMP resolves to the libgomp
 * torch already loaded.
 *
 * The AVX-512 form runs where avx512_usable (vector_width.c); the AVX2 one, the same
 * chains in a different register blocking, keeps a packed weight usable when tests
 * turn AVX-512 off. */
#include <immintrin.h>
#include <stdint.h>

#include "simd.h"

#define NP 48  /* output columns per panel */
#define MR 8   /* rows of x per AVX-512 micro-kernel: 8 x 3 accumulators, 3 weight vectors */
#define MR2 2  /* rows per AVX2 micro-kernel: 2 x 6 accumulators */
#define MC 256 /* rows of x per task: its x (MC x K floats) stays in L2 across a panel */
#define AVX512 __attribute__((target("avx512f,avx512dq")))

int baton_dense_panel_width(void) { return NP; }

/* panels[p][k][j] = w[48 p + j][k], zero where 48 p + j >= N. */
int baton_pack_dense(const float *w, int64_t N, int64_t K, float *panels) {
  const int64_t np = (N + NP - 1) / NP;
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < np; ++p)
    for (int64_t j = 0; j < NP; ++j) {
      const int64_t n = p * NP + j;
      float *dst = panels + p * K * NP + j;
      for (int64_t k = 0; k < K; ++k) dst[k * NP] = n < N ? w[n * K + k] : 0.0f;
    }
  return 0;
}

/* Rows [0, R) of y's columns [0, cols) of one panel (cols <= NP); x's rows xs floats
 * apart, y's ys. */
static inline AVX512 __attribute__((always_inline)) void micro512(
    const int R, const float *x, int64_t xs, const float *panel, int64_t K, const float *bias,
    float *y, int64_t ys, int64_t cols) {
  __m512 acc[MR][3];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 3; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m512 w0 = _mm512_loadu_ps(panel + k * NP);
    const __m512 w1 = _mm512_loadu_ps(panel + k * NP + 16);
    const __m512 w2 = _mm512_loadu_ps(panel + k * NP + 32);
    for (int r = 0; r < R; ++r) {
      const __m512 a = _mm512_set1_ps(x[r * xs + k]);
      acc[r][0] = _mm512_fmadd_ps(a, w0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(a, w1, acc[r][1]);
      acc[r][2] = _mm512_fmadd_ps(a, w2, acc[r][2]);
    }
  }
  for (int v = 0; v < 3; ++v) {
    const int64_t left = cols - 16 * v;
    const __mmask16 mask = left >= 16 ? 0xFFFF : left <= 0 ? 0 : (__mmask16)((1u << left) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + 16 * v) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      const __m512 out = bias ? _mm512_add_ps(acc[r][v], b) : acc[r][v];
      _mm512_mask_storeu_ps(y + r * ys + 16 * v, mask, out);
    }
  }
}

static AVX512 void rows512(const float *x, int64_t m0, int64_t m1, int64_t K, const float *panel,
                           const float *bias, float *y, int64_t N, int64_t cols) {
  for (int64_t m = m0; m < m1; m += MR) {
    const float *xm = x + m * K;
    float *ym = y + m * N;
    switch (m1 - m < MR ? m1 - m : MR) {
#define CASE(R) \
  case R:       \
    micro512(R, xm, K, panel, K, bias, ym, N, cols); \
    break;
      CASE(8) CASE(7) CASE(6) CASE(5) CASE(4) CASE(3) CASE(2) CASE(1)
#undef CASE
    }
  }
}

/* micro512() in ymm: R rows by the panel's 6 vectors of 8. */
static inline __attribute__((always_inline)) void micro256(const int R, const float *x,
                                                           int64_t xs, const float *panel,
                                                           int64_t K, const float *bias,
                                                           float *y, int64_t ys,
                                                           int64_t cols) {
  __m256 acc[MR2][6];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 6; ++v) acc[r][v] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k)
    for (int r = 0; r < R; ++r) {
      const __m256 a = _mm256_set1_ps(x[r * xs + k]);
      for (int v = 0; v < 6; ++v)
        acc[r][v] = _mm256_fmadd_ps(a, _mm256_loadu_ps(panel + k * NP + 8 * v), acc[r][v]);
    }
  for (int r = 0; r < R; ++r) {
    float out[NP];
    for (int v = 0; v < 6; ++v) _mm256_storeu_ps(out + 8 * v, acc[r][v]);
    for (int64_t j = 0; j < cols; ++j) y[r * ys + j] = bias ? out[j] + bias[j] : out[j];
  }
}

static void rows256(const float *x, int64_t m0, int64_t m1, int64_t K, const float *panel,
                    const float *bias, float *y, int64_t N, int64_t cols) {
  for (int64_t m = m0; m < m1; m += MR2) {
    if (m1 - m >= 2)
      micro256(2, x + m * K, K, panel, K, bias, y + m * N, N, cols);
    else
      micro256(1, x + m * K, K, panel, K, bias, y + m * N, N, cols);
  }
}

int baton_dense_matmul(const float *x, int64_t M, int64_t K, const float *panels, int64_t N,
                       const float *bias, float *y, int num_threads) {
  const int64_t np = (N + NP - 1) / NP, mblocks = (M + MC - 1) / MC;
  const int wide = avx512_usable();
#pragma omp parallel for schedule(dynamic) collapse(2) num_threads(num_threads)
  for (int64_t mb = 0; mb < mblocks; ++mb)
    for (int64_t p = 0; p < np; ++p) {
      const int64_t m0 = mb * MC, m1 = m0 + MC < M ? m0 + MC : M;
      const int64_t cols = N - p * NP < NP ? N - p * NP : NP;
      const float *b = bias ? bias + p * NP : NULL;
      if (wide)
        rows512(x, m0, m1, K, panels + p * K * NP, b, y + p * NP, N, cols);
      else
        rows256(x, m0, m1, K, panels + p * K * NP, b, y + p * NP, N, cols);
    }
  return 0;
}
