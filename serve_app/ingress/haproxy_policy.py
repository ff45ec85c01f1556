"""Baton's ingress policy, applied to the HAProxy config Serve writes.

Serve's config (ray/serve/_private/haproxy_templates.py) has no timeout for a request's
headers, one connection limit for every frontend, HAProxy's default 16 KB buffer (a
larger header block is an HTTP/2 connection error: every stream on the connection dies),
a plain-text 500 for every error HAProxy answers itself, and its stats page and metrics
on every interface, with an admin socket any local user may use. None of that is a
setting Serve takes, so the policy rewrites the config, section by section:

- global: a buffer that holds `max_header_bytes` of headers with room to spare, and an
  admin socket for its owner only;
- defaults: `timeout http-request` (the headers, and with http-buffer-request the body
  as far as one buffer holds it, must arrive within `header_timeout_s`), and errors
  HAProxy answers itself (no router reachable, a router that died mid-request) as a
  retryable 503 in OpenAI's error shape with Retry-After;
- each API frontend: its own connection limit, and a header block past
  `max_header_bytes` refused for that call alone (HTTP 431 in OpenAI's shape; gRPC
  RESOURCE_EXHAUSTED); gRPC's errors as gRPC status UNAVAILABLE;
- the stats page and the Prometheus exporter: on loopback only.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields

# Error pages (HAProxy errorfiles), by the name the launcher writes them under.
HTTP_ERROR_PAGE = "baton-503.http"
GRPC_ERROR_PAGE = "baton-grpc-unavailable.http"
# The errors HAProxy answers itself that the pages replace: no server, bad gateway (the
# server died before it answered), gateway timeout. Each is retryable.
_REPLACED_ERRORS = ("502", "503", "504")
# Above the largest header block taken: HTTP/2 headers are decoded whole into a buffer.
_BUFFER_HEADROOM = 2


@dataclass(frozen=True)
class IngressPolicy:
    """What the ingress allows; `from_env` reads it from BATON_INGRESS_* variables (the
    launcher's environment, which Serve's controller passes on)."""

    # The most a request's headers (and a body that fits one buffer) may take to arrive.
    header_timeout_s: int = 10
    # The largest header block (HTTP headers, gRPC metadata) taken, in bytes.
    max_header_bytes: int = 16384
    # Connections each API frontend (HTTP, gRPC) holds at once; more wait in the kernel.
    frontend_maxconn: int = 2048
    # Seconds a client is told to wait before it retries a 503.
    retry_after_s: int = 1

    def __post_init__(self) -> None:
        bounds = {
            "header_timeout_s": (1, 3600),
            "max_header_bytes": (1024, 1 << 20),
            "frontend_maxconn": (1, 1 << 20),
            "retry_after_s": (0, 3600),
        }
        for name, (low, high) in bounds.items():
            value = getattr(self, name)
            if not low <= value <= high:
                raise ValueError(f"{_env_name(name)} must be in [{low}, {high}], got {value}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> IngressPolicy:
        given = {}
        for f in fields(cls):
            text = environ.get(_env_name(f.name))
            if text is None:
                continue
            try:
                given[f.name] = int(text)
            except ValueError:
                raise ValueError(f"{_env_name(f.name)} must be an integer, got {text!r}") from None
        return cls(**given)

    @property
    def bufsize(self) -> int:
        return _BUFFER_HEADROOM * self.max_header_bytes


def _env_name(field: str) -> str:
    return f"BATON_INGRESS_{field.upper()}"


def error_pages(policy: IngressPolicy) -> dict[str, bytes]:
    """The errorfiles the policy's config names, by file name."""
    message = "the service could not pass the request to a router; retry it"
    body = json.dumps(
        {
            "error": {
                "message": message,
                "type": "service_unavailable_error",
                "param": None,
                "code": None,
            }
        }
    ).encode()
    http = (
        b"HTTP/1.1 503 Service Unavailable\r\n"
        b"content-type: application/json\r\n"
        + f"retry-after: {policy.retry_after_s}\r\n".encode()
        + b"cache-control: no-cache\r\n"
        + f"content-length: {len(body)}\r\n\r\n".encode()
        + body
    )
    # Trailers-only, as a gRPC server answers a call it refuses.
    grpc = (
        b"HTTP/1.1 200 OK\r\n"
        b"content-type: application/grpc\r\n"
        b"grpc-status: 14\r\n"
        + f"grpc-message: {message}\r\n".encode()  # printable ASCII: sent as is
        + b"content-length: 0\r\n\r\n"
    )
    return {HTTP_ERROR_PAGE: http, GRPC_ERROR_PAGE: grpc}


