"""Who may call the service: bearer API keys, checked by the router on every request
except health checks (gRPC `authorization` metadata, HTTP `Authorization` header, both
`Bearer <key>`, as OpenAI clients send it).

The keys never enter the AppConfig: a Serve config's args are readable by anyone who can
read the application's status. `AppConfig.api_key_file` names a file on the router's
machine holding them instead, one per line (the Helm chart mounts a Secret there). The
router reads it again whenever it changes, so keys rotate without a restart: add the new
key, move the clients, remove the old one. Only digests are kept, and a presented key is
compared with each of them in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
from collections.abc import Iterable
from pathlib import Path

logger = logging.getLogger(__name__)

SCHEME = "bearer"


class Unauthenticated(Exception):
    """The request carries no key, or a key that is not one of the service's."""


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def _read_keys(path: Path) -> tuple[bytes, ...]:
    """The digests of the file's keys (one per line; blank lines and `#` comments skipped);
    ValueError naming the file when it cannot be read or holds none."""
    try:
        lines = path.read_text(encoding="utf-8-sig").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"api_key_file {str(path)!r} cannot be read: {e}") from None
    keys = [k for k in (line.strip() for line in lines) if k and not k.startswith("#")]
    for number, key in enumerate(keys, 1):
        # HTTP headers carry ASCII: any other key could never be presented.
        if not (key.isascii() and key.isprintable()) or " " in key:
            raise ValueError(
                f"api_key_file {str(path)!r}: key {number} holds characters other than "
                "printable ASCII without spaces; a client could never send it"
            )
    if not keys:
        raise ValueError(
            f"api_key_file {str(path)!r} holds no key: write one key per line (Helm: the "
            "Secret named by apiKey.secretName), or unset api_key_file to serve without keys"
        )
    return tuple(_digest(k) for k in keys)


class ApiKeys:
    """The keys in `path`, read now (ValueError if there are none: a router that should
    check keys must not start open) and again whenever the file changes."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._version = self._stat()
        self._digests = _read_keys(self.path)

    def _stat(self) -> tuple[int, int, int, int] | None:
        try:
            st = self.path.stat()  # follows the symlinks Kubernetes swaps on an update
        except OSError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_size)

    def _refresh(self) -> None:
        version = self._stat()
        if version == self._version:
            return
        self._version = version
        try:
            self._digests = _read_keys(self.path)
        except ValueError as e:
            # Mid-rotation (or a mistake): the last good keys stay, rather than letting
            # every caller in or locking every caller out.
            logger.warning("keeping the previous API keys: %s", e)

    def check(self, authorization: str | None) -> None:
        """Raises Unauthenticated unless `authorization` is `Bearer <one of the keys>`."""
        self._refresh()
        scheme, _, key = (authorization or "").strip().partition(" ")
        if scheme.lower() != SCHEME or not key.strip():
            raise Unauthenticated("missing API key: send the header 'Authorization: Bearer <key>'")
        presented = _digest(key.strip())
        # Every digest is compared, so the time taken does not tell which key came close.
        if not any([hmac.compare_digest(presented, d) for d in self._digests]):
            raise Unauthenticated("invalid API key")


def authorization(metadata: Iterable[tuple[str, str | bytes]]) -> str | None:
    """The `authorization` entry of gRPC invocation metadata (keys arrive lower-cased)."""
    for key, value in metadata:
        if key == "authorization":
            return value.decode() if isinstance(value, bytes) else value
    return None
