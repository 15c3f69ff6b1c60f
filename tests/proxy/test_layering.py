"""Imports flow one way (docs/design.md, "Layers"), the sidecar does not need torch, and the
few lazy imports of the trainer from the proxy package are the intended ones."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOP = ("tokenization", "engines", "proxy", "trainer_bridge")

# (file, package) pairs allowed to import "upwards", only inside a function (never at import time):
# the CLI's `splice train` / `splice publish`, the log-prob benchmark's child process, the
# publish benchmark and the pull benchmark (the trainer's Arrow reader) run the trainer's code.
LAZY_ALLOWED = {("proxy/cli.py", "trainer_bridge"), ("proxy/bench/micro.py", "trainer_bridge"), ("proxy/bench/publish.py", "trainer_bridge"),
                ("proxy/bench/pull.py", "trainer_bridge")}  # fmt: skip


def _modules_in(node: ast.AST) -> set[str]:
    """Modules a node imports: import statements, importlib calls, and Python code kept in strings."""
    found: set[str] = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Import):
            found |= {a.name for a in n.names}
        elif isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
            found.add(n.module)
        elif isinstance(n, ast.Call) and getattr(n.func, "attr", None) == "import_module" and n.args:
            if isinstance(n.args[0], ast.Constant) and isinstance(n.args[0].value, str):
                found.add(n.args[0].value)
        elif isinstance(n, ast.Constant) and isinstance(n.value, str) and "import " in n.value:
            try:
                found |= _modules_in(ast.parse(n.value))
            except SyntaxError:
                pass
    return found


def _imports(path: Path) -> tuple[set[str], set[str]]:
    """(top-level packages imported at module level, those imported only inside functions)."""
    tree = ast.parse(path.read_text())
    lazy: set[str] = set()
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lazy |= _modules_in(fn)
    eager = set()
    for stmt in tree.body:
        if not isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            eager |= _modules_in(stmt)
        elif isinstance(stmt, ast.ClassDef):
            eager |= {m for m in _modules_in(stmt)} - lazy
    return {m.split(".")[0] for m in eager}, {m.split(".")[0] for m in lazy}


def _package_imports(pkg: str) -> dict[str, tuple[set[str], set[str]]]:
    return {str(p.relative_to(ROOT)): _imports(p) for p in (ROOT / pkg).rglob("*.py")}


FORBIDDEN = {
    "tokenization": {"engines", "proxy", "trainer_bridge"},
    "engines": {"proxy", "trainer_bridge"},
    "proxy": {"trainer_bridge"},
    "trainer_bridge": {"proxy", "engines", "tokenization"},
}


def test_proxy_imports_without_torch():
    # the sidecar image has no torch: the proxy, and `splice publish` (trainer_bridge.publish), run without it
    code = (
        "import sys, proxy.app, proxy.cli, proxy.session, proxy.store, engines.pool, trainer_bridge.publish; "
        "sys.exit('torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


def test_imports_flow_one_way():
    bad = []
    for pkg, forbidden in FORBIDDEN.items():
        for path, (eager, lazy) in _package_imports(pkg).items():
            for target in (eager | lazy) & forbidden:
                if (path, target) in LAZY_ALLOWED and target not in eager:
                    continue
                bad.append(f"{path} imports {target}")
    assert not bad, bad


def test_the_allowed_lazy_imports_exist_and_stay_lazy():
    """The allow-list names real imports (so it cannot silently go stale) that are function-local."""
    for path, target in LAZY_ALLOWED:
        eager, lazy = _imports(ROOT / path)
        assert target in lazy and target not in eager, (path, target)


def test_layers_inside_the_proxy():
    """store <- session <- api: the store knows nothing of sessions or HTTP, the session layer
    nothing of HTTP; the dialect modules never import each other's private helpers."""
    inner = {"store": {"proxy.session", "proxy.api"}, "session": {"proxy.api"}}
    bad = []
    for sub, forbidden in inner.items():
        for p in (ROOT / "proxy" / sub).rglob("*.py"):
            tree = ast.parse(p.read_text())
            for n in ast.walk(tree):
                if isinstance(n, ast.ImportFrom):
                    mod = n.module or ""
                    if n.level:  # resolve relative imports against the file's package
                        base = p.relative_to(ROOT).parent.parts[: len(p.relative_to(ROOT).parent.parts) - (n.level - 1)]
                        mod = ".".join(base) + ("." + mod if mod else "")
                    if any(mod == f or mod.startswith(f + ".") for f in forbidden):
                        bad.append(f"{p.relative_to(ROOT)} imports {mod}")
    assert not bad, bad
    chat = (ROOT / "proxy" / "api" / "chat.py").read_text()
    assert "from .responses import" not in chat and "from proxy.api.responses import" not in chat
