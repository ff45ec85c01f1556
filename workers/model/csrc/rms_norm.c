/* RMSNorm over rows, optionally after adding the residual stream, in one pass.
 *
 * out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * weight
 * With a residual: summed[t] = x[t] + residual[t] (the stream the next layer continues)
 * is what gets normalized.
 *
 * A decode step's rows are small ([batch, hidden]); torch's rms_norm runs them as
 * five or six separate passes, each paying its dispatch, which cost more than the
 * arithmetic. The sum of squares is float32 like torch's; only its order differs.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "simd.h"
#include "work_team.h"

/* Returns 0, or -1 when D is not a multiple of 8. residual and summed are both NULL or
 * both not. */
int baton_rms_norm(const float *x, const float *residual, const float *weight, int64_t T,
                   int64_t D, float eps, float *out, float *summed, int num_threads) {
  if (D % 8 != 0) return -1;
#pragma omp parallel for schedule(static) num_threads(num_threads) \
    if (T > team_rows() && T * D >= 1 << 16)  /* none beside the work team */
  for (int64_t t = 0; t < T; ++t) {
    const float *src = x + t * D;
    if (residual != NULL) {
      const float *r = residual + t * D;
      float *s = summed + t * D;
      for (int64_t d = 0; d < D; d += 8)
        _mm256_storeu_ps(s + d, _mm256_add_ps(_mm256_loadu_ps(src + d), _mm256_loadu_ps(r + d)));
      src = s;
    }
    __m256 sq = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
      const __m256 v = _mm256_loadu_ps(src + d);
      sq = _mm256_fmadd_ps(v, v, sq);
    }
    const __m256 inv = _mm256_set1_ps(1.0f / sqrtf(hsum(sq) / (float)D + eps));
    for (int64_t d = 0; d < D; d += 8) {
      const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(src + d), inv);
      _mm256_storeu_ps(out + t * D + d, _mm256_mul_ps(v, _mm256_loadu_ps(weight + d)));
    }
  }
  return 0;
}
