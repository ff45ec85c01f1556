"""The import rules of the code base, read from the sources (every import statement,
function-level ones included): serve_app uses workers only through the package faces,
workers never imports serve_app, the workers folders form layers with no loop, and
serving code never reaches past AsyncEngine into the engine it wraps."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# What serving code may import of workers: each package's __init__.py.
FACES = {"workers.engine", "workers.model", "workers.runner"}

# workers' folders (and top-level modules), lowest first: each imports only those before it.
LAYERS = ["torch_threads", "heap_policy", "errors", "model", "kv", "runner", "engine"]


def _modules(package: str) -> Iterator[tuple[str, Path]]:
    for path in sorted((ROOT / package).rglob("*.py")):
        if "grpc_api" in path.parts:  # generated stubs
            continue
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        yield name, path


def _imports(path: Path) -> Iterator[tuple[int, str]]:
    """(line, module) of every import in the file, `from a import b` giving `a`."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.lineno, node.module


def _layer(module: str) -> str:
    return module.split(".")[1]


def test_serve_app_imports_workers_only_through_the_package_faces():
    offences = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for _, path in _modules("serve_app")
        for line, module in _imports(path)
        if module.startswith("workers") and module not in FACES
    ]
    assert offences == [], "use workers.engine / workers.model / workers.runner:\n" + "\n".join(
        offences
    )


def test_the_faces_export_what_they_name():
    import importlib

    for face in FACES:
        module = importlib.import_module(face)
        missing = [name for name in module.__all__ if not hasattr(module, name)]
        assert missing == [], f"{face}.__all__ names what it lacks: {missing}"


def test_workers_never_imports_serve_app():
    offences = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for _, path in _modules("workers")
        for line, module in _imports(path)
        if module.split(".")[0] == "serve_app"
    ]
    assert offences == []


def test_workers_folders_are_layers_with_no_loop():
    """model <- kv <- runner <- engine: a folder imports only the ones below it (itself
    aside), so the TP group and the engine no longer import each other."""
    offences = []
    for name, path in _modules("workers"):
        if name == "workers":
            continue
        own = LAYERS.index(_layer(name))
        for line, module in _imports(path):
            if not module.startswith("workers."):
                continue
            if LAYERS.index(_layer(module)) > own:
                offences.append(
                    f"{path.relative_to(ROOT)}:{line} ({_layer(name)}) imports {module}"
                )
    assert offences == [], "a lower layer imports a higher one:\n" + "\n".join(offences)


def test_every_workers_folder_is_a_known_layer():
    folders = {p.name for p in (ROOT / "workers").iterdir() if (p / "__init__.py").exists()}
    modules = {p.stem for p in (ROOT / "workers").glob("*.py") if p.stem != "__init__"}
    assert folders | modules == set(LAYERS)


def test_serving_code_never_reaches_into_the_engine_an_async_engine_wraps():
    """The one-thread rule kept by the API: AsyncEngine's `_engine` is its own."""
    offences = [
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for _, path in _modules("serve_app")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute) and node.attr == "_engine"
    ]
    assert offences == []


# serve_app's top: the deployments and what builds and deploys them. Its subfolders
# (grpc, openai, routing, streaming, handoff) never import these; ops, the operator's
# driver side, is the highest layer and imports anything.
_SERVE_APP_TOP = ("serve_app.app", "serve_app.router", "serve_app.engine_server", "serve_app.ops")


def test_serve_app_folders_never_import_the_deployments_or_the_cli():
    offences = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for name, path in _modules("serve_app")
        if name.count(".") >= 2 and not name.startswith("serve_app.ops")
        for line, module in _imports(path)
        if any(module == top or module.startswith(top + ".") for top in _SERVE_APP_TOP)
    ]
    assert offences == [], "an arrow points up:\n" + "\n".join(offences)


def test_only_ops_imports_ops():
    offences = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for name, path in _modules("serve_app")
        if not name.startswith("serve_app.ops")
        for line, module in _imports(path)
        if module.startswith("serve_app.ops")
    ]
    assert offences == []
