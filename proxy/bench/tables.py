"""The plain-text table every ``splice bench`` subcommand prints its results in."""

from __future__ import annotations


def format_table(headers: list[str], rows: list[list]) -> str:
    """Left-aligned first column, right-aligned others, a dashed rule under the header."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for n, r in enumerate(cells):
        lines.append("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)
