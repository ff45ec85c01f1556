"""Convert a Llama-architecture GGUF file into a Hugging Face-style model folder.

The engine only reads safetensors + config.json + tokenizer.json, so a GGUF (the form small
models are easiest to get offline) is dequantized to fp32 once and written in that layout.
Its Q4_1 and Q8_0 tensors are also kept as they are, in `BLOCKS_FILE` beside the weights,
for the engine's small-batch kernel (block_matmul.py).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from workers.model.block_matmul import BLOCKS_FILE, QS_BYTES, WEIGHTS_DIGEST_KEY
from workers.model.gguf_tokenizer import build_tokenizer, tokenizer_config
from workers.model.loader import weights_digest

__all__ = ["convert_gguf", "unpermute_qk", "write_blocks"]

# GGUF per-layer tensor suffix -> Hugging Face LlamaForCausalLM name within model.layers.N.
_LAYER_NAMES = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Write `out_dir` as an HF Llama folder (fp32 safetensors, tokenizer.json, configs).

    The folder appears all at once (built beside it, then renamed) so a crash never leaves a
    half-written model that a later run would mistake for a finished one. Raises ValueError for a
    file this converter cannot represent faithfully, FileExistsError if `out_dir` exists.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if out_dir.exists():
        raise FileExistsError(f"refusing to overwrite existing {out_dir}")
    reader = GGUFReader(gguf_path)
    meta = GGUFMetadata(reader, gguf_path)
    config = _build_config(meta, {t.name for t in reader.tensors})
    _check_tensors(reader, config)
    tokenizer = build_tokenizer(meta)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    try:
        _write_safetensors(tmp / "model.safetensors", _hf_tensors(reader, config))
        tokenizer.save(str(tmp / "tokenizer.json"))
        _write_json(tmp / "config.json", config)
        _write_blocks(reader, config, tmp)
        _write_json(tmp / "tokenizer_config.json", tokenizer_config(meta, config))
        _write_json(tmp / "generation_config.json", _generation_config(config))
        os.chmod(tmp, 0o755)  # mkdtemp makes it owner-only; the model folder is meant to be shared
        _fsync_dir(tmp)
        os.rename(tmp, out_dir)  # atomic; fails rather than merging if out_dir appeared meanwhile
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_dir(out_dir.parent)
    return out_dir


def write_blocks(gguf_path: Path, model_dir: Path) -> None:
    """Add `BLOCKS_FILE` to a folder `convert_gguf` made from this GGUF before it kept
    blocks (written beside, then renamed into place)."""
    reader = GGUFReader(gguf_path)
    config = _build_config(GGUFMetadata(reader, gguf_path), {t.name for t in reader.tensors})
    _write_blocks(reader, config, Path(model_dir))


def unpermute_qk(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation.

    llama.cpp's converter turns HF's rotate-half RoPE layout (first half of each head's rows
    paired with the second half) into interleaved pairs, via
    `w.reshape(n_head, 2, d // 2, in).swapaxes(1, 2)`; swapping the other two axes reverses it.
    """
    rows = weight.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"{rows} rows do not split into {n_head} heads of even size")
    head = weight.reshape(n_head, rows // n_head // 2, 2, *weight.shape[1:])
    return head.swapaxes(1, 2).reshape(weight.shape)


class GGUFMetadata:
    """A GGUF file's metadata; a missing required key is a ValueError naming the file."""

    def __init__(self, reader: GGUFReader, path: Path):
        self._fields = reader.fields
        self._path = path
        self.arch = self.get("general.architecture")
        if self.arch != "llama":
            raise ValueError(
                f"{path}: architecture {self.arch!r} is not supported; only 'llama' GGUF files "
                "can be converted"
            )

    def get(self, key: str, default: Any = ...) -> Any:
        field = self._fields.get(key)
        if field is None:
            if default is ...:
                raise ValueError(f"{self._path}: required GGUF metadata key {key!r} is missing")
            return default
        return field.contents()

    def arch_get(self, key: str, default: Any = ...) -> Any:
        return self.get(f"{self.arch}.{key}", default)


def _build_config(meta: GGUFMetadata, tensor_names: set[str]) -> dict[str, Any]:
    if meta.arch_get("expert_count", 0):
        raise ValueError("mixture-of-experts llama GGUF files are not supported")
    if "rope_freqs.weight" in tensor_names:
        # Llama 3.1-style frequency scaling lives in this tensor, and its parameters cannot be
        # recovered into HF's rope_scaling; converting without it would silently change outputs.
        raise ValueError("GGUF has a rope_freqs tensor (Llama 3.1 RoPE scaling); not supported")
    hidden = int(meta.arch_get("embedding_length"))
    n_head = int(meta.arch_get("attention.head_count"))
    tokens = meta.get("tokenizer.ggml.tokens")
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(meta.arch_get("feed_forward_length")),
        "num_hidden_layers": int(meta.arch_get("block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": int(meta.arch_get("attention.head_count_kv", n_head)),
        "head_dim": int(meta.arch_get("attention.key_length", hidden // n_head)),
        "hidden_act": "silu",
        "rms_norm_eps": float(meta.arch_get("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(meta.arch_get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta.arch_get("context_length")),
        "vocab_size": int(meta.arch_get("vocab_size", len(tokens))),
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "torch_dtype": "float32",
    }
    _refuse_rope_scaling(meta)
    for name in ("bos", "eos", "padding"):
        token_id = meta.get(f"tokenizer.ggml.{name}_token_id", None)
        if token_id is not None:
            config[f"{name.replace('padding', 'pad')}_token_id"] = int(token_id)
    return config


def _refuse_rope_scaling(meta: GGUFMetadata) -> None:
    # GGUF carries linear and YaRN scaling as metadata; the model implements only
    # Llama 3 scaling (which GGUF stores as a rope_freqs tensor, refused as well),
    # so converting these would produce a folder that then fails every load.
    kind = meta.arch_get("rope.scaling.type", None)
    if kind not in (None, "none"):
        raise ValueError(
            f"rope scaling type {kind!r} is not supported; Baton runs unscaled and "
            "Llama 3-scaled RoPE only"
        )


def _check_tensors(reader: GGUFReader, config: dict[str, Any]) -> None:
    """Fail before writing anything if a tensor is missing, unknown, or shaped unexpectedly."""
    hidden, head_dim = config["hidden_size"], config["head_dim"]
    ffn, vocab = config["intermediate_size"], config["vocab_size"]
    q_rows, kv_rows = (
        config["num_attention_heads"] * head_dim,
        config["num_key_value_heads"] * head_dim,
    )
    per_layer = {
        "self_attn.q_proj.weight": (q_rows, hidden),
        "self_attn.k_proj.weight": (kv_rows, hidden),
        "self_attn.v_proj.weight": (kv_rows, hidden),
        "self_attn.o_proj.weight": (hidden, q_rows),
        "mlp.gate_proj.weight": (ffn, hidden),
        "mlp.up_proj.weight": (ffn, hidden),
        "mlp.down_proj.weight": (hidden, ffn),
        "input_layernorm.weight": (hidden,),
        "post_attention_layernorm.weight": (hidden,),
    }
    expected = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    if not config["tie_word_embeddings"]:
        expected["lm_head.weight"] = (vocab, hidden)
    for layer in range(config["num_hidden_layers"]):
        expected.update({f"model.layers.{layer}.{k}": v for k, v in per_layer.items()})
    found = {}
    for tensor in reader.tensors:
        name = _hf_name(tensor.name)
        found[name] = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    missing = sorted(set(expected) - set(found))
    if missing:
        raise ValueError(f"GGUF is missing {len(missing)} tensors, e.g. {missing[:3]}")
    for name, shape in found.items():
        if name not in expected:
            raise ValueError(
                f"unexpected tensor {name} for a {config['num_hidden_layers']}-layer model"
            )
        if shape != expected[name]:
            raise ValueError(f"tensor {name} has shape {shape}, config implies {expected[name]}")


def _hf_tensors(reader: GGUFReader, config: dict[str, Any]) -> Iterable[tuple[str, np.ndarray]]:
    """Yield (hf_name, fp32 array) one at a time so peak memory stays at one tensor."""
    n_head, n_kv = config["num_attention_heads"], config["num_key_value_heads"]
    for tensor in reader.tensors:
        name = _hf_name(tensor.name)
        # GGUF lists dimensions fastest-first; numpy (and torch) want them slowest-first.
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        array = dequantize(tensor.data, GGMLQuantizationType(tensor.tensor_type))
        array = np.asarray(array, dtype=np.float32).reshape(shape)
        if name.endswith("q_proj.weight"):
            array = unpermute_qk(array, n_head)
        elif name.endswith("k_proj.weight"):
            array = unpermute_qk(array, n_kv)
        yield name, array


# GGUF block layouts the kernel reads: (kind, bytes before the packed values: a float16
# scale, and for Q4_1 a float16 minimum), the values following.
_BLOCK_KINDS = {GGMLQuantizationType.Q4_1: ("q4_1", 4), GGMLQuantizationType.Q8_0: ("q8_0", 2)}


def _write_blocks(reader: GGUFReader, config: dict[str, Any], model_dir: Path) -> None:
    """`BLOCKS_FILE` of the folder whose weights and config are written: the Q4_1 / Q8_0
    matrices as `<hf name>.qs`, `.scale` (and `.min`), rows unpermuted as `_hf_tensors`
    does for Q and K; the file's metadata holds their kinds and the weights' digest.
    Written beside, then renamed into place."""
    kinds: dict[str, str] = {WEIGHTS_DIGEST_KEY: weights_digest(model_dir)}

    def arrays() -> Iterable[tuple[str, np.ndarray]]:
        n_head, n_kv = config["num_attention_heads"], config["num_key_value_heads"]
        for tensor in reader.tensors:
            block = _BLOCK_KINDS.get(GGMLQuantizationType(tensor.tensor_type))
            if block is None or len(tensor.shape) != 2:
                continue
            kind, head_bytes = block
            name = _hf_name(tensor.name)
            rows = int(tensor.shape[1])
            block_bytes = head_bytes + QS_BYTES[kind]
            blocks = np.asarray(tensor.data, dtype=np.uint8).reshape(rows, -1, block_bytes)
            parts = {
                "qs": blocks[:, :, head_bytes:].reshape(rows, -1),
                "scale": blocks[:, :, 0:2].copy().view("<f2").astype(np.float32)[..., 0],
            }
            if kind == "q4_1":
                parts["min"] = blocks[:, :, 2:4].copy().view("<f2").astype(np.float32)[..., 0]
            heads = {"q_proj": n_head, "k_proj": n_kv}.get(name.split(".")[-2])
            kinds[name] = kind
            for part, array in parts.items():
                yield f"{name}.{part}", unpermute_qk(array, heads) if heads else array

    path = model_dir / BLOCKS_FILE
    tmp = path.with_name(f".{path.name}.tmp")
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        _write_safetensors(tmp, arrays(), kinds)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES and parts[1].isdigit():
        return f"model.layers.{int(parts[1])}.{_LAYER_NAMES[parts[2]]}"
    # An unmapped tensor (biases, extra norms) means this is not plain Llama; dropping it
    # would produce a model that loads fine and generates garbage.
    raise ValueError(f"GGUF tensor {gguf_name!r} has no LlamaForCausalLM counterpart")


def _write_safetensors(
    path: Path, tensors: Iterable[tuple[str, np.ndarray]], metadata: dict[str, str] | None = None
) -> None:
    """Stream tensors into one safetensors file.

    safetensors' own writers need every tensor in memory at once (the fp32 model is ~4x the
    GGUF); the format is just a JSON header of offsets followed by raw little-endian bytes, so
    the data is written first and the header, whose size is then known, is put in front.
    """
    header: dict[str, Any] = {}
    body = path.with_suffix(".body")
    offset = 0
    with open(body, "wb") as out:
        for name, array in tensors:
            if name in header:
                raise ValueError(f"duplicate tensor {name!r} in GGUF")
            dtype = "U8" if array.dtype == np.uint8 else "F32"
            data = np.ascontiguousarray(array, dtype="u1" if dtype == "U8" else "<f4")
            header[name] = {
                "dtype": dtype,
                "shape": list(data.shape),
                "data_offsets": [offset, offset + data.nbytes],
            }
            out.write(memoryview(data).cast("B"))
            offset += data.nbytes
    # The metadata (filled while the tensors streamed) goes in the header written last.
    header["__metadata__"] = {"format": "pt", **(metadata or {})}
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # keep tensor data 8-byte aligned for mmap readers
    with open(path, "wb") as out, open(body, "rb") as src:
        out.write(len(encoded).to_bytes(8, "little"))
        out.write(encoded)
        shutil.copyfileobj(src, out, 16 << 20)
        out.flush()
        os.fsync(out.fileno())
    body.unlink()


def _generation_config(config: dict[str, Any]) -> dict[str, Any]:
    keys = ("bos_token_id", "eos_token_id", "pad_token_id")
    return {key: config[key] for key in keys if key in config}


def _write_json(path: Path, data: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as out:
        json.dump(data, out, indent=2, ensure_ascii=False)
        out.write("\n")
        out.flush()
        os.fsync(out.fileno())


def _fsync_dir(path: Path) -> None:
    # Makes the rename itself durable, not just the file contents.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
