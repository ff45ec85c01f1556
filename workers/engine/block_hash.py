"""Content hashes of full KV-cache blocks: the one hash every process agrees on.

A block's hash chains its parent's hash with its own token ids, so equal hashes
mean equal prefixes, not just equal blocks. The chain starts at a root derived
from the model identity and the request's cache salt, so tenants with different
salts never share a block. SHA-256 over a canonical, length-prefixed encoding
(never Python's `hash()`, which is seeded per process) makes the router, every
replica and the prefix registry compute identical hashes on any node.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["BlockHash", "ExtraKey", "hash_block", "hash_full_blocks", "root_hash"]

DIGEST_BYTES = 32
# Bumped whenever the encoding changes, so old and new hashes can never match.
_VERSION = b"baton-block-hash/v1"

ExtraKey = str | int | bytes


@dataclass(frozen=True, slots=True)
class BlockHash:
    """SHA-256 digest identifying a block and everything before it."""

    digest: bytes

    def __post_init__(self) -> None:
        if not isinstance(self.digest, bytes) or len(self.digest) != DIGEST_BYTES:
            raise ValueError(
                f"a BlockHash is {DIGEST_BYTES} bytes, got {self.digest!r}; build one with "
                "hash_block / root_hash or BlockHash.from_hex"
            )

    @classmethod
    def from_hex(cls, text: str) -> BlockHash:
        return cls(bytes.fromhex(text))

    def hex(self) -> str:
        return self.digest.hex()

    def __repr__(self) -> str:
        return f"BlockHash({self.digest[:6].hex()})"


def _field(tag: bytes, payload: bytes) -> bytes:
    # Tag + length prefix: no two different field lists encode to the same bytes.
    return tag + struct.pack("<Q", len(payload)) + payload


def _extra_field(key: ExtraKey) -> bytes:
    # bool is an int subclass; refusing it keeps True and 1 from meaning the same key.
    if isinstance(key, bool):
        raise ValueError(f"extra keys must be str, int or bytes, got bool {key!r}")
    if isinstance(key, str):
        return _field(b"s", key.encode("utf-8"))
    if isinstance(key, bytes):
        return _field(b"b", key)
    if isinstance(key, int):
        return _field(b"i", str(key).encode("ascii"))
    raise ValueError(f"extra keys must be str, int or bytes, got {type(key).__name__}")


def root_hash(model_id: str, cache_salt: str | None) -> BlockHash:
    """The parent of a request's first block: the model identity and the tenant's salt."""
    if not model_id:
        raise ValueError("model_id must be a non-empty string naming the served model")
    # None and "" are different salts: a request without a salt is its own tenant.
    salt = b"n" if cache_salt is None else _field(b"s", cache_salt.encode("utf-8"))
    data = _VERSION + b"root" + _field(b"m", model_id.encode("utf-8")) + salt
    return BlockHash(hashlib.sha256(data).digest())


def hash_block(
    parent: BlockHash, token_ids: Sequence[int], extra: Sequence[ExtraKey] = ()
) -> BlockHash:
    """Hash of one block given its parent's hash, its token ids and any extra keys."""
    try:
        tokens = struct.pack(f"<{len(token_ids)}i", *token_ids)
    except struct.error as e:
        raise ValueError(f"token ids must be int32 values: {e}") from None
    h = hashlib.sha256(_VERSION + b"block")
    h.update(_field(b"p", parent.digest))
    h.update(_field(b"t", tokens))
    h.update(struct.pack("<Q", len(extra)))
    for key in extra:
        h.update(_extra_field(key))
    return BlockHash(h.digest())


def hash_full_blocks(
    token_ids: Sequence[int],
    block_size: int,
    root: BlockHash,
    extra: Sequence[ExtraKey] = (),
) -> list[BlockHash]:
    """Chained hashes of every full block of `token_ids`; a trailing partial block has none."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    hashes: list[BlockHash] = []
    parent = root
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size], extra)
        hashes.append(parent)
    return hashes
