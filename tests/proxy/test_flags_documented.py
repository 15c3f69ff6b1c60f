"""Every ``splice serve`` flag is in the README's flag table, and the trust rules the README
states are the ones ``--help`` states (the admin token's default)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from proxy.cli import _serve_parser

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def _serve_flags() -> tuple[set[str], argparse.ArgumentParser]:
    sub = argparse.ArgumentParser().add_subparsers()
    _serve_parser(sub)
    parser = sub.choices["serve"]
    return {o for a in parser._actions for o in a.option_strings if o.startswith("--") and o != "--help"}, parser


def test_every_serve_flag_is_in_the_readme_table():
    table = README[README.index("## Configuration (`splice serve`)") :]
    table = table[: table.index("\n## ", 10)]
    documented = set(re.findall(r"`(--[a-z0-9-]+)", "\n".join(line for line in table.splitlines() if line.startswith("|"))))
    flags, _ = _serve_flags()
    assert flags - documented == set(), sorted(flags - documented)


def test_help_and_readme_agree_on_the_admin_token():
    _, parser = _serve_flags()
    help_text = next(a.help for a in parser._actions if "--admin-token" in a.option_strings)
    assert "$SPLICE_HOME/admin_token" in help_text and "generated" in help_text
    row = next(line for line in README.splitlines() if line.startswith("| `--admin-token`"))
    assert "| generated |" in row and "$SPLICE_HOME/admin_token" in row
    assert "requires `--admin-token`" not in README  # the old rule (a public host needed one) is gone
