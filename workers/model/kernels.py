"""Baton's own CPU kernels (`csrc/*.c`): built once per machine, called through ctypes.

- `baton_block_matmul`: small-batch matmuls from GGUF blocks (block_matmul.py), and
  `baton_block_matmul_rounded`: one row of the same with its input rounded to 16 or 8
  bits (EngineConfig.activations);
- `baton_paged_decode_attention`: decode attention read through block tables (over the
  whole context or a sliding window), `baton_prefill_attention`: a prefill chunk's
  causal attention over its context, read from the cache through its slots, and
  `baton_write_kv`: a step's new K/V into their cache slots (attention.py);
- `baton_rms_norm`: RMSNorm with the residual add, in one pass (norm.py);
- `baton_rope`: rotary embeddings of a step's query and key heads (rope.py);
- `baton_silu_mul`: SwiGLU's silu(gate) * up over the fused projection, and
  `baton_gelu_tanh_mul`: GeGLU's gelu_tanh(gate) * up (mlp.py);
- `baton_decode_layers`: a Llama-family decode step through all layers, calling the
  kernels above in one call (fused_decode.py);
- `baton_dense_matmul`: float32 matmuls of many rows (a prefill's projections) against
  a weight `baton_pack_dense` laid out in column panels (dense_panels.py).

Steps of up to `team_max_rows()` rows run the matmuls and the attention on a work team
of threads (csrc/work_team.c) rather than OpenMP's, so that a thread the OS takes away
never holds the step up: `LLMEngine` runs such a step in `team_loops()` (and its torch
ops on one thread); elsewhere only loops of up to 8 rows take the team.

They are C with AVX2/FMA intrinsics and OpenMP, compiled with the system's C compiler
into Baton's cache (about three seconds, no torch headers or ninja). The block
matmuls, the rounded matmul, the dense matmul, the prefill attention's products and the
gated activations have AVX-512 forms, built into the same library and taken at run time
where the CPU has it (csrc/vector_width.c; `baton_use_avx512` lets tests choose); the
dense matmul's weights are laid out only there. OpenMP resolves to the libgomp torch
already loaded, so their larger loops share torch's thread pool; ctypes releases the
GIL while they run. Without a compiler or AVX2, `library()` is None and
the model runs on torch's own operators, as on every other device.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = sorted(_CSRC.glob("*.c"))
# Headers the sources include: part of the build's identity, not compiled alone.
_HEADERS = sorted(_CSRC.glob("*.h"))
# No contraction of a * b + c into one FMA where the C says otherwise: dequantized
# weights must equal the float32 copy gguf-py made, bit for bit.
_FLAGS = ["-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared"]

_ptr, _i64, _int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
# Exported function -> argument types; every one returns an int status (0: done).
_PROTOTYPES = {
    "baton_block_matmul": [_int, _ptr, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _int],
    "baton_block_matmul_rounded": [
        _int,
        _int,
        _ptr,
        _i64,
        _i64,
        _ptr,
        _ptr,
        _ptr,
        _ptr,
        _i64,
        _int,
    ],
    "baton_paged_decode_attention": [
        *(_ptr, _ptr, _ptr, _i64, _ptr, _i64, _ptr, _i64),
        *(_int, _int, _int, _int, ctypes.c_float, _i64, _ptr, _int),
    ],
    "baton_prefill_attention": [
        *(_ptr, _i64, _i64, _ptr, _ptr, _i64, _ptr, _i64),
        *(_int, _int, _int, ctypes.c_float, _ptr, _int),
    ],
    "baton_write_kv": [_ptr, _i64, _ptr, _i64, _ptr, _i64, _int, _int, _ptr, _ptr, _i64],
    "baton_rms_norm": [_ptr, _ptr, _ptr, _i64, _i64, ctypes.c_float, _ptr, _ptr, _int],
    "baton_rope": [_ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _ptr, _int],
    "baton_silu_mul": [_ptr, _i64, _i64, _ptr, _int],
    "baton_gelu_tanh_mul": [_ptr, _i64, _i64, _ptr, _int],
    "baton_decode_layers": [_ptr, _ptr, _i64, _ptr, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _int],
    "baton_dense_panel_width": [],
    "baton_pack_dense": [_ptr, _i64, _i64, _ptr],
    "baton_dense_matmul": [_ptr, _i64, _i64, _ptr, _i64, _ptr, _ptr, _int],
    "baton_team_max_rows": [],
    "baton_set_team_rows": [_int],
    "baton_use_avx512": [_int],
}

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_tried = False


def library() -> ctypes.CDLL | None:
    """The compiled kernels, built on first use; None where this CPU lacks AVX2/FMA or
    no C compiler is installed (logged once)."""
    global _library, _tried
    if _tried:  # every small matmul and attention call asks: no lock once settled
        return _library
    with _lock:
        if not _tried:
            _tried = True
            _library = _load()
        return _library


def required_library() -> ctypes.CDLL:
    """library(), for a caller that holds weights laid out for the kernels: their absence
    there is a broken invariant."""
    lib = library()
    if lib is None:
        raise RuntimeError("Baton's CPU kernels are not built (see kernels.library)")
    return lib


def team_max_rows() -> int:
    """Rows of x up to which the kernels run on the work team in `team_loops`; 0 without
    the kernels."""
    lib = library()
    return lib.baton_team_max_rows() if lib is not None else 0


@contextmanager
def team_loops() -> Iterator[None]:
    """In the block, the calling thread's kernels run loops of up to `team_max_rows()`
    rows on the work team, for a step whose torch ops run on one thread
    (`torch_threads.kernels_apart`); outside it only the shortest (csrc/work_team.h), as
    torch's OpenMP workers then spin between ops and starve the team's helpers."""
    lib = library()
    if lib is None:
        yield
        return
    before = lib.baton_set_team_rows(lib.baton_team_max_rows())
    try:
        yield
    finally:
        lib.baton_set_team_rows(before)


def _load() -> ctypes.CDLL | None:
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        log.info("no AVX2 on this CPU: Baton's CPU kernels unused, torch operators only")
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler (cc, gcc): Baton's CPU kernels unused, decoding runs slower")
        return None
    try:
        path = _build(compiler)
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or e
        log.warning("could not build Baton's CPU kernels with %s: %s", compiler, detail)
        return None
    lib = ctypes.CDLL(str(path))
    for name, argtypes in _PROTOTYPES.items():
        fn = getattr(lib, name)
        fn.restype = ctypes.c_int
        fn.argtypes = argtypes
    return lib


def _build(compiler: str) -> Path:
    """Compiles the kernels into the cache once per sources, flags and compiler; a
    finished file is renamed into place, so concurrent builders never see half of one."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    digest = hashlib.sha256(" ".join(_FLAGS).encode() + version.encode())
    for source in [*_SOURCES, *_HEADERS]:
        digest.update(source.name.encode() + source.read_bytes())
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    cache = Path(base) / "baton" / "kernels"
    target = cache / f"baton_kernels-{digest.hexdigest()[:16]}.so"
    if target.is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".baton_kernels-", suffix=".so", dir=cache)
    os.close(fd)
    try:
        command = [compiler, *_FLAGS, "-o", tmp, *map(str, _SOURCES), "-lm"]
        subprocess.run(command, check=True, capture_output=True, text=True)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log.info("built Baton's CPU kernels: %s", target)
    return target
