"""A GGUF tensor's quantized blocks in the two forms the block kernel reads, exactly.

The kernel (block_matmul.py) multiplies by blocks of 32 weights that are either
`q8_0` (an int8 per weight and one scale) or `q4_1` (a 4-bit q per weight, a scale and
a minimum: w = q * scale + min). Several GGUF types are those forms in other packings:

- Q8_0 and Q4_1 are them, scales widened from float16 to float32;
- Q5_0 (w = d * (q - 16), q of 5 bits) is q8_0 with int8 values q - 16;
- Q4_K (superblocks of 256: eight sub-blocks of 32, each with a 6-bit scale and
  minimum, w = d * sc * q - dmin * m) is q4_1 with scale d * sc and min -dmin * m.

So each of these repacks without changing a weight. Other types (Q6_K's sub-blocks
of 16, Q5_K, Q2_K/Q3_K) have no such form and stay float32-only.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType

__all__ = ["repack"]

_Q = GGMLQuantizationType


def repack(kind: GGMLQuantizationType, data: np.ndarray, rows: int) -> tuple[str, dict] | None:
    """(kernel kind, {"qs", "scale"[, "min"]}) of a [rows, K] tensor stored as `kind`;
    None for a type with no exact form. `data` is the tensor's raw bytes."""
    repacker = _REPACKERS.get(kind)
    if repacker is None:
        return None
    return repacker(np.asarray(data, dtype=np.uint8).reshape(rows, -1))


def _f16(raw: np.ndarray) -> np.ndarray:
    """float32 of little-endian float16 byte pairs in the last axis ([..., 2] -> [...])."""
    return np.ascontiguousarray(raw).view("<f2")[..., 0].astype(np.float32)


def _q8_0(raw: np.ndarray) -> tuple[str, dict]:
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, 34)
    return "q8_0", {"qs": blocks[:, :, 2:].reshape(rows, -1), "scale": _f16(blocks[:, :, :2])}


def _q4_1(raw: np.ndarray) -> tuple[str, dict]:
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, 20)
    return "q4_1", {
        "qs": blocks[:, :, 4:].reshape(rows, -1),
        "scale": _f16(blocks[:, :, 0:2]),
        "min": _f16(blocks[:, :, 2:4]),
    }


def _q5_0(raw: np.ndarray) -> tuple[str, dict]:
    # Block: float16 d, 32 high bits (uint32, bit j for weight j), 16 bytes of low
    # nibbles (byte j: weight j low, weight j + 16 high).
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, 22)
    high_bits = np.ascontiguousarray(blocks[:, :, 2:6]).view("<u4")  # [rows, n, 1]
    high = (high_bits >> np.arange(32, dtype=np.uint32)) & 1  # [rows, n, 32]
    nibbles = blocks[:, :, 6:]
    low = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1)
    values = (low | (high.astype(np.uint8) << 4)).astype(np.int16) - 16
    return "q8_0", {
        "qs": values.astype(np.int8).view(np.uint8).reshape(rows, -1),
        "scale": _f16(blocks[:, :, :2]),
    }


def _q4_k(raw: np.ndarray) -> tuple[str, dict]:
    # Superblock of 256: float16 d and dmin, 12 bytes of eight 6-bit (scale, min) pairs,
    # 128 bytes of nibbles: chunk c's 32 bytes hold sub-block 2c low, 2c + 1 high.
    rows = raw.shape[0]
    sb = raw.reshape(rows, -1, 144)
    d, dmin = _f16(sb[:, :, 0:2]), _f16(sb[:, :, 2:4])
    s = sb[:, :, 4:16].astype(np.uint8)
    sc = np.concatenate(
        [s[..., 0:4] & 63, (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)], axis=-1
    )
    m = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
    scale = d[..., None] * sc.astype(np.float32)  # [rows, n, 8]
    minimum = -(dmin[..., None] * m.astype(np.float32))
    chunks = sb[:, :, 16:].reshape(rows, -1, 4, 32)
    q = np.stack([chunks & 0x0F, chunks >> 4], axis=3)  # [rows, n, 4, 2, 32]: sub-block 2c + h
    q = q.reshape(rows, -1, 32)  # one row of 32 per sub-block, in order
    packed = q[:, :, :16] | (q[:, :, 16:] << 4)  # q4_1: byte b holds weights b and b + 16
    return "q4_1", {
        "qs": packed.reshape(rows, -1),
        "scale": scale.reshape(rows, -1),
        "min": minimum.reshape(rows, -1),
    }


_REPACKERS = {_Q.Q8_0: _q8_0, _Q.Q4_1: _q4_1, _Q.Q5_0: _q5_0, _Q.Q4_K: _q4_k}
