"""No source file of the project's packages over 600 lines: a file that grows past it is split by
job (as ``engines/pool.py`` was into ``pool_routing``, ``pool_generate``, ``pool_weights`` and
``pool_transfer``) so each can be read in one sitting. Tests are not counted."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("proxy", "engines", "tokenization", "trainer_bridge")
MAX_LINES = 600


def long_files(root: Path, packages: tuple[str, ...], limit: int) -> dict[str, int]:
    """``{relative path: line count}`` of every ``.py`` file under ``packages`` longer than ``limit``."""
    out = {}
    for pkg in packages:
        for p in sorted((root / pkg).rglob("*.py")):
            n = len(p.read_text(encoding="utf-8").splitlines())
            if n > limit:
                out[str(p.relative_to(root))] = n
    return out


def test_no_source_file_over_600_lines():
    assert (ROOT / "engines" / "pool.py").is_file()  # the walk sees the tree it is meant to
    too_long = long_files(ROOT, PACKAGES, MAX_LINES)
    assert not too_long, f"source files over {MAX_LINES} lines (split them by job): {too_long}"


def test_the_check_sees_a_long_file(tmp_path):
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "pkg" / "short.py").write_text("x = 1\n" * MAX_LINES)
    (tmp_path / "pkg" / "sub" / "long.py").write_text("x = 1\n" * (MAX_LINES + 1))
    assert long_files(tmp_path, ("pkg",), MAX_LINES) == {str(Path("pkg/sub/long.py")): MAX_LINES + 1}
