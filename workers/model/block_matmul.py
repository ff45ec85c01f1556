"""Small-batch matmuls straight from a GGUF's quantized weight blocks.

A model converted from a GGUF (gguf_import.py) keeps the file's Q4_1 and Q8_0 blocks
beside its float32 weights. Decoding a few sequences streams every weight once per
step, so its speed is memory bandwidth: float32 weights cost 4 bytes each, Q4_1 0.625
and Q8_0 1.06. `csrc/block_matmul.c` reads the blocks and multiplies in float32 in
registers, which is the same arithmetic as on the dequantized weights up to rounding
order (the blocks *are* the model: the float32 copy was made from them). Larger
batches are compute-bound and stay with oneDNN's float32 kernel (`MAX_ROWS`).

The kernel is C with AVX2/FMA intrinsics, compiled once per machine with the system's
C compiler into Baton's cache; without a compiler or AVX2 the model runs on its
float32 weights alone, as every non-GGUF model does.
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
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

BLOCK_SIZE = 32
# Where a converted folder keeps its blocks: in a folder of its own, so that loaders
# globbing the model folder's *.safetensors for weights never take it for one.
BLOCKS_FILE = "gguf_blocks/blocks.safetensors"
# The file's metadata key for a digest of the float32 weights it was written beside
# (loader.weights_digest): blocks of replaced weights must not be used.
WEIGHTS_DIGEST_KEY = "weights_digest"
# Bytes of one block of 32 weights in `qs` (the scales and minimums are kept apart).
QS_BYTES = {"q4_1": 16, "q8_0": 32}
_KIND_IDS = {"q4_1": 0, "q8_0": 1}
# Rows up to which the block kernel beats oneDNN's float32 one, measured over a whole
# model's weights (not cached) on a 2-core AVX2 EPYC, 2 threads: Q4_1 projections
# 8.9 / 35 ms at 1 row, 33 / 42 at 8, 62 / 54 at 16; the Q8_0 LM head 3.9 / 7.6 ms at
# 1 row, 16 / 30 at 16, 31 / 37 at 32.
MAX_ROWS = {"q4_1": 8, "q8_0": 32}

_SOURCE = Path(__file__).parent / "csrc" / "block_matmul.c"
_FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-fPIC", "-shared"]


@dataclass(frozen=True)
class WeightBlocks:
    """A weight [N, K] as GGUF blocks of 32 along K: `qs` uint8 [N, K / 32 * QS_BYTES],
    `scale` and (Q4_1) `min` float32 [N, K / 32]."""

    kind: str
    qs: torch.Tensor
    scale: torch.Tensor
    min: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.kind not in QS_BYTES:
            raise ValueError(f"block kind {self.kind!r} is not one of {sorted(QS_BYTES)}")
        rows, blocks = self.scale.shape
        assert self.qs.dtype == torch.uint8 and self.scale.dtype == torch.float32
        assert tuple(self.qs.shape) == (rows, blocks * QS_BYTES[self.kind])
        assert (self.min is None) == (self.kind == "q8_0")

    @property
    def shape(self) -> tuple[int, int]:
        rows, blocks = self.scale.shape
        return rows, blocks * BLOCK_SIZE

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors())

    @property
    def max_rows(self) -> int:
        return MAX_ROWS[self.kind]

    def padded_rows(self, rows: int) -> WeightBlocks:
        """With zero rows (zero weights) appended up to `rows`."""
        extra = rows - self.shape[0]
        return WeightBlocks(
            self.kind,
            *(
                None if t is None else torch.cat([t, t.new_zeros(extra, t.shape[1])])
                for t in (self.qs, self.scale, self.min)
            ),
        )

    @staticmethod
    def cat_rows(parts: list[WeightBlocks]) -> WeightBlocks:
        assert len({p.kind for p in parts}) == 1, "blocks of one weight share a kind"
        mins = None if parts[0].min is None else torch.cat([p.min for p in parts])
        return WeightBlocks(
            parts[0].kind,
            torch.cat([p.qs for p in parts]),
            torch.cat([p.scale for p in parts]),
            mins,
        )

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K], as GGUF's reference dequantizes it."""
        rows, blocks = self.scale.shape
        qs = self.qs.view(rows, blocks, QS_BYTES[self.kind])
        if self.kind == "q8_0":
            return (qs.view(torch.int8).float() * self.scale[..., None]).view(self.shape)
        q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).float()
        return (q * self.scale[..., None] + self.min[..., None]).view(self.shape)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] float32 @ weight.T -> [M, N]."""
        lib = kernel_library()
        if lib is None:
            raise RuntimeError("the block matmul kernel is not built (see kernel_library)")
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != self.shape[1]:
            raise RuntimeError(f"block matmul takes float32 [M, {self.shape[1]}], got {x.shape}")
        x = x.contiguous()
        out = torch.empty(x.shape[0], self.shape[0], dtype=torch.float32)
        status = lib.baton_block_matmul(
            _KIND_IDS[self.kind],
            x.data_ptr(),
            x.shape[0],
            x.shape[1],
            self.qs.data_ptr(),
            self.scale.data_ptr(),
            None if self.min is None else self.min.data_ptr(),
            out.data_ptr(),
            self.shape[0],
            torch.get_num_threads(),
        )
        if status != 0:
            raise RuntimeError(f"block matmul failed (status {status}) for x {tuple(x.shape)}")
        return out

    def _tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.qs, self.scale, self.min) if t is not None]


class BlockSource:
    """One weight's blocks in an open blocks file, read a slice at a time (a TP rank
    reads only its shard)."""

    def __init__(self, f, name: str, kind: str):
        self.f, self.name, self.kind = f, name, kind
        if kind not in QS_BYTES:
            raise ValueError(f"{name}: block kind {kind!r} is not one of {sorted(QS_BYTES)}")

    @property
    def shape(self) -> tuple[int, int]:
        rows, blocks = self.f.get_slice(f"{self.name}.scale").get_shape()
        return rows, blocks * BLOCK_SIZE

    def read(
        self, rows: slice = slice(None), columns: tuple[int, int] | None = None
    ) -> WeightBlocks:
        """Weight rows `rows` and columns [start, end) (block-aligned; all by default)."""
        start, end = columns or (0, self.shape[1])
        if start % BLOCK_SIZE or end % BLOCK_SIZE:
            raise ValueError(f"columns [{start}, {end}) do not fall on {BLOCK_SIZE}-blocks")
        b0, b1 = start // BLOCK_SIZE, end // BLOCK_SIZE
        size = QS_BYTES[self.kind]

        def part(suffix: str, lo: int, hi: int) -> torch.Tensor:
            return self.f.get_slice(f"{self.name}.{suffix}")[rows, lo:hi].contiguous()

        mins = part("min", b0, b1) if self.kind == "q4_1" else None
        return WeightBlocks(
            self.kind, part("qs", b0 * size, b1 * size), part("scale", b0, b1), mins
        )


_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_tried = False


def kernel_library() -> ctypes.CDLL | None:
    """The compiled kernel, built on first use (about two seconds); None where this
    CPU lacks AVX2/FMA or no C compiler is installed (logged once)."""
    global _library, _tried
    if _tried:  # every matmul asks: no lock once settled
        return _library
    with _lock:
        if not _tried:
            _tried = True
            _library = _load()
        return _library


def _load() -> ctypes.CDLL | None:
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        log.info("no AVX2 on this CPU: GGUF blocks unused, float32 weights only")
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler (cc, gcc) found: GGUF blocks unused, decoding runs slower")
        return None
    try:
        path = _build(compiler)
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or e
        log.warning("could not build the block matmul kernel with %s: %s", compiler, detail)
        return None
    lib = ctypes.CDLL(str(path))
    fn = lib.baton_block_matmul
    fn.restype = ctypes.c_int
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, ptr, ptr, ptr, i64, ctypes.c_int]
    return lib


def _build(compiler: str) -> Path:
    """Compiles the kernel into the cache once per source, flags and compiler; a
    finished file is renamed into place, so concurrent builders never see half of one."""
    source = _SOURCE.read_bytes()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(source + " ".join(_FLAGS).encode() + version.encode()).hexdigest()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    cache = Path(base) / "baton" / "kernels"
    target = cache / f"block_matmul-{key[:16]}.so"
    if target.is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".block_matmul-", suffix=".so", dir=cache)
    os.close(fd)
    try:
        subprocess.run(
            [compiler, *_FLAGS, "-o", tmp, str(_SOURCE)], check=True, capture_output=True, text=True
        )
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log.info("built the block matmul kernel: %s", target)
    return target
