"""Convert a GGUF file (Llama or Gemma 3 architecture) into a Hugging Face-style model folder.

The engine only reads safetensors + config.json + tokenizer.json, so a GGUF (the form small
models are easiest to get offline) is dequantized to fp32 once and written in that layout.
Its quantized tensors that the engine's small-batch kernel reads (block_matmul.py) are also
kept, repacked without changing a weight (gguf_repack.py), in `BLOCKS_FILE` beside them.
What the file's names and stored weights mean per architecture is in gguf_arch.py.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from workers.model.block_matmul import (
    BLOCK_KINDS_KEY,
    BLOCKS_FILE,
    KNOWN_KINDS,
    WEIGHTS_DIGEST_KEY,
)
from workers.model.gguf_arch import GGUFArch, gguf_arch, unpermute_qk
from workers.model.gguf_metadata import GGUFMetadata
from workers.model.gguf_repack import repack
from workers.model.gguf_tokenizer import build_tokenizer, tokenizer_config
from workers.model.loader import weights_digest

__all__ = ["convert_gguf", "unpermute_qk", "write_blocks"]


def convert_gguf(
    gguf_path: Path, out_dir: Path, progress: Callable[[int, int], None] | None = None
) -> Path:
    """Write `out_dir` as an HF folder (fp32 safetensors, tokenizer.json, configs);
    `progress(done, total)` is told of each tensor dequantized.

    The folder appears all at once (built beside it, then renamed) so a crash never leaves a
    half-written model that a later run would mistake for a finished one. Raises ValueError for a
    file this converter cannot represent faithfully, FileExistsError if `out_dir` exists.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if out_dir.exists():
        raise FileExistsError(f"refusing to overwrite existing {out_dir}")
    reader = GGUFReader(gguf_path)
    meta = GGUFMetadata(reader, gguf_path)
    arch = gguf_arch(meta)
    config = arch.build_config(meta, {t.name for t in reader.tensors})
    _check_tensors(reader, arch, config)
    tokenizer = build_tokenizer(meta)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    try:
        tensors = _hf_tensors(reader, arch, config, progress)
        _write_safetensors(tmp / "model.safetensors", tensors)
        tokenizer.save(str(tmp / "tokenizer.json"))
        _write_json(tmp / "config.json", config)
        _write_blocks(reader, arch, config, tmp)
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
    meta = GGUFMetadata(reader, gguf_path)
    arch = gguf_arch(meta)
    config = arch.build_config(meta, {t.name for t in reader.tensors})
    _write_blocks(reader, arch, config, Path(model_dir))


def _check_tensors(reader: GGUFReader, arch: GGUFArch, config: dict[str, Any]) -> None:
    """Fail before writing anything if a tensor is missing, unknown, or shaped unexpectedly."""
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    expected = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    if not config["tie_word_embeddings"]:
        expected["lm_head.weight"] = (vocab, hidden)
    per_layer = arch.layer_shapes(config)
    for layer in range(config["num_hidden_layers"]):
        expected.update({f"model.layers.{layer}.{k}": v for k, v in per_layer.items()})
    found = {}
    for tensor in reader.tensors:
        name = arch.hf_name(tensor.name)
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


def _hf_tensors(
    reader: GGUFReader,
    arch: GGUFArch,
    config: dict[str, Any],
    progress: Callable[[int, int], None] | None = None,
) -> Iterable[tuple[str, np.ndarray]]:
    """Yield (hf_name, fp32 array) one at a time so peak memory stays at one tensor."""
    for done, tensor in enumerate(reader.tensors, 1):
        if progress is not None:
            progress(done, len(reader.tensors))
        name = arch.hf_name(tensor.name)
        # GGUF lists dimensions fastest-first; numpy (and torch) want them slowest-first.
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        array = dequantize(tensor.data, GGMLQuantizationType(tensor.tensor_type))
        yield name, arch.to_hf(name, np.asarray(array, dtype=np.float32).reshape(shape), config)


def _write_blocks(
    reader: GGUFReader, arch: GGUFArch, config: dict[str, Any], model_dir: Path
) -> None:
    """`BLOCKS_FILE` of the folder whose weights and config are written: each matrix
    gguf_repack.py repacks as `<hf name>.qs`, `.scale` (and `.min`), rows unpermuted as
    `_hf_tensors` does for Llama's Q and K; the file's metadata holds their kinds, the
    weights' digest and the kinds this Baton knows. Written beside, then renamed into place."""
    kinds: dict[str, str] = {
        WEIGHTS_DIGEST_KEY: weights_digest(model_dir),
        BLOCK_KINDS_KEY: KNOWN_KINDS,
    }

    def arrays() -> Iterable[tuple[str, np.ndarray]]:
        for tensor in reader.tensors:
            if len(tensor.shape) != 2:
                continue
            rows = int(tensor.shape[1])
            blocks = repack(GGMLQuantizationType(tensor.tensor_type), tensor.data, rows)
            if blocks is None:
                continue
            kind, parts = blocks
            name = arch.hf_name(tensor.name)
            heads = arch.permuted_heads(name, config)
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
