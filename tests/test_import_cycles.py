"""No import circles inside the package, and no module importing another's private names.

Every ``import`` / ``from ... import`` of a ``dpcc_megatron`` module counts as an edge, wherever it
stands: at module level, inside a function (an import deferred to call time is still a dependency,
and a circle through one fails on the first call made while the other module is half-imported),
and under ``if TYPE_CHECKING:`` (a type-only import is still a design dependency). The package a
module lives in is not an edge of its own: Python imports a module's parent packages first, so
counting them would turn every package ``__init__`` that re-exports its modules into a circle.
"""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "dpcc_megatron"

#: Known circles (none today): each entry is one to break where it lives.
KNOWN: set = set()


#: Known private names imported across modules (none today): (module, name) pairs to make public.
KNOWN_PRIVATE: set = set()


def _modules(package: Path) -> dict[str, tuple[Path, bool]]:
    """Dotted name -> (file, is a package) for every module of the package."""
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return out


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (module level, in functions, under TYPE_CHECKING)."""
    modules = _modules(package)
    graph: dict[str, set[str]] = {}
    for name, (path, is_package) in modules.items():
        here = name if is_package else name.rpartition(".")[0]
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                edges.update(a.name for a in node.names if a.name in modules)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                for alias in node.names:  # ``from pkg import mod`` imports the module, else the package
                    sub = f"{target}.{alias.name}"
                    if sub in modules:
                        edges.add(sub)
                    elif target in modules:
                        edges.add(target)
        edges.discard(name)
        graph[name] = edges
    return graph


def circles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return found


def test_the_graph_sees_every_kind_of_import(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from . import c\n")
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import X\n")
    (pkg / "b.py").write_text("def f():\n    from . import a\n")
    (pkg / "sub" / "c.py").write_text("import pkg.a\nfrom ..b import f\n")
    (pkg / "d.py").write_text("from .sub import c\n")
    graph = import_graph(pkg)
    assert graph["pkg.a"] == {"pkg.b"}  # under TYPE_CHECKING
    assert graph["pkg.b"] == {"pkg.a"}  # inside a function
    assert graph["pkg.sub"] == {"pkg.sub.c"}
    assert graph["pkg.sub.c"] == {"pkg.a", "pkg.b"}  # absolute and two levels up
    assert graph["pkg.d"] == {"pkg.sub.c"}  # the module, not its package
    assert circles(graph) == [frozenset({"pkg.a", "pkg.b"})]


def test_the_package_has_no_import_circle():
    found = set(circles(import_graph()))
    unexpected = sorted(sorted(c) for c in found - KNOWN)
    assert not unexpected, f"import circles: {unexpected}"


def private_imports(package: Path = PACKAGE) -> set[tuple[str, str]]:
    """(module, name) for every ``from <a package module> import _name`` (dunder names and ``import x as _y``
    aliases of public names are fine)."""
    modules = _modules(package)
    found = set()
    for name, (path, _) in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith(package.name)):
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        found.add((name, alias.name))
    return found


def test_no_module_imports_private_names_of_another():
    unexpected = sorted(private_imports() - KNOWN_PRIVATE)
    assert not unexpected, f"make these public (or move them to a shared module): {unexpected}"
    gone = sorted(KNOWN_PRIVATE - private_imports())
    assert not gone, f"no longer imported: remove them from KNOWN_PRIVATE: {gone}"


def test_known_circles_are_still_there():
    gone = sorted(sorted(c) for c in KNOWN - set(circles(import_graph())))
    assert not gone, f"these circles are broken now: remove them from KNOWN: {gone}"
