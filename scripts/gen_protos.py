"""Regenerates the Python gRPC modules from every `protos/**/*.proto`.

    python scripts/gen_protos.py            # rewrite serve_app/grpc/api/*_pb2*.py[i]
    python scripts/gen_protos.py --check    # exit 1 if the checked-in modules are stale

Runs `grpc_tools.protoc` (python_out, grpc_python_out, pyi_out) with the `protos/` tree
and grpc_tools' bundled well-known types on the include path, flattens the output into
one package and rewrites protoc's absolute imports between generated modules
(`from baton.v1 import baton_pb2`) into relative ones (`from . import baton_pb2`), and
the module name the message classes record, so they import (and unpickle) as
`serve_app.grpc.api.*` from the installed package. Output depends on
the grpcio-tools version; tests/test_protos.py checks the checked-in files are current.
"""

from __future__ import annotations

import argparse
import difflib
import re
import subprocess
import sys
import tempfile
from importlib import metadata, resources
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROTO_ROOT = ROOT / "protos"
DEFAULT_OUT = ROOT / "serve_app" / "grpc" / "api"
# The import path of the generated modules: their message classes must say so in
# __module__, or pickle (Ray shipping a request between processes) cannot find them.
PYTHON_PACKAGE = "serve_app.grpc.api"
# What protoc writes per .proto; anything else in the package (__init__.py) is hand-written.
GENERATED_SUFFIXES = ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")


def _header() -> str:
    version = metadata.version("grpcio-tools")
    return (
        f"# Generated from protos/ by scripts/gen_protos.py (grpcio-tools {version}).\n"
        "# Do not edit: change the .proto and run `python scripts/gen_protos.py`.\n"
    )


def proto_files(proto_root: Path = PROTO_ROOT) -> list[Path]:
    """Every .proto under proto_root, relative to it, in a stable order."""
    return sorted(p.relative_to(proto_root) for p in proto_root.rglob("*.proto"))


def is_generated(path: Path) -> bool:
    return path.name.endswith(GENERATED_SUFFIXES)


def _well_known_include() -> Path:
    # google/protobuf/*.proto (empty, timestamp, ...) ship inside grpc_tools.
    return Path(str(resources.files("grpc_tools") / "_proto"))


def _run_protoc(protos: list[Path], proto_root: Path, out: Path) -> None:
    # In a process of its own: protoc's bundled C++ libraries (protobuf, abseil) clash
    # with other copies a process may have loaded already (NIXL's, for one) and crash it.
    args = [
        f"--proto_path={proto_root}",
        f"--proto_path={_well_known_include()}",
        f"--python_out={out}",
        f"--grpc_python_out={out}",
        f"--pyi_out={out}",
        *(p.as_posix() for p in protos),
    ]
    run = subprocess.run([sys.executable, "-m", "grpc_tools.protoc", *args], check=False)
    if run.returncode != 0:
        raise RuntimeError(f"protoc failed (its errors are above): {' '.join(args)}")


def _relative_imports(text: str, modules: dict[str, str]) -> str:
    """Rewrites imports of our own generated modules; google.protobuf ones stay absolute.

    `modules` maps each generated module's name to its protoc package path ("baton.v1"
    for baton/v1/baton.proto, "" for a proto at the root of protos/).
    """
    for name, package in modules.items():
        if package:
            pattern = rf"^from {re.escape(package)} import {name}\b"
        else:
            pattern = rf"^import {name}\b"
        text = re.sub(pattern, f"from . import {name}", text, flags=re.MULTILINE)
        # protoc names the module after the .proto's path ("baton.v1.baton_pb2").
        qualified = f"{package}.{name}" if package else name
        text = text.replace(f"'{qualified}'", f"'{PYTHON_PACKAGE}.{name}'")
    return text


def generate(out_dir: Path, proto_root: Path = PROTO_ROOT) -> list[Path]:
    """Generates the modules for every .proto under proto_root into out_dir (flat).

    Generated files already in out_dir that no .proto produces any more are deleted;
    anything else there (the hand-written __init__.py) is left alone. Returns the written
    paths, sorted.
    """
    protos = proto_files(proto_root)
    if not protos:
        raise RuntimeError(f"no .proto files under {proto_root}")
    stems: dict[str, Path] = {}
    for proto in protos:
        if proto.stem in stems:
            raise RuntimeError(
                f"{proto} and {stems[proto.stem]} would both generate {proto.stem}_pb2 "
                "in one flat package; rename one"
            )
        stems[proto.stem] = proto
    modules = {
        f"{proto.stem}{kind}": ".".join(proto.parent.parts)
        for proto in protos
        for kind in ("_pb2", "_pb2_grpc")
    }

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    header = _header()
    written = []
    with tempfile.TemporaryDirectory() as tmp:
        _run_protoc(protos, proto_root, Path(tmp))
        for produced in sorted(Path(tmp).rglob("*")):
            if not produced.is_file():
                continue
            if not is_generated(produced):
                raise RuntimeError(f"protoc wrote an unexpected file: {produced.name}")
            text = header + _relative_imports(produced.read_text(encoding="utf-8"), modules)
            target = out_dir / produced.name
            target.write_bytes(text.encode("utf-8"))
            written.append(target)
    for stale in out_dir.iterdir():
        if stale.is_file() and is_generated(stale) and stale not in written:
            stale.unlink()
    return sorted(written)


def stale_files(checked_in: Path, regenerated: Path) -> dict[str, str]:
    """Generated files that differ between two directories: name -> a short explanation."""
    ours = {p.name for p in checked_in.iterdir() if p.is_file() and is_generated(p)}
    fresh = {p.name for p in regenerated.iterdir() if p.is_file() and is_generated(p)}
    problems = {name: "missing (never generated)" for name in fresh - ours}
    problems.update({name: "no .proto produces it any more" for name in ours - fresh})
    for name in sorted(ours & fresh):
        old, new = (checked_in / name).read_bytes(), (regenerated / name).read_bytes()
        if old != new:
            diff = difflib.unified_diff(
                old.decode("utf-8", "replace").splitlines(),
                new.decode("utf-8", "replace").splitlines(),
                f"checked-in/{name}",
                f"regenerated/{name}",
                lineterm="",
                n=1,
            )
            problems[name] = "differs:\n" + "\n".join(list(diff)[:40])
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output package folder")
    parser.add_argument(
        "--check", action="store_true", help="only report whether --out is up to date"
    )
    args = parser.parse_args(argv)
    if args.check:
        with tempfile.TemporaryDirectory() as tmp:
            generate(Path(tmp))
            problems = stale_files(args.out, Path(tmp))
        for name, why in sorted(problems.items()):
            print(f"{name}: {why}", file=sys.stderr)
        if problems:
            print("stale: run `python scripts/gen_protos.py`", file=sys.stderr)
        return 1 if problems else 0
    for path in generate(args.out):
        print(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
