"""Block hashes: deterministic across processes, chained, salted, full blocks only."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from workers.engine.block_hash import BlockHash, hash_block, hash_full_blocks, root_hash

ROOT = Path(__file__).resolve().parent.parent
TOKENS = list(range(1000, 1040))  # two full blocks of 16 and a partial one of 8

_HASH_IN_CHILD = """
import json, sys
from workers.engine.block_hash import hash_full_blocks, root_hash
tokens, salt = json.loads(sys.argv[1])
root = root_hash("SmolLM2-135M-Instruct", salt)
# Python's own str hash comes last: it proves the two processes' seeds differ.
print(json.dumps([h.hex() for h in hash_full_blocks(tokens, 16, root)] + [hash("x")]))
"""


def _hashes_in_fresh_process(
    tokens: list[int], salt: str | None, hash_seed: str
) -> tuple[list[str], int]:
    env = {**os.environ, "PYTHONHASHSEED": hash_seed, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", _HASH_IN_CHILD, json.dumps([tokens, salt])],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    *hashes, builtin_hash = json.loads(out.stdout)
    return hashes, builtin_hash


def test_two_processes_with_different_hash_seeds_agree():
    a, builtin_a = _hashes_in_fresh_process(TOKENS, "tenant-1", "1")
    b, builtin_b = _hashes_in_fresh_process(TOKENS, "tenant-1", "2")
    # The seeds really differ (Python's own str hash changes) ...
    assert builtin_a != builtin_b
    # ... yet the block hashes do not, and they match this process's too.
    assert a == b
    here = hash_full_blocks(TOKENS, 16, root_hash("SmolLM2-135M-Instruct", "tenant-1"))
    assert a == [h.hex() for h in here]
    assert len(a) == 2


def test_hash_is_sha256_over_the_documented_encoding():
    parent = root_hash("m", None)
    tokens = [1, 2, 70000, 2**31 - 1]
    packed = struct.pack("<4i", *tokens)
    data = (
        b"baton-block-hash/v1block"
        + b"p"
        + struct.pack("<Q", 32)
        + parent.digest
        + b"t"
        + struct.pack("<Q", len(packed))
        + packed
        + struct.pack("<Q", 0)
    )
    assert hash_block(parent, tokens).digest == hashlib.sha256(data).digest()
    # Little-endian int32, whatever the host's byte order.
    assert packed[:4] == b"\x01\x00\x00\x00"


def test_only_full_blocks_are_hashed():
    root = root_hash("m", None)
    assert hash_full_blocks(list(range(15)), 16, root) == []
    assert len(hash_full_blocks(list(range(16)), 16, root)) == 1
    assert len(hash_full_blocks(list(range(47)), 16, root)) == 2
    # The partial tail changes nothing about the full blocks before it.
    assert hash_full_blocks(list(range(47)), 16, root) == hash_full_blocks(
        list(range(32)), 16, root
    )


def test_hashes_chain_so_a_block_depends_on_everything_before_it():
    root = root_hash("m", None)
    a = hash_full_blocks([1] * 16 + [2] * 16, 16, root)
    b = hash_full_blocks([3] * 16 + [2] * 16, 16, root)
    # The same second block after a different first block is a different prefix.
    assert a[1] != b[1]
    assert a[1] == hash_block(hash_block(root, [1] * 16), [2] * 16)


def test_salts_and_models_give_different_roots_and_hashes():
    roots = [
        root_hash("m", None),
        root_hash("m", ""),
        root_hash("m", "a"),
        root_hash("m", "b"),
        root_hash("other", None),
    ]
    assert len(set(roots)) == len(roots)
    firsts = {hash_full_blocks(TOKENS, 16, r)[0] for r in roots}
    assert len(firsts) == len(roots)
    assert root_hash("m", "a") == root_hash("m", "a")


def test_encoding_is_unambiguous():
    root = root_hash("m", None)
    # Length prefixes: moving bytes between fields never yields the same input.
    assert root_hash("ab", "c") != root_hash("a", "bc")
    assert hash_block(root, [1, 2], extra=("ab",)) != hash_block(root, [1, 2], extra=("a", "b"))
    assert hash_block(root, [1, 2], extra=(1,)) != hash_block(root, [1, 2], extra=("1",))
    assert hash_block(root, [1, 2], extra=(b"1",)) != hash_block(root, [1, 2], extra=("1",))
    assert hash_block(root, [1, 2]) != hash_block(root, [1, 2], extra=("",))
    assert hash_block(root, [1]) != hash_block(root, [1, 0])


def test_block_hash_is_typed_hashable_and_picklable():
    h = hash_block(root_hash("m", None), [5] * 16)
    assert isinstance(h, BlockHash)
    assert len(h.digest) == 32
    assert repr(h) == f"BlockHash({h.hex()[:12]})"
    assert BlockHash.from_hex(h.hex()) == h
    assert pickle.loads(pickle.dumps(h)) == h
    assert {h: 1}[BlockHash(h.digest)] == 1
    assert h != h.digest  # a BlockHash is not a bare bytes value
    with pytest.raises(AttributeError):
        h.digest = b"x" * 32


@pytest.mark.parametrize("digest", [b"", b"x" * 31, b"x" * 33, "a" * 32])
def test_block_hash_refuses_anything_but_32_bytes(digest):
    with pytest.raises(ValueError, match="32 bytes"):
        BlockHash(digest)


def test_bad_inputs_are_refused_with_a_hint():
    root = root_hash("m", None)
    with pytest.raises(ValueError, match="int32"):
        hash_block(root, [2**31])
    with pytest.raises(ValueError, match="extra keys"):
        hash_block(root, [1], extra=(1.5,))
    with pytest.raises(ValueError, match="extra keys"):
        hash_block(root, [1], extra=(True,))
    with pytest.raises(ValueError, match="model_id"):
        root_hash("", None)
    with pytest.raises(ValueError, match="block_size"):
        hash_full_blocks([1, 2], 0, root)
