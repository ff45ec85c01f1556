"""A pure-decode step through all of a Llama-family model's layers in one C call.

One sequence's decode step on the bundled model spent about a third of its time in
Python: some ten kernel calls a layer, each allocating its output, making views and
converting its arguments. `csrc/decode_layers.c` runs the same kernels with the same
arguments in one call, so its floats are the module path's, bit for bit; the layer
table it walks (weights, norms, caches) is built here once, when the caches are bound.

With a one-row input rounded to 16 or 8 bits (`EngineConfig.activations`) every
projection calls `csrc/rounded_matmul.c`, as the modules then do.

It runs where every one of those kernels would: a `LlamaModel` of the Llama family's
own layers (not Qwen3's, Gemma's or a mixture of experts), on one rank, float32 on the
CPU, with every projection in GGUF blocks (models converted from a GGUF, the bundled
ones among them), and for steps of decoding rows only, up to the block kernel's row
limit. Every other step, and every other model, runs on the modules.
"""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from workers.model import kernels
from workers.model.attention_metadata import AttentionMetadata
from workers.model.block_matmul import KIND_IDS, block_rows_limit
from workers.model.mlp import GatedMLP, silu_mul
from workers.model.norm import RMSNorm
from workers.model.parallel import PackableLinear
from workers.torch_threads import kernel_threads

_ptr, _i64, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
# Shapes csrc/paged_attention.c takes (its MAX_DIM and MAX_GROUP).
_MAX_HEAD_DIM, _MAX_GROUP = 256, 16


class _Projection(ctypes.Structure):
    _fields_ = [
        *(("kind", _i64), ("n", _i64), ("k", _i64)),
        *(("qs", _ptr), ("scale", _ptr), ("min", _ptr)),
    ]


class _Layer(ctypes.Structure):
    _fields_ = [
        *(("input_norm", _ptr), ("post_attention_norm", _ptr)),
        *(("qkv", _Projection), ("o", _Projection)),
        *(("gate_up", _Projection), ("down", _Projection)),
        *(("k_cache", _ptr), ("v_cache", _ptr)),
        *(("num_slots", _i64), ("kv_group", _i64), ("window", _i64)),
    ]


class _Group(ctypes.Structure):
    _fields_ = [("slots", _ptr), ("tables", _ptr), ("lengths", _ptr), ("max_blocks", _i64)]


class _Shape(ctypes.Structure):
    _fields_ = [
        *(("hidden", _i64), ("heads", _i64), ("kv_heads", _i64), ("head_dim", _i64)),
        *(("intermediate", _i64), ("eps", _f32), ("scale", _f32)),
        ("activation_bits", _i64),
    ]


class FusedDecode:
    """One model's layer table, and the call that runs a pure-decode step through it.
    `build` makes it, or answers None for a model it cannot run."""

    def __init__(
        self,
        model: nn.Module,
        lib: ctypes.CDLL,
        shape: _Shape,
        layers: list[_Layer],
        held: list[torch.Tensor],
    ):
        self._model = model
        self._lib = lib
        self._shape = shape
        self._layers = (_Layer * len(layers))(*layers)
        self._num_groups = 1 + max(layer.kv_group for layer in layers)
        # Every tensor whose address the table holds, kept alive with it.
        self._held = held

    @classmethod
    def build(cls, model: nn.Module) -> FusedDecode | None:
        """The table of `model` (a decoder such as `LlamaModel`, caches bound); None
        where some part of its layers would not run on Baton's kernels."""
        from workers.model.models.llama import Attention, DecoderLayer, LlamaModel

        lib = kernels.library()
        if lib is None or type(model) is not LlamaModel or not len(model.layers):
            return None
        if not all(
            type(layer) is DecoderLayer
            and type(layer.self_attn) is Attention
            and type(layer.mlp) is GatedMLP
            and layer.mlp.act is silu_mul
            for layer in model.layers
        ):
            return None
        first = model.layers[0]
        attn, gate_up = first.self_attn, first.mlp.gate_up_proj.blocks
        if attn.qkv_proj.blocks is None or gate_up is None:
            return None
        shape = _Shape(
            hidden=attn.qkv_proj.blocks.shape[1],
            heads=attn.num_heads,
            kv_heads=attn.num_kv_heads,
            head_dim=attn.head_dim,
            intermediate=gate_up.shape[0] // 2,
            eps=model.norm.eps,
            scale=attn.attn.score_scale,
            activation_bits=attn.qkv_proj.activation_bits,
        )
        if not _kernels_take(shape):
            return None
        norms = [model.norm]
        for layer in model.layers:
            norms += [layer.input_layernorm, layer.post_attention_layernorm]
        if any(type(n) is not RMSNorm or not _is_f32(n.weight, shape.hidden) for n in norms):
            return None
        # One eps and one score scale for all: the table carries them once.
        if {n.eps for n in norms} != {model.norm.eps}:
            return None
        if {layer.self_attn.attn.score_scale for layer in model.layers} != {attn.attn.score_scale}:
            return None
        held: list[torch.Tensor] = []
        layers = [_layer(layer, shape, held) for layer in model.layers]
        if any(table is None for table in layers):
            return None
        return cls(model, lib, shape, layers, held)

    def takes(self, meta: list[AttentionMetadata], rows: int) -> bool:
        """Whether a step of `rows` tokens with this metadata is pure decode that the
        kernels run as the modules would."""
        return (
            0 < rows <= block_rows_limit()
            and len(meta) == self._num_groups
            and all(not m.prefills and m.num_decode == rows for m in meta)
        )

    def __call__(
        self, token_ids: torch.Tensor, positions: torch.Tensor, meta: list[AttentionMetadata]
    ) -> torch.Tensor:
        """The final hidden states [T, hidden] of a step `takes` accepted."""
        if any(
            t.dtype != torch.int64 or not t.is_contiguous()
            for m in meta
            for t in (m.slot_mapping, m.decode_tables, m.decode_lengths)
        ):
            raise RuntimeError("a decode step's slots, tables and lengths must be int64 rows")
        model = self._model
        x = model.embed_tokens(token_ids).contiguous()
        cos, sin = (t.contiguous() for t in model.rotary.tables(positions))
        groups = (_Group * len(meta))(
            *(
                _Group(
                    m.slot_mapping.data_ptr(),
                    m.decode_tables.data_ptr(),
                    m.decode_lengths.data_ptr(),
                    m.decode_tables.shape[1],
                )
                for m in meta
            )
        )
        out = torch.empty_like(x)
        status = self._lib.baton_decode_layers(
            ctypes.byref(self._shape),
            self._layers,
            len(self._layers),
            groups,
            x.shape[0],
            meta[0].block_size,
            cos.data_ptr(),
            sin.data_ptr(),
            model.norm.weight.data_ptr(),
            x.data_ptr(),
            out.data_ptr(),
            kernel_threads(),
        )
        if status != 0:
            raise RuntimeError(
                f"the fused decode step failed (status {status}): a block table, length or "
                "slot out of range, or no memory for its scratch"
            )
        return out


