"""The import layers of loka_train, read from the source with ``ast`` (nothing is imported).

Every import counts: at module level, inside functions, and under ``if TYPE_CHECKING:``.
``from package import name`` is an import of ``package.name`` when that is a module, else of
``package`` (its ``__init__``); importing a submodule is not counted as importing its parent
packages.

* No import cycle between modules.
* ``runtime/`` (the training loop, CUDA graphs, checkpoints, the callback seam) imports nothing
  of the FP8 plugin: not ``plugin/``, ``probe/``, ``mods/``, ``dispatch/``, ``comm/`` or
  ``kernels/``.
* ``kernels/`` imports nothing of loka_train outside ``kernels/`` but the neutral helpers in
  ``utils/``; ``dispatch/`` only ``kernels/`` and ``utils/``; ``probe/`` only ``kernels/`` and
  ``utils/``.
* Of ``kernels/`` and ``dispatch/``, only ``dispatch/agreement.py`` talks to other ranks, and
  only ``kernels/settings.py`` reads the environment (plus Triton's own ``TRITON_INTERPRET``,
  which must be read where triton is imported); torchrun's variables are the runtime's to read.

Each check is also run on a small made-up import graph that breaks it (the ``*_catches_*``
tests), so a checker that sees nothing cannot pass.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "loka_train"

RUNTIME_MAY_NOT_IMPORT = ("plugin", "probe", "mods", "dispatch", "comm", "kernels")
"""Packages of loka_train that ``runtime/`` must not import."""

KERNELS_MAY_IMPORT = ("kernels", "utils")
"""The only packages of loka_train that ``kernels/`` may import."""

MAY_IMPORT: dict[str, tuple[str, ...]] = {
    "kernels": KERNELS_MAY_IMPORT,
    "dispatch": ("dispatch", "kernels", "utils"),
    "probe": ("probe", "kernels", "utils"),
    "mods": ("mods", "kernels", "probe", "models", "utils"),
    "comm": ("comm", "kernels", "utils"),
    "runtime": ("runtime", "data", "models", "utils"),
    "export": ("export", "job", "plugin", "mods", "dispatch", "kernels", "runtime", "data", "utils"),
}
"""Packages below the plugin and the only packages of loka_train each may import (the table
of docs/architecture.md)."""

PLUGIN_MAY_IMPORT_OF_RUNTIME = ("loka_train.runtime.callbacks", "loka_train.runtime.context",
                                "loka_train.runtime.sparse2d")
"""The runtime modules the plugin may import: the seam and the 2D-sparse helpers."""

ImportGraph = Mapping[str, Iterable[tuple[str, int]]]
"""Module -> (imported loka_train module, line) for every import in its source."""


def _module_name(path: Path, root: Path) -> str:
    parts = [root.name, *path.relative_to(root).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(name: str, modules: set[str]) -> str | None:
    """The loka_train module `name` denotes (itself, or the nearest enclosing module)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def import_graph(root: Path = ROOT / PACKAGE) -> dict[str, list[tuple[str, int]]]:
    """Every import between modules of the package at `root`, from its source."""
    files = {_module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    modules = set(files)
    graph: dict[str, list[tuple[str, int]]] = {}
    for module, path in files.items():
        is_package = path.name == "__init__.py"
        edges: list[tuple[str, int]] = []
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = module if is_package else module.rpartition(".")[0]
                    for _ in range(node.level - 1):
                        base = base.rpartition(".")[0]
                    source = f"{base}.{node.module}" if node.module else base
                else:
                    source = node.module or ""
                targets = [f"{source}.{alias.name}" for alias in node.names]
            for target in targets:
                resolved = _resolve(target, modules)
                if resolved is not None and resolved != module:
                    edges.append((resolved, node.lineno))
        graph[module] = edges
    return graph


def cycles(graph: ImportGraph) -> list[list[str]]:
    """The import cycles of `graph`: one list of modules per strongly connected component that
    has more than one module (or a module that imports itself)."""
    adjacency = {m: sorted({t for t, _ in edges}) for m, edges in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(root: str) -> None:
        # Tarjan's algorithm, iteratively (no recursion limit on long chains).
        work = [(root, iter(adjacency.get(root, ())))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(adjacency.get(child, ()))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in adjacency.get(node, ()):
                    found.append(sorted(component))

    for module in sorted(adjacency):
        if module not in index:
            visit(module)
    return sorted(found)


def _package(module: str) -> str:
    """The top-level package of loka_train that `module` belongs to ('' for loka_train itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def forbidden_imports(graph: ImportGraph, importer: str, allowed: Iterable[str] | None = None,
                      forbidden: Iterable[str] = ()) -> list[str]:
    """Imports from package `importer` that go to a `forbidden` package, or (with `allowed`) to
    any package of loka_train not in `allowed`, as ``"module:line -> module"``."""
    allowed_set = set(allowed) if allowed is not None else None
    forbidden_set = set(forbidden)
    bad = []
    for module, edges in graph.items():
        if _package(module) != importer:
            continue
        for target, line in edges:
            package = _package(target)
            if package in forbidden_set or (allowed_set is not None and package not in allowed_set):
                bad.append(f"{module}:{line} -> {target}")
    return sorted(bad)


# ------------------------------------------------------------------------------ the checks


GRAPH = import_graph()
CYCLES = cycles(GRAPH)


def test_the_graph_sees_the_package() -> None:
    assert f"{PACKAGE}.runtime.trainer" in GRAPH and f"{PACKAGE}.kernels" in GRAPH
    # A function-level import and a TYPE_CHECKING one are both counted.
    assert any(t == f"{PACKAGE}.runtime.trainer" for t, _ in GRAPH[f"{PACKAGE}.job"])
    assert any(t == f"{PACKAGE}.runtime.context" for t, _ in GRAPH[f"{PACKAGE}.runtime.callbacks"])


def test_no_import_cycle() -> None:
    assert CYCLES == [], "import cycles:\n" + "\n".join(" <-> ".join(c) for c in CYCLES)


def test_runtime_imports_nothing_of_the_fp8_plugin() -> None:
    bad = forbidden_imports(GRAPH, "runtime", forbidden=RUNTIME_MAY_NOT_IMPORT)
    assert bad == [], "runtime/ imports the plugin's packages:\n" + "\n".join(bad)


@pytest.mark.parametrize("package", sorted(MAY_IMPORT))
def test_lower_packages_import_nothing_above_them(package: str) -> None:
    bad = forbidden_imports(GRAPH, package, allowed=MAY_IMPORT[package])
    assert bad == [], f"{package}/ imports loka_train packages above it:\n" + "\n".join(bad)


def test_the_plugin_takes_only_the_seam_of_the_runtime() -> None:
    bad = [
        f"{module}:{line} -> {target}"
        for module, imports in GRAPH.items()
        if _package(module) == "plugin"
        for target, line in imports
        if _package(target) == "runtime" and target not in PLUGIN_MAY_IMPORT_OF_RUNTIME
    ]
    assert bad == [], "plugin/ imports runtime internals:\n" + "\n".join(bad)
    assert forbidden_imports(GRAPH, "plugin", forbidden=("job",)) == []


def _sources(*packages: str) -> dict[str, str]:
    return {
        _module_name(p, ROOT / PACKAGE): p.read_text()
        for package in packages
        for p in sorted((ROOT / PACKAGE / package).rglob("*.py"))
    }


def test_only_the_agreement_talks_to_other_ranks() -> None:
    talkers = {
        name for name, text in _sources("kernels", "dispatch").items()
        if "torch.distributed" in text or "dist." in text
    }
    assert talkers == {f"{PACKAGE}.dispatch.agreement"}


def test_the_environment_is_read_only_where_the_settings_are() -> None:
    readers = {
        name: [line for line in text.splitlines() if "os.environ" in line or "getenv" in line]
        for name, text in _sources("kernels", "dispatch", "probe", "mods", "comm", "plugin").items()
        if "os.environ" in text or "getenv" in text
    }
    assert set(readers) == {f"{PACKAGE}.kernels.settings", f"{PACKAGE}.kernels.triton_kernels"}
    assert all("TRITON_INTERPRET" in line for line in readers[f"{PACKAGE}.kernels.triton_kernels"])


# ------------------------------------------------------- the checks catch what they look for


def _write(root: Path, files: Mapping[str, str]) -> Path:
    for name, source in files.items():
        path = root / PACKAGE / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    return root / PACKAGE


def test_the_cycle_check_catches_a_cycle_through_a_function_level_import(tmp_path: Path) -> None:
    pkg = _write(tmp_path, {
        "__init__.py": "",
        "runtime/__init__.py": "",
        "runtime/a.py": "from loka_train.runtime import b\n",
        "runtime/b.py": "def f():\n    from loka_train.runtime.c import g\n",
        "runtime/c.py": "from . import a\n",
        "runtime/d.py": "from loka_train.runtime.a import x\n",
    })
    graph = import_graph(pkg)
    assert cycles(graph) == [["loka_train.runtime.a", "loka_train.runtime.b", "loka_train.runtime.c"]]
    assert cycles({m: [e for e in edges if m != "loka_train.runtime.c"] for m, edges in graph.items()}) == []


def test_the_layer_checks_catch_a_type_checking_import_and_a_relative_one(tmp_path: Path) -> None:
    pkg = _write(tmp_path, {
        "__init__.py": "",
        "utils/__init__.py": "",
        "utils/names.py": "",
        "mods/__init__.py": "",
        "mods/site.py": "",
        "kernels/__init__.py": "",
        "kernels/ops.py": "from ..utils import names\nfrom . import fmt\nfrom ..mods.site import Site\n",
        "kernels/fmt.py": "",
        "runtime/__init__.py": "",
        "runtime/graphs.py": (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from loka_train.mods import site\n"
        ),
    })
    graph = import_graph(pkg)
    assert forbidden_imports(graph, "runtime", forbidden=RUNTIME_MAY_NOT_IMPORT) == [
        "loka_train.runtime.graphs:3 -> loka_train.mods.site"
    ]
    assert forbidden_imports(graph, "kernels", allowed=KERNELS_MAY_IMPORT) == [
        "loka_train.kernels.ops:3 -> loka_train.mods.site"
    ]
