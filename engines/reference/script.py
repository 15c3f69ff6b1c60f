"""Script mode: the engine emits given assistant turns instead of sampling.

Entries are handed out in order across requests (cycling when exhausted). An entry cut short
by an abort is remembered, so the abort-resume re-send (whose input ends with the tokens
emitted so far) continues that entry where it stopped instead of starting the next one; this
keeps multi-turn tests deterministic across pauses and weight updates.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

MAX_PENDING_RESUMES = 1024  # aborted entries remembered; the oldest are forgotten


def load_script(path: str | os.PathLike) -> list[str]:
    """Read a script file: a JSON list of assistant texts."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, list) or not all(isinstance(x, str) for x in data) or not data:
        raise ValueError(f"{path}: a script is a non-empty JSON list of strings")
    return data


class Script:
    """Scripted token sequences plus the bookkeeping for abort-resume. Not thread-safe: one owner."""

    def __init__(self, entries: list[list[int]]):
        if not entries or any(not e for e in entries):
            raise ValueError("a script needs at least one entry and no empty entries")
        self.entries = [list(e) for e in entries]
        self.counter = 0  # entries handed out to fresh requests so far
        # (entry index, tokens emitted before the abort, the input a resume will send)
        self._aborted: list[tuple[int, int, tuple[int, ...]]] = []

    @classmethod
    def from_texts(cls, texts: list[str], tokenizer, *, end_ids: frozenset[int], end_id: int) -> "Script":
        """Tokenize ``texts`` (special tokens recognised); append ``end_id`` where an entry has no end token.

        A real model always closes its turn with a stop token; a script entry that forgets it
        would otherwise end in a state no engine produces.
        """
        entries = []
        for text in texts:
            ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
            if not ids or ids[-1] not in end_ids:
                ids.append(end_id)
            entries.append(ids)
        return cls(entries)

    def assign(self, input_ids: list[int]) -> tuple[int, int]:
        """Pick ``(entry, start)`` for a new request.

        A request that re-sends an aborted request's input plus what it emitted resumes that
        entry (this also covers an abort before the first token). Otherwise a request whose
        input ends with the part of an entry emitted before an abort resumes it (longest part
        wins). Any other request gets the next entry from ``start`` 0.
        """
        key = tuple(input_ids)
        for i, rec in enumerate(self._aborted):
            if rec[2] == key:
                return self._pop(i)
        best = None
        for i, (entry, done, _) in enumerate(self._aborted):
            if done and done <= len(input_ids) and input_ids[len(input_ids) - done :] == self.entries[entry][:done]:
                if best is None or done > self._aborted[best][1]:
                    best = i
        if best is not None:
            return self._pop(best)
        entry = self.counter % len(self.entries)
        self.counter += 1
        return entry, 0

    def record_abort(self, entry: int, emitted: int, resend_ids: list[int]) -> None:
        """Remember that ``entry`` was aborted after its first ``emitted`` tokens.

        ``resend_ids`` is the input an abort-resume loop will send next (input + output).
        """
        if 0 <= emitted < len(self.entries[entry]):
            self._aborted.append((entry, emitted, tuple(resend_ids)))
            del self._aborted[:-MAX_PENDING_RESUMES]

    def _pop(self, i: int) -> tuple[int, int]:
        entry, done, _ = self._aborted.pop(i)
        return entry, done
