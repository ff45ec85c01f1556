"""Builds a model and fills it from safetensors, each rank reading only its shards."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from workers.model.config import ModelConfig
from workers.model.llama import LlamaForCausalLM
from workers.model.parallel import TPGroup

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


def load_model(
    model_dir: str | Path,
    tp: TPGroup | None = None,
    max_positions: int | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> LlamaForCausalLM:
    model_dir = Path(model_dir)
    cfg = ModelConfig.from_pretrained(model_dir)
    with torch.device(device):
        model = LlamaForCausalLM(cfg, tp, max_positions, dtype)
    load_weights(model, model_dir)
    model.pack_weights()
    return model.eval()


def load_weights(model: LlamaForCausalLM, model_dir: Path) -> None:
    modules = dict(model.named_modules())
    expected = {name for name, _ in model.named_parameters()}
    loaded: set[str] = set()
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                if name.endswith(_IGNORED_SUFFIXES):
                    continue
                module_path, param_name, shard_id = _resolve(name)
                if module_path == "lm_head" and model.config.tie_word_embeddings:
                    continue
                module = modules.get(module_path)
                if module is None or not hasattr(module, param_name):
                    raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
                loader = getattr(module, "load_weight", None)
                if loader is not None:
                    loader(param_name, f.get_slice(name), shard_id)
                else:
                    getattr(module, param_name).data.copy_(f.get_tensor(name))
                loaded.add(f"{module_path}.{param_name}")
    # A tied LM head shares the embedding's parameter, which named_parameters
    # lists once, under the embedding's name.
    missing = expected - loaded
    if missing:
        raise ValueError(f"checkpoint in {model_dir} lacks tensors: {sorted(missing)[:8]}")


def _resolve(name: str) -> tuple[str, str, str | None]:
    """Checkpoint name -> (module path, parameter, shard of a packed layer).

    'model.layers.0.self_attn.q_proj.weight' -> ('model.layers.0.self_attn.qkv_proj', 'weight', 'q')
    """
    module_path, param_name = name.rsplit(".", 1)
    parent, _, leaf = module_path.rpartition(".")
    packed = LlamaForCausalLM.packed_modules.get(leaf)
    if packed is None:
        return module_path, param_name, None
    return f"{parent}.{packed[0]}", param_name, packed[1]
