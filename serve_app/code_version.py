"""The digest of Baton's own code that pins each deployment's version (app.py).

A module of its own, free of the engine: `baton scale` compares it with the version the
service was deployed with, in a driver that never imports torch.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path


@functools.cache
def source_digest() -> str:
    """Digest of Baton's own code, so a redeploy after a code change does roll replicas."""
    digest = hashlib.sha256()
    root = Path(__file__).resolve().parents[1]
    for package in ("serve_app", "workers"):
        for path in sorted((root / package).rglob("*.py")):
            digest.update(path.relative_to(root).as_posix().encode() + path.read_bytes())
    return digest.hexdigest()
