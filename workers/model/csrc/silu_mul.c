/* SwiGLU's activation over a fused gate|up projection: out[t] = silu(gate[t]) * up[t].
 *
 * x   [T, 2 I]: each row's gate then its up half (the gate_up projection's output)
 * out [T, I]
 *
 * silu(g) = g / (1 + e^-g), with exp256's vector exp; torch runs the same as three
 * dispatches (a chunk, silu, a multiply) whose overhead outweighs a decode step's few
 * rows of arithmetic.
 */
#include <immintrin.h>
#include <stdint.h>

#include "simd.h"
#include "work_team.h"

/* Returns 0, or -1 when I is not a multiple of 8. */
int baton_silu_mul(const float *x, int64_t T, int64_t I, float *out, int num_threads) {
  if (I % 8 != 0) return -1;
  const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
#pragma omp parallel for schedule(dynamic, 4) num_threads(num_threads) \
    if (T > TEAM_MAX_ROWS && T * I >= 1 << 13)  /* none beside the work team */
  for (int64_t t = 0; t < T; ++t) {
    const float *gate = x + t * 2 * I, *up = gate + I;
    for (int64_t i = 0; i < I; i += 8) {
      const __m256 g = _mm256_loadu_ps(gate + i);
      const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(one, exp256(_mm256_sub_ps(zero, g))));
      _mm256_storeu_ps(out + t * I + i, _mm256_mul_ps(silu, _mm256_loadu_ps(up + i)));
    }
  }
  return 0;
}
