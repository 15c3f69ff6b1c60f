"""No import circle between the project's own modules: each file can be read (and changed) after
the ones it imports, never together with them. Read from the source with ``ast`` (nothing is
imported), every import counted wherever it stands (a function-local import still ties two
modules together), except those under ``if TYPE_CHECKING:``, which never run."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("proxy", "engines", "tokenization", "trainer_bridge")

# None is allowed: a new circle fails the test. Keep this list empty (move the shared part down).
ALLOWED: list[set[str]] = []


def module_files(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file of ``packages`` under ``root``."""
    mods = {}
    for pkg in packages:
        for p in (root / pkg).rglob("*.py"):
            parts = p.relative_to(root).with_suffix("").parts
            mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return mods


def _targets(name: str, is_package: bool, node: ast.Import | ast.ImportFrom, mods: dict[str, Path]) -> set[str]:
    """The project modules an import statement in module ``name`` loads (the deepest that exists)."""
    if isinstance(node, ast.Import):
        wanted = [a.name for a in node.names]
    else:
        if node.level:
            pkg = name.split(".") if is_package else name.split(".")[:-1]
            pkg = pkg[: len(pkg) - (node.level - 1)]
            base = ".".join(pkg + ([node.module] if node.module else []))
        else:
            base = node.module or ""
        wanted = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
    out = set()
    for t in wanted:
        while t and t not in mods:
            t = t.rpartition(".")[0]
        if t and t != name:
            out.add(t)
    return out


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in mods}

    def visit(name: str, is_package: bool, node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for stmt in child.orelse:  # the ``else:`` branch does run
                    visit(name, is_package, stmt)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                graph[name] |= _targets(name, is_package, child, mods)
            visit(name, is_package, child)

    for name, path in mods.items():
        visit(name, path.name == "__init__.py", ast.parse(path.read_text(), filename=str(path)))
    return graph


def circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = set()
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.add(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(comp)
    return found


def test_no_import_circle_between_project_modules():
    found = circles(import_graph(module_files(ROOT, PACKAGES)))
    new = [sorted(c) for c in found if c not in ALLOWED]
    assert not new, f"import circles (move the shared part into a module both sides import): {new}"


def test_the_detector_sees_a_circle_and_skips_type_checking_imports(tmp_path):
    """The check above can fail: a two-file circle, a three-file one through relative and
    function-local imports, and a type-only import that is no circle."""
    files = {
        "pkg/__init__.py": "",
        "pkg/a.py": "from pkg.b import x\n",
        "pkg/b.py": "import pkg.a\nx = 1\n",
        "pkg/sub/__init__.py": "from .c import y\n",
        "pkg/sub/c.py": "def f():\n    from ..d import z\ny = 1\n",
        "pkg/d.py": "from pkg.sub import y\nz = 2\n",
        "pkg/e.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.f import q\n",
        "pkg/f.py": "from pkg.e import TYPE_CHECKING\nq = 1\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    found = circles(import_graph(module_files(tmp_path, ("pkg",))))
    assert sorted(sorted(c) for c in found) == [["pkg.a", "pkg.b"], ["pkg.d", "pkg.sub", "pkg.sub.c"]]
