"""Baton's policy for Serve's ingress, each node's HAProxy: timeouts for a request's
headers and body, connection limits per frontend, an oversized header refused for its
call alone, errors in each API's own shape (OpenAI JSON, gRPC status), and nothing but
the APIs on public interfaces (haproxy_policy.py). Serve writes HAProxy's config and
starts it; `baton-haproxy` (haproxy_launcher.py), the binary Serve is told to run
(RAY_SERVE_HAPROXY_BINARY_PATH), applies the policy to each config Serve writes and
runs HAProxy on the result. Standard library only: it runs at every HAProxy reload."""

from serve_app.ingress.haproxy_launcher import SERVE_BINARY_ENV
from serve_app.ingress.haproxy_policy import IngressPolicy, apply_policy

__all__ = ["SERVE_BINARY_ENV", "IngressPolicy", "apply_policy"]
