/* The GGUF weight blocks block_matmul.c and rounded_matmul.c read (included, not compiled on
 * its own): 32 weights a block along K, in one of three kinds whose ids are
 * block_matmul.py's KIND_IDS. */
#ifndef BATON_BLOCK_KINDS_H
#define BATON_BLOCK_KINDS_H

#include <stdint.h>

#define BLOCK 32
#define N_CHUNK 16 /* weight rows one thread takes at a time; they stay in L1 across passes */

enum { Q4_1 = 0, Q8_0 = 1, Q8_16 = 2 };

/* Chunks of N_CHUNK rows a thread takes per grab of a dynamic schedule: about
 * GRABS_PER_THREAD grabs each. A grab is an atomic on a counter both cores write (a few
 * hundred ns); one chunk of a one-row step is under a microsecond of work, so grabbing
 * chunks one by one cost a 2-thread step a third of its time. A few grabs a thread still
 * let the others take over the rest of a thread the OS preempts. */
#define GRABS_PER_THREAD 8
static inline int64_t chunks_per_grab(int64_t chunks, int num_threads) {
  const int64_t c = chunks / ((int64_t)GRABS_PER_THREAD * num_threads);
  return c > 1 ? c : 1;
}

/* y[M, N] = x[M, K] @ W^T, exact (block_matmul.c) and with one row of x rounded to 16
 * or 8 bits (rounded_matmul.c). */
int baton_block_matmul(int kind, const float *x, int64_t M, int64_t K, const uint8_t *qs,
                       const float *scale, const float *min, float *y, int64_t N,
                       int num_threads);
int baton_block_matmul_rounded(int bits, int kind, const float *x, int64_t M, int64_t K,
                               const uint8_t *qs, const float *scale, const float *min,
                               float *y, int64_t N, int num_threads);

#endif
