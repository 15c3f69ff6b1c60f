"""Progress output for ``splice demo``: one permanent line per phase or step, plus a live status
line on a terminal (rewritten in place; left out when the output is a file or a pipe)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    def __init__(self, stream: TextIO | None = None, t0: float | None = None):
        self.stream = stream or sys.stdout
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.t0 = time.monotonic() if t0 is None else t0
        self._live = False

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def _clear(self) -> None:
        if self._live:
            self.stream.write("\r\x1b[2K")
            self._live = False

    def line(self, text: str) -> None:
        """A permanent line, stamped with the time since the start."""
        self._clear()
        self.stream.write(f"[{self.elapsed():5.1f}s] {text}\n")
        self.stream.flush()

    def phase(self, name: str, text: str) -> None:
        self.line(f"{name:<8} {text}")

    def live(self, text: str) -> None:
        """A status line rewritten in place (terminals only)."""
        if not self.tty:
            return
        self.stream.write(f"\r\x1b[2K[{self.elapsed():5.1f}s] {text}"[:200])
        self.stream.flush()
        self._live = True

    def done(self) -> None:
        self._clear()
        self.stream.flush()


def bar(done: int, total: int, width: int = 20) -> str:
    total = max(total, 1)
    filled = min(width, round(width * done / total))
    return "#" * filled + "." * (width - filled)
