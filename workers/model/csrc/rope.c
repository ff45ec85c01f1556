/* Rotary position embedding (NeoX half-split layout) over a step's query and key heads.
 *
 * x   [T] rows of H heads of D floats, row t at x + t * row_stride (the q and k heads of
 *     a fused QKV projection's output, read in place)
 * cos, sin [T, D]: the positions' tables, sin signed (-sin | +sin) as rope.py makes them
 * out [T, H, D] contiguous
 *
 * out = x * cos + swap(x) * sin with swap(x) = (x2, x1): multiplies and an add, never
 * fused (the build passes -ffp-contract=off), so the result is what the same torch ops
 * give, in one pass instead of four.
 */
#include <immintrin.h>
#include <stdint.h>

#include "work_team.h"

/* Returns 0, or -1 when D / 2 is not a multiple of 8. */
int baton_rope(const float *x, int64_t row_stride, const float *cos, const float *sin,
               int64_t T, int64_t H, int64_t D, float *out, int num_threads) {
  const int64_t half = D / 2;
  if (D % 16 != 0) return -1;
#pragma omp parallel for schedule(static) num_threads(num_threads) \
    if (T > team_rows() && T * H * D >= 1 << 16)  /* none beside the work team */
  for (int64_t t = 0; t < T; ++t) {
    const float *c = cos + t * D, *s = sin + t * D;
    for (int64_t h = 0; h < H; ++h) {
      const float *src = x + t * row_stride + h * D;
      float *dst = out + (t * H + h) * D;
      for (int64_t d = 0; d < half; d += 8) {
        const __m256 x1 = _mm256_loadu_ps(src + d), x2 = _mm256_loadu_ps(src + half + d);
        const __m256 lo = _mm256_add_ps(_mm256_mul_ps(x1, _mm256_loadu_ps(c + d)),
                                        _mm256_mul_ps(x2, _mm256_loadu_ps(s + d)));
        const __m256 hi = _mm256_add_ps(_mm256_mul_ps(x2, _mm256_loadu_ps(c + half + d)),
                                        _mm256_mul_ps(x1, _mm256_loadu_ps(s + half + d)));
        _mm256_storeu_ps(dst + d, lo);
        _mm256_storeu_ps(dst + half + d, hi);
      }
    }
  }
  return 0;
}
