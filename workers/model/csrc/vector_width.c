/* Whether the kernels' AVX-512 forms run: the library is built for AVX2, and the block
 * matmuls (both paths), the 16-bit rounded matmul, the prefill attention (its products
 * and softmax) and the gated activations have AVX-512 forms too (target attributes),
 * taken where the CPU has AVX512F, BW and DQ, the set torch's own AVX512 capability
 * needs. Tests turn them off to run both. */
#include "simd.h"

static int allowed = 1;

int avx512_usable(void) {
  static int cpu = -1; /* checked once; a race writes the same value */
  if (cpu < 0)
    cpu = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
          __builtin_cpu_supports("avx512dq");
  return cpu && allowed;
}

/* allow = 0 keeps every kernel to AVX2. Returns whether the AVX-512 forms now run. */
int baton_use_avx512(int allow) {
  allowed = allow != 0;
  return avx512_usable();
}
