/* GeGLU's activation over a fused gate|up projection: out[t] = gelu_tanh(gate[t]) * up[t].
 *
 * x   [T, 2 I]: each row's gate then its up half (the gate_up projection's output)
 * out [T, I]
 *
 * gelu_tanh(g) = g / 2 (1 + tanh(u)), u = sqrt(2 / pi) (g + 0.044715 g^3) (transformers'
 * gelu_pytorch_tanh, Gemma's), computed as g / (1 + e^(-2u)), the same value without
 * 1 + tanh(u)'s cancellation for negative g; with exp256's vector exp. torch runs it as
 * three dispatches (a chunk, gelu, a multiply), more overhead than a decode step's
 * arithmetic. Where the CPU has AVX-512 (avx512_usable, vector_width.c) and I is a
 * multiple of 16, 16 lanes at a time with exp512 (equal to rounding).
 */
#include <immintrin.h>
#include <stdint.h>

#include "simd.h"
#include "work_team.h"

/* One row: out[0:I] = gelu_tanh(gate[0:I]) * up[0:I], 8 lanes at a time. */
static void gelu_row(const float *gate, const float *up, int64_t I, float *out) {
  const __m256 one = _mm256_set1_ps(1.0f), cubic = _mm256_set1_ps(0.044715f);
  const __m256 minus_two_root = _mm256_set1_ps(-2.0f * 0.7978845608028654f); /* -2 sqrt(2/pi) */
  for (int64_t i = 0; i < I; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 g3 = _mm256_mul_ps(_mm256_mul_ps(g, g), g);
    const __m256 inner = _mm256_add_ps(g, _mm256_mul_ps(cubic, g3));
    const __m256 e = exp256(_mm256_mul_ps(minus_two_root, inner));
    const __m256 gelu = _mm256_div_ps(g, _mm256_add_ps(one, e));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(gelu, _mm256_loadu_ps(up + i)));
  }
}

/* gelu_row, 16 lanes at a time (I a multiple of 16). */
static __attribute__((target("avx512f,avx512dq"))) void gelu_row512(const float *gate,
                                                                      const float *up,
                                                                      int64_t I, float *out) {
  const __m512 one = _mm512_set1_ps(1.0f), cubic = _mm512_set1_ps(0.044715f);
  const __m512 minus_two_root = _mm512_set1_ps(-2.0f * 0.7978845608028654f);
  for (int64_t i = 0; i < I; i += 16) {
    const __m512 g = _mm512_loadu_ps(gate + i);
    const __m512 g3 = _mm512_mul_ps(_mm512_mul_ps(g, g), g);
    const __m512 inner = _mm512_add_ps(g, _mm512_mul_ps(cubic, g3));
    const __m512 e = exp512(_mm512_mul_ps(minus_two_root, inner));
    const __m512 gelu = _mm512_div_ps(g, _mm512_add_ps(one, e));
    _mm512_storeu_ps(out + i, _mm512_mul_ps(gelu, _mm512_loadu_ps(up + i)));
  }
}

/* Returns 0, or -1 when I is not a multiple of 8. */
int baton_gelu_tanh_mul(const float *x, int64_t T, int64_t I, float *out, int num_threads) {
  if (I % 8 != 0) return -1;
  void (*row)(const float *, const float *, int64_t, float *) =
      I % 16 == 0 && avx512_usable() ? gelu_row512 : gelu_row;
#pragma omp parallel for schedule(dynamic, 4) num_threads(num_threads) \
    if (T > team_rows() && T * I >= 1 << 13)  /* none beside the work team */
  for (int64_t t = 0; t < T; ++t) row(x + t * 2 * I, x + t * 2 * I + I, I, out + t * I);
  return 0;
}
