"""The import structure of ``loka_train.kernels`` and ``loka_train.dispatch``, read with ast.

Every import counts, also one inside a function (a lazy import still ties the modules):
the modules of each package form a DAG; ``kernels`` imports nothing else of loka_train;
``dispatch`` imports only ``kernels``; only ``dispatch/agreement.py`` talks to other ranks
(``torch.distributed``); no module of either reads the environment but ``kernels/settings.py``
(and ``triton_kernels.py``'s ``TRITON_INTERPRET``, which mirrors how triton itself was loaded).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("kernels", "dispatch")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules(package: str) -> dict[str, Path]:
    return {_module_name(p): p for p in sorted((ROOT / "loka_train" / package).glob("*.py"))}


def _imports(path: Path, known: set[str]) -> set[str]:
    """Every module ``path`` imports (anywhere in it); ``from pkg import mod`` counts as ``mod``."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                out.add(sub if sub in known else node.module)
    return out


def _graph(package: str) -> dict[str, set[str]]:
    mods = _modules(package)
    known = set(mods)
    return {name: _imports(path, known) for name, path in mods.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle among ``graph``'s own modules, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph[node] & graph.keys()):
            if state.get(dep) == 1:
                return stack[stack.index(dep):] + [dep]
            if dep not in state and (found := visit(dep)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


@pytest.mark.parametrize("package", PACKAGES)
def test_the_modules_of_the_package_form_a_dag(package: str) -> None:
    graph = _graph(package)
    assert len(graph) > 3
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_the_dag_check_sees_a_lazy_import_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert _cycle(graph) == ["a", "b", "c", "a"]


@pytest.mark.parametrize(("package", "allowed"), [("kernels", ("kernels",)), ("dispatch", ("kernels", "dispatch"))])
def test_imports_go_down_only(package: str, allowed: tuple[str, ...]) -> None:
    for name, deps in _graph(package).items():
        ours = {d for d in deps if d == "loka_train" or d.startswith("loka_train.")}
        above = {d for d in ours if d.split(".")[1:2] and d.split(".")[1] not in allowed}
        assert not above, f"{name} imports {sorted(above)}"


def test_only_the_agreement_talks_to_other_ranks() -> None:
    for package in PACKAGES:
        for name, path in _modules(package).items():
            text = path.read_text()
            collective = "torch.distributed" in _imports(path, set()) or "dist." in text
            assert collective == (name == "loka_train.dispatch.agreement"), name


def test_the_environment_is_read_only_where_the_settings_are() -> None:
    readers = {
        name
        for package in PACKAGES
        for name, path in _modules(package).items()
        if "os.environ" in path.read_text() or "getenv" in path.read_text()
    }
    assert readers == {"loka_train.kernels.settings", "loka_train.kernels.triton_kernels"}
    triton_reads = [
        line for line in (ROOT / "loka_train/kernels/triton_kernels.py").read_text().splitlines()
        if "os.environ" in line
    ]
    assert len(triton_reads) == 1 and "TRITON_INTERPRET" in triton_reads[0]
