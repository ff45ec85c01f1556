"""A GGUF tensor's quantized blocks in the forms the block kernel reads, exactly.

The kernel (block_matmul.py) multiplies by blocks of 32 weights that are `q8_0` (an
int8 per weight and one scale), `q8_16` (the same with a scale per 16 weights) or
`q4_1` (a 4-bit q per weight, a scale and a minimum: w = q * scale + min). Several GGUF
types are those forms in other packings:

- Q8_0 and Q4_1 are them, scales widened from float16 to float32;
- Q5_0 (w = d * (q - 16), q of 5 bits) is q8_0 with int8 values q - 16;
- Q4_K (superblocks of 256: eight sub-blocks of 32, each with a 6-bit scale and
  minimum, w = d * sc * q - dmin * m) is q4_1 with scale d * sc and min -dmin * m;
- Q6_K (superblocks of 256: sixteen sub-blocks of 16, each with an int8 scale,
  w = d * sc * (q - 32), q of 6 bits) is q8_16 with int8 values q - 32, scale d * sc.

So each of these repacks without changing a weight. Other types (Q5_K, Q2_K/Q3_K)
have no such form and stay float32-only.
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


def _q6_k(raw: np.ndarray) -> tuple[str, dict]:
    # Superblock of 256 (210 bytes): 128 bytes of low nibbles, 64 of 2-bit high parts,
    # 16 int8 sub-block scales, float16 d. Each half of 128 weights takes 64 low bytes
    # (weights j and j + 64 of the half in byte j's low and high nibble, j < 64) and 32
    # high bytes (bits 2i..2i+1 of byte j for weight 32 i + j).
    rows = raw.shape[0]
    sb = raw.reshape(rows, -1, 210)
    n = sb.shape[1]
    low = sb[:, :, :128].reshape(rows, n, 2, 1, 64) >> np.array([0, 4], np.uint8)[:, None]
    low = (low & 0x0F).reshape(rows, n, 2, 4, 32)
    high = sb[:, :, 128:192].reshape(rows, n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]
    high = high & 0x03  # [rows, n, 2, 4, 32]
    q = (low | (high << 4)).astype(np.int16) - 32  # weight 128 h + 32 i + j at [h, i, j]
    scale = _f16(sb[:, :, 208:210])[..., None] * sb[:, :, 192:208].view(np.int8).astype(np.float32)
    return "q8_16", {
        "qs": q.astype(np.int8).view(np.uint8).reshape(rows, -1),
        "scale": scale.reshape(rows, -1),
    }


_REPACKERS = {_Q.Q8_0: _q8_0, _Q.Q4_1: _q4_1, _Q.Q5_0: _q5_0, _Q.Q4_K: _q4_k, _Q.Q6_K: _q6_k}
