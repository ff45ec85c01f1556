"""A Python program prologue under which torch cannot be imported, for checking that the
`baton` client commands load no engine code (test_cli_imports.py, and `baton scale`
against a live service in test_service_lifecycle.py)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

# A meta-path finder, first in line, that refuses torch as if it were not installed.
NO_TORCH = textwrap.dedent(
    """
    import sys

    class _NoTorch:
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError(f"{name} is not importable in this test")
            return None

    sys.meta_path.insert(0, _NoTorch())
    """
)


def run_without_torch(*code: str, env: dict[str, str] | None = None, timeout: float = 120):
    """Runs the code pieces in a fresh interpreter that cannot import torch."""
    program = "".join(textwrap.dedent(piece) for piece in (NO_TORCH, *code))
    return subprocess.run(
        [sys.executable, "-c", program],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
