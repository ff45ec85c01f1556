"""Builds a model (the class its config's family names, workers/model/models/) and fills
it from safetensors, each rank reading only its shards."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from workers.model import kernels
from workers.model.block_matmul import (
    BLOCK_KINDS_KEY,
    BLOCKS_FILE,
    KNOWN_KINDS,
    WEIGHTS_DIGEST_KEY,
    BlockSource,
)
from workers.model.config import ModelConfig
from workers.model.models import CausalLM, model_class
from workers.model.parallel import TPGroup, copy_weight, native_bf16_matmul

logger = logging.getLogger(__name__)

PackedModules = dict[str, tuple[str, str]]

# Buffers some checkpoints carry that the model recomputes itself.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / n for n in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(
            f"model: no *.safetensors in {model_dir}; Baton loads only safetensors "
            "(convert pickled .bin checkpoints first)"
        )
    return files


def model_identity(model_dir: str | Path) -> str:
    """The folder's name plus a digest of its config and of sampled weight bytes.

    Block hashes start from this, so two checkpoints that share a folder name (two
    fine-tunes of one base) must not share an identity."""
    model_dir = Path(model_dir)
    return f"{model_dir.resolve().name}-{weights_digest(model_dir)[:12]}"


def weights_digest(model_dir: str | Path) -> str:
    """A digest of the folder's config and of sampled bytes of its weight files:
    hashing whole files would cost seconds per start, 16 x 64 KiB samples per file tell
    fine-tunes apart."""
    model_dir = Path(model_dir)
    digest = hashlib.sha256((model_dir / "config.json").read_bytes())
    for path in safetensors_files(model_dir):
        size = path.stat().st_size
        digest.update(path.name.encode() + size.to_bytes(8, "little"))
        with path.open("rb") as f:
            for i in range(16):
                f.seek(size * i // 16)
                digest.update(f.read(64 * 1024))
    return digest.hexdigest()


def load_model(
    model_dir: str | Path,
    tp: TPGroup | None = None,
    max_positions: int | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> CausalLM:
    model_dir = Path(model_dir)
    cfg = ModelConfig.from_pretrained(model_dir)
    if dtype == torch.bfloat16 and torch.device(device).type == "cpu" and not native_bf16_matmul():
        logger.warning(
            "bfloat16 on a CPU without AMX or AVX512-BF16 runs far slower than float32; "
            "set dtype to float32 (or auto) on this machine"
        )
    with torch.device(device):
        model = model_class(cfg)(cfg, tp, max_positions, dtype)
    load_weights(model, model_dir)
    if dtype == torch.float32 and torch.device(device).type == "cpu":
        load_blocks(model, model_dir)
    model.pack_weights()
    return model.eval()


def load_weights(model: CausalLM, model_dir: Path) -> None:
    modules = dict(model.named_modules())
    packed = model.packed_modules
    expected = {name for name, _ in model.named_parameters()}
    loaded: set[str] = set()
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                if name.endswith(_IGNORED_SUFFIXES):
                    continue
                renamed = _renamed(name, model.renamed_modules)
                module_path, param_name, shard_id = _resolve(renamed, packed)
                if module_path == "lm_head" and model.config.tie_word_embeddings:
                    continue
                module = modules.get(module_path)
                if module is None or not hasattr(module, param_name):
                    owner, rest = _owner(modules, renamed)
                    if owner is None:
                        raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
                    owner.load_subtensor(rest, f.get_slice(name))
                    continue
                loader = getattr(module, "load_weight", None)
                if loader is not None:
                    loader(param_name, f.get_slice(name), shard_id)
                else:
                    copy_weight(getattr(module, param_name), f.get_tensor(name))
                loaded.add(f"{module_path}.{param_name}" + (f"#{shard_id}" if shard_id else ""))
    # A module that loads many checkpoint tensors into one parameter (an MoE layer's
    # stacked experts) says which of its parameters it got whole.
    for path_name, module in modules.items():
        if hasattr(module, "load_subtensor"):
            loaded |= {f"{path_name}.{p}" for p in module.loaded_params()}
    # A tied LM head shares the embedding's parameter, which named_parameters
    # lists once, under the embedding's name. A packed layer counts as loaded only
    # when every one of its parts (q, k, v / gate, up) was.
    missing = sorted(n for n in expected if not _parts(n, packed) <= loaded)
    if missing:
        raise ValueError(f"checkpoint in {model_dir} lacks tensors: {missing[:8]}")


def load_blocks(model: CausalLM, model_dir: Path) -> None:
    """Hands the layers their weights' GGUF blocks (block_matmul.py), where the folder
    has them and this machine runs the kernel. A tied embedding's blocks serve the LM
    head; the embedding lookup itself reads the float32 copy."""
    path = model_dir / BLOCKS_FILE
    if not path.is_file() or kernels.library() is None:
        return
    if not blocks_match_weights(model_dir):
        logger.warning(
            "%s was made for other weights than %s's (replaced since the conversion?); "
            "running on the float32 weights alone. Delete it, or the folder, to convert again",
            path,
            model_dir,
        )
        return
    modules = dict(model.named_modules())
    with safe_open(str(path), framework="pt") as f:
        for name, kind in (f.metadata() or {}).items():
            if name in ("format", WEIGHTS_DIGEST_KEY, BLOCK_KINDS_KEY):
                continue
            module_path, _, shard_id = _resolve(name, model.packed_modules)
            if module_path == "model.embed_tokens" and model.config.tie_word_embeddings:
                module_path = "lm_head"
            loader = getattr(modules.get(module_path), "load_blocks", None)
            if loader is not None:
                loader(BlockSource(f, name, kind), shard_id)


def blocks_match_weights(model_dir: Path) -> bool:
    """Whether the folder has a `BLOCKS_FILE` written beside its current weights, by a
    Baton that knew every block kind this one does."""
    path = Path(model_dir) / BLOCKS_FILE
    if not path.is_file():
        return False
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
    except SafetensorError:  # a torn or foreign file: as good as none
        return False
    return (
        meta.get(WEIGHTS_DIGEST_KEY) == weights_digest(model_dir)
        and meta.get(BLOCK_KINDS_KEY) == KNOWN_KINDS
    )


def _parts(param: str, packed: PackedModules) -> set[str]:
    """What loading `param` takes: its name, or one name per part of a packed layer."""
    layer = param.rpartition(".")[0].rpartition(".")[2]
    shards = {shard for packed_layer, shard in packed.values() if packed_layer == layer}
    return {f"{param}#{shard}" for shard in shards} if shards else {param}


def _renamed(name: str, renamed_modules: dict[str, str]) -> str:
    """`name` with the family's renamed module names (CausalLM.renamed_modules) replaced."""
    if not renamed_modules:
        return name
    return ".".join(renamed_modules.get(part, part) for part in name.split("."))


def _owner(modules: dict[str, torch.nn.Module], name: str) -> tuple[torch.nn.Module | None, str]:
    """The nearest module above checkpoint tensor `name` that loads tensors below it
    itself (`load_subtensor`, as FusedExperts takes 'experts.3.up_proj.weight'), and the
    name relative to it; (None, name) if none does."""
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        module = modules.get(".".join(parts[:i]))
        if module is not None and hasattr(module, "load_subtensor"):
            return module, ".".join(parts[i:])
    return None, name


def _resolve(name: str, packed_modules: PackedModules) -> tuple[str, str, str | None]:
    """Checkpoint name -> (module path, parameter, shard of a packed layer).

    'model.layers.0.self_attn.q_proj.weight' -> ('model.layers.0.self_attn.qkv_proj', 'weight', 'q')
    """
    module_path, param_name = name.rsplit(".", 1)
    parent, _, leaf = module_path.rpartition(".")
    packed = packed_modules.get(leaf)
    if packed is None:
        return module_path, param_name, None
    return f"{parent}.{packed[0]}", param_name, packed[1]
