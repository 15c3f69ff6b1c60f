"""The sidecar does not need torch, and imports flow one way (SPEC section 1)."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_proxy_imports_without_torch():
    code = "import sys, proxy.app, proxy.cli, proxy.session, proxy.store, engines.pool; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


def _imports(pkg: str) -> set[str]:
    found: set[str] = set()
    for path in (ROOT / pkg).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module.split(".")[0])
    return found


def test_imports_flow_one_way():
    assert not _imports("tokenization") & {"engines", "proxy", "trainer_bridge"}
    assert not _imports("engines") & {"proxy", "trainer_bridge"}
    assert not _imports("trainer_bridge") & {"proxy", "engines", "tokenization"}
    assert not _imports("proxy") & {"trainer_bridge"}
