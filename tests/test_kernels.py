"""Building Baton's CPU kernels: once per machine, atomically, and optional."""

from __future__ import annotations

import pytest
import torch

from workers.model import kernels
from workers.model.attention import PagedAttention

pytestmark = pytest.mark.skipif(
    torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
    reason="the kernels need AVX2",
)


def test_the_kernels_are_built_once_into_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    compiler = kernels.shutil.which("cc") or "gcc"
    first = kernels._build(compiler)
    assert first.parent == tmp_path / "baton" / "kernels" and first.is_file()
    stamp = first.stat().st_mtime_ns
    assert kernels._build(compiler) == first
    assert first.stat().st_mtime_ns == stamp
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no temp files left


def test_every_declared_kernel_is_exported():
    # library() declares each prototype; a missing symbol would raise AttributeError.
    lib = kernels.library()
    assert lib is not None
    assert all(callable(getattr(lib, name)) for name in kernels._PROTOTYPES)


def test_without_a_compiler_the_model_runs_on_torch_operators(monkeypatch, caplog):
    monkeypatch.setattr(kernels, "_tried", False)
    monkeypatch.setattr(kernels, "_library", None)
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(kernels.shutil, "which", lambda name: None)
    assert kernels.library() is None
    assert "no C compiler" in caplog.text
    attn = PagedAttention(4, 2, 16)
    attn.bind_cache(torch.zeros(2, 32, 16), torch.zeros(2, 32, 16))
    assert attn._kernel is None
