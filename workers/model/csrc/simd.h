/* AVX2 helpers shared by Baton's CPU kernels, and exp512 for their AVX-512 forms (included,
 * not compiled on its own). */
#ifndef BATON_SIMD_H
#define BATON_SIMD_H

#include <immintrin.h>

/* Whether the kernels' AVX-512 forms run (vector_width.c). */
int avx512_usable(void);

/* The sum of a vector's 8 floats. */
static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

/* sum_i mins[i] * sums[i] over n blocks (Q4_1's minimum term), spread over eight lanes. */
static inline __m256 min_dot(const float *mins, const float *sums, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(mins + i), _mm256_loadu_ps(sums + i), acc);
  float rest = 0.0f;
  for (; i < n; ++i) rest += mins[i] * sums[i];
  return _mm256_add_ps(acc, _mm256_setr_ps(rest, 0, 0, 0, 0, 0, 0, 0));
}

/* e^x for each lane, within 2 ulp of expf for x in [-87, 88] (lanes below give ~0):
 * x = n ln2 + r with |r| <= ln2 / 2, e^r from a degree-6 polynomial (Cephes' expf
 * coefficients), times 2^n put straight into the exponent bits. */
static inline __m256 exp256(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)),
                    _mm256_set1_ps(-87.3365447504019f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  /* ln2 split in two so that n * hi is exact and r keeps its low bits. */
  x = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f)));
  x = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(-2.12194440e-4f)));
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_add_ps(_mm256_mul_ps(p, x), _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_add_ps(_mm256_mul_ps(p, x), _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_add_ps(_mm256_mul_ps(p, x), _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_add_ps(_mm256_mul_ps(p, x), _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_add_ps(_mm256_mul_ps(p, x), _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_add_ps(_mm256_mul_ps(p, _mm256_mul_ps(x, x)), x);
  p = _mm256_add_ps(p, _mm256_set1_ps(1.0f));
  const __m256i biased = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
  return _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(biased, 23)));
}

/* exp256's steps on 16 lanes, the polynomial in fused multiply-adds (so its last bits
 * may differ from exp256's: the two vector widths agree to rounding, not bit for bit). */
static inline __attribute__((target("avx512f,avx512dq"))) __m512 exp512(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f)),
                    _mm512_set1_ps(-87.3365447504019f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), x);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, x, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, x, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, x, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, x, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, x, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(x, x), x);
  p = _mm512_add_ps(p, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n); /* p * 2^n */
}

#endif
