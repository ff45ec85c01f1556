/* SwiGLU's activation over a fused gate|up projection: out[t] = silu(gate[t]) * up[t].
 *
 * x   [T, 2 I]: each row's gate then its up half (the gate_up projection's output)
 * out [T, I]
 *
 * silu(g) = g / (1 + e^-g), with exp256's vector exp; torch runs the same as three
 * dispatches (a chunk, silu, a multiply) whose overhead outweighs a decode step's few
 * rows of arithmetic. Where the CPU has AVX-512 (avx512_usable, vector_width.c) and I
 * is a multiple of 16, 16 lanes at a time with exp512 (equal to rounding).
 */
#include <immintrin.h>
#include <stdint.h>

#include "simd.h"
#include "work_team.h"

/* One row: out[0:I] = silu(gate[0:I]) * up[0:I], 8 lanes at a time. */
static void silu_row(const float *gate, const float *up, int64_t I, float *out) {
  const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
  for (int64_t i = 0; i < I; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(one, exp256(_mm256_sub_ps(zero, g))));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(silu, _mm256_loadu_ps(up + i)));
  }
}

/* silu_row, 16 lanes at a time (I a multiple of 16). */
static __attribute__((target("avx512f,avx512dq"))) void silu_row512(const float *gate,
                                                                      const float *up,
                                                                      int64_t I, float *out) {
  const __m512 one = _mm512_set1_ps(1.0f), zero = _mm512_setzero_ps();
  for (int64_t i = 0; i < I; i += 16) {
    const __m512 g = _mm512_loadu_ps(gate + i);
    const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(one, exp512(_mm512_sub_ps(zero, g))));
    _mm512_storeu_ps(out + i, _mm512_mul_ps(silu, _mm512_loadu_ps(up + i)));
  }
}

/* Returns 0, or -1 when I is not a multiple of 8. */
int baton_silu_mul(const float *x, int64_t T, int64_t I, float *out, int num_threads) {
  if (I % 8 != 0) return -1;
  void (*row)(const float *, const float *, int64_t, float *) =
      I % 16 == 0 && avx512_usable() ? silu_row512 : silu_row;
#pragma omp parallel for schedule(dynamic, 4) num_threads(num_threads) \
    if (T > team_rows() && T * I >= 1 << 13)  /* none beside the work team */
  for (int64_t t = 0; t < T; ++t) row(x + t * 2 * I, x + t * 2 * I + I, I, out + t * I);
  return 0;
}