def apply_policy(config: str, policy: IngressPolicy, pages_dir: str) -> str:
    """Serve's HAProxy `config` with the policy applied; the error pages are named in
    `pages_dir` (error_pages' files)."""
    http_page = os.path.join(pages_dir, HTTP_ERROR_PAGE)
    grpc_page = os.path.join(pages_dir, GRPC_ERROR_PAGE)
    out: list[str] = []
    section = ""
    for line in config.splitlines():
        if line[:1].strip() and not line.startswith("#"):  # a section's first line
            section = " ".join(line.split()[:2])
            out.append(line)
            out.extend(_section_start(section, policy, http_page, grpc_page))
            continue
        rewritten = _rewritten(section, line, policy)
        if rewritten is not None:
            out.append(rewritten)
    return "\n".join(out) + "\n"


def _section_start(
    section: str, policy: IngressPolicy, http_page: str, grpc_page: str
) -> list[str]:
    """Lines the policy puts first in a section (http-request rules run in order)."""
    indent = "    "
    if section == "defaults":
        return [
            f"{indent}timeout http-request {policy.header_timeout_s}s",
            *_errorfiles(http_page, indent),
        ]
    too_large = f"{{ req.hdrs,length gt {policy.max_header_bytes} }}"
    message = (
        f"the request's headers exceed {policy.max_header_bytes} bytes; send less "
        "(a long value belongs in the body)"
    )
    if section == "frontend http_frontend":
        body = json.dumps(
            {
                "error": {
                    "message": message,
                    "type": "invalid_request_error",
                    "param": None,
                    "code": "request_header_fields_too_large",
                }
            }
        )
        return [
            f"{indent}maxconn {policy.frontend_maxconn}",
            f"{indent}option http-buffer-request",
            f"{indent}http-request return status 431 content-type application/json "
            f"string {_quoted(body)} if {too_large}",
        ]
    if section == "frontend grpc_frontend":
        return [
            f"{indent}maxconn {policy.frontend_maxconn}",
            f"{indent}http-request return status 200 content-type application/grpc "
            f"hdr grpc-status 8 hdr grpc-message {_quoted(message)} "
            f"if {too_large}",
            *_errorfiles(grpc_page, indent),
        ]
    if section.startswith(("backend grpc", "backend default_grpc")):
        return _errorfiles(grpc_page, indent)
    return []


def _errorfiles(page: str, indent: str) -> list[str]:
    return [f"{indent}errorfile {code} {page}" for code in _REPLACED_ERRORS]


def _rewritten(section: str, line: str, policy: IngressPolicy) -> str | None:
    """The line as the policy has it (None: dropped)."""
    words = line.split()
    indent = line[: len(line) - len(line.lstrip())]
    if not words:
        return line
    if section == "global" and words[:2] == ["stats", "socket"] and "mode" in words:
        at = words.index("mode") + 1
        words[at] = "600"  # the admin socket: its owner (the HAProxyManager) only
        return indent + " ".join(words)
    if section == "global" and words[0] == "tune.bufsize":
        return f"{indent}tune.bufsize {max(int(words[1]), policy.bufsize)}"
    if section == "defaults" and words[0] == "errorfile" and words[1] in _REPLACED_ERRORS:
        return None  # Serve's plain-text 500: the policy's page is named first
    if section in ("frontend prometheus", "listen stats") and words[0] == "bind":
        port = words[1].rsplit(":", 1)[1]
        return indent + " ".join(["bind", f"127.0.0.1:{port}", *words[2:]])
    return line


def _quoted(text: str) -> str:
    """`text` as one double-quoted HAProxy argument."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
