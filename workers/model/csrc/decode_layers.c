/* A pure-decode step through every layer of a Llama-family model, in one call.
 *
 * The layer is the one models/llama.py runs: RMSNorm (with the residual add), the fused
 * QKV projection, rope, the KV write, paged decode attention, the output projection,
 * RMSNorm, the fused gate/up projection, SwiGLU and the down projection; then the final
 * norm. Each part is the same kernel, called with the same arguments, as the module
 * path calls through ctypes, so the floats are the same bit for bit. What goes is the
 * per-call cost in Python: about ten calls a layer, each with its tensor allocations,
 * views and argument conversion, which was a third of a one-sequence step.
 *
 * Every projection must be in GGUF blocks (block_matmul.c) and the cache float32; the
 * Python side (fused_decode.py) checks that once and builds the layer table.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "block_kinds.h"

int baton_rms_norm(const float *x, const float *residual, const float *weight, int64_t T,
                   int64_t D, float eps, float *out, float *summed, int num_threads);
int baton_rope(const float *x, int64_t row_stride, const float *cos, const float *sin,
               int64_t T, int64_t H, int64_t D, float *out, int num_threads);
int baton_write_kv(const float *k, int64_t k_row_stride, const float *v, int64_t v_row_stride,
                   const int64_t *slots, int64_t T, int Hkv, int D, float *k_cache,
                   float *v_cache, int64_t num_slots);
int baton_paged_decode_attention(const float *q, const float *k_cache, const float *v_cache,
                                 int64_t num_slots, const int64_t *tables, int64_t max_blocks,
                                 const int64_t *lengths, int64_t B, int Hq, int Hkv, int D,
                                 int block_size, float scale, int64_t window, float *out,
                                 int num_threads);
int baton_silu_mul(const float *x, int64_t T, int64_t I, float *out, int num_threads);

/* One projection y [T, n] = x [T, k] @ W^T: W's blocks as block_matmul takes them. */
typedef struct {
  int64_t kind, n, k;
  const uint8_t *qs;
  const float *scale, *min;
} BatonProjection;

/* One layer's weights and cache; its KV-cache group's view of the step is
 * groups[kv_group]. window: the sliding window, 0 for full attention. */
typedef struct {
  const float *input_norm, *post_attention_norm;
  BatonProjection qkv, o, gate_up, down;
  float *k_cache, *v_cache;
  int64_t num_slots, kv_group, window;
} BatonDecodeLayer;

/* A KV-cache group's view of the step: the slot each row writes, the block tables
 * [T, max_blocks] and the context lengths [T] (this step's token included). */
typedef struct {
  const int64_t *slots, *tables, *lengths;
  int64_t max_blocks;
} BatonDecodeGroup;

/* The model's shape, the attention's constants, and the bits the projections round a
 * one-row input to (16 or 8, rounded_matmul.c), or 32: exact. */
typedef struct {
  int64_t hidden, heads, kv_heads, head_dim, intermediate;
  float eps, scale;
  int64_t activation_bits;
} BatonDecodeShape;

static int project(const BatonDecodeShape *shape, const BatonProjection *p, const float *x,
                   int64_t T, float *y, int num_threads) {
  if (shape->activation_bits == 32)
    return baton_block_matmul((int)p->kind, x, T, p->k, p->qs, p->scale, p->min, y, p->n,
                              num_threads);
  return baton_block_matmul_rounded((int)shape->activation_bits, (int)p->kind, x, T, p->k, p->qs,
                                    p->scale, p->min, y, p->n, num_threads);
}

/* x [T, hidden]: the step's embeddings in (overwritten); out [T, hidden]: the final
 * norm's output. block_size: slots per KV block; cos, sin [T, head_dim]: the rows' rope
 * tables (rope.py's). Returns 0, -1 when scratch memory ran out, or the first failing
 * kernel's status (the KV writes of the layers before it are done). */
int baton_decode_layers(const BatonDecodeShape *shape, const BatonDecodeLayer *layers,
                        int64_t num_layers, const BatonDecodeGroup *groups, int64_t T,
                        int64_t block_size, const float *cos, const float *sin,
                        const float *final_norm, float *x, float *out, int num_threads) {
  const int64_t H = shape->hidden, D = shape->head_dim, I = shape->intermediate;
  const int64_t q_width = shape->heads * D, kv_width = shape->kv_heads * D;
  const int64_t qkv_width = q_width + 2 * kv_width;
  float *scratch = malloc(sizeof(float) * (size_t)(T * (2 * H + qkv_width + 2 * q_width +
                                                        kv_width + 3 * I)));
  if (scratch == NULL) return -1;
  float *residual = scratch, *h = residual + T * H, *qkv = h + T * H, *q = qkv + T * qkv_width;
  float *k = q + T * q_width, *attn = k + T * kv_width, *gate_up = attn + T * q_width;
  float *act = gate_up + T * 2 * I;
  int status = 0;
  for (int64_t l = 0; l < num_layers && status == 0; ++l) {
    const BatonDecodeLayer *layer = layers + l;
    const BatonDecodeGroup *group = groups + layer->kv_group;
    if (l == 0) {
      status = baton_rms_norm(x, NULL, layer->input_norm, T, H, shape->eps, h, NULL, num_threads);
      memcpy(residual, x, sizeof(float) * (size_t)(T * H));
    } else {
      status = baton_rms_norm(x, residual, layer->input_norm, T, H, shape->eps, h, residual,
                              num_threads);
    }
    if (status == 0) status = project(shape, &layer->qkv, h, T, qkv, num_threads);
    if (status == 0)
      status = baton_rope(qkv, qkv_width, cos, sin, T, shape->heads, D, q, num_threads);
    if (status == 0)
      status = baton_rope(qkv + q_width, qkv_width, cos, sin, T, shape->kv_heads, D, k,
                          num_threads);
    if (status == 0)
      status = baton_write_kv(k, kv_width, qkv + q_width + kv_width, qkv_width, group->slots, T,
                              (int)shape->kv_heads, (int)D, layer->k_cache, layer->v_cache,
                              layer->num_slots);
    if (status == 0)
      status = baton_paged_decode_attention(
          q, layer->k_cache, layer->v_cache, layer->num_slots, group->tables, group->max_blocks,
          group->lengths, T, (int)shape->heads, (int)shape->kv_heads, (int)D,
          (int)block_size, shape->scale, layer->window, attn, num_threads);
    if (status == 0) status = project(shape, &layer->o, attn, T, x, num_threads);
    if (status == 0)
      status = baton_rms_norm(x, residual, layer->post_attention_norm, T, H, shape->eps, h,
                              residual, num_threads);
    if (status == 0) status = project(shape, &layer->gate_up, h, T, gate_up, num_threads);
    if (status == 0) status = baton_silu_mul(gate_up, T, I, act, num_threads);
    if (status == 0) status = project(shape, &layer->down, act, T, x, num_threads);
  }
  if (status == 0)
    status = baton_rms_norm(x, residual, final_norm, T, H, shape->eps, out, residual, num_threads);
  free(scratch);
  return status;
}
