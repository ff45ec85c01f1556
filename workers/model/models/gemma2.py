"""Gemma 2 as one readable model: Gemma 3's layers (four (1 + w) norms a layer, a GeGLU
MLP, embeddings scaled by sqrt(hidden), scores scaled by query_pre_attn_scalar ** -0.5)
with the Llama family's attention layer instead (no QK-norm; Q and K rotated together),
its scores soft-capped at cap * tanh(score / cap) (attn_logit_softcapping, 50) and the
final logits too (30); layers alternate sliding (even ones, window 4096) and full, all
with one rope base.
"""

from __future__ import annotations

from workers.model.models.causal_lm import CausalLM
from workers.model.models.gemma3 import DecoderLayer, Gemma3Model
from workers.model.models.llama import Attention


class Gemma2DecoderLayer(DecoderLayer):
    attention_class = Attention


class Gemma2Model(Gemma3Model):
    layer_class = Gemma2DecoderLayer


class Gemma2ForCausalLM(CausalLM):
    decoder_class = Gemma2Model