def _kernels_take(shape: _Shape) -> bool:
    """Whether every kernel of the layer takes these sizes (whole AVX2 vectors; the
    attention kernel's head dim and group limits)."""
    d, heads, kv_heads = shape.head_dim, shape.heads, shape.kv_heads
    return (
        shape.hidden % 8 == 0
        and shape.intermediate % 8 == 0
        and d % 16 == 0
        and d <= _MAX_HEAD_DIM
        and kv_heads > 0
        and heads % kv_heads == 0
        and heads // kv_heads <= _MAX_GROUP
    )


def _is_f32(t: torch.Tensor, size: int) -> bool:
    """A contiguous float32 vector of `size` on the CPU."""
    return (
        t.device.type == "cpu"
        and t.dtype == torch.float32
        and t.is_contiguous()
        and tuple(t.shape) == (size,)
    )


def _layer(layer: nn.Module, shape: _Shape, held: list[torch.Tensor]) -> _Layer | None:
    """One decoder layer's table row; None where a part would not run on the kernels
    (a projection without blocks or split across ranks, a soft-capped attention, a
    cache not float32 on the CPU)."""
    attn, mlp = layer.self_attn, layer.mlp
    paged = attn.attn
    if paged.logit_softcap is not None or paged.k_cache is None:
        return None
    caches = (paged.k_cache, paged.v_cache)
    if any(c.dtype != torch.float32 or not c.is_contiguous() for c in caches):
        return None
    if any(c.device.type != "cpu" for c in caches):
        return None
    if (attn.num_heads, attn.num_kv_heads, attn.head_dim) != (
        shape.heads,
        shape.kv_heads,
        shape.head_dim,
    ):
        return None
    q_width, kv_width = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    hidden, intermediate = shape.hidden, shape.intermediate
    bits = shape.activation_bits
    projections = [
        _projection(attn.qkv_proj, q_width + 2 * kv_width, hidden, bits, held),
        _projection(attn.o_proj, hidden, q_width, bits, held),
        _projection(mlp.gate_up_proj, 2 * intermediate, hidden, bits, held),
        _projection(mlp.down_proj, hidden, intermediate, bits, held),
    ]
    if any(p is None for p in projections):
        return None
    held += caches
    return _Layer(
        layer.input_layernorm.weight.data_ptr(),
        layer.post_attention_layernorm.weight.data_ptr(),
        *projections,
        paged.k_cache.data_ptr(),
        paged.v_cache.data_ptr(),
        paged.k_cache.shape[1],
        paged.kv_group,
        paged.sliding_window or 0,
    )


def _projection(
    linear: PackableLinear, n: int, k: int, bits: int, held: list[torch.Tensor]
) -> _Projection | None:
    """A projection [n, k] by its blocks; None without blocks of that shape, with a bias
    (no GGUF the import takes has one), on a TP group of more than one rank, or rounding
    its input to other bits than the table's (one setting for all)."""
    blocks = linear.blocks
    if blocks is None or blocks.shape != (n, k) or linear.bias is not None:
        return None
    if linear.activation_bits != bits:
        return None
    if linear.tp.size != 1:
        return None
    held += [t for t in (blocks.qs, blocks.scale, blocks.min) if t is not None]
    return _Projection(
        KIND_IDS[blocks.kind],
        n,
        k,
        blocks.qs.data_ptr(),
        blocks.scale.data_ptr(),
        None if blocks.min is None else blocks.min.data_ptr(),
    )
