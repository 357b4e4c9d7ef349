"""c10d's socket warnings, their C++ stacks folded on the console.

When a TCPStore's server goes away (a lighthouse restarted, a rendezvous store lost), c10d
logs a warning for each client connection that fails, with the C++ stack of the exception
it caught: some 20 lines of ``frame #N: ...``. They were 77% of the workers' lines in a run
whose lighthouse was restarted six times, and hid the one line that said what happened.
The console keeps each warning's line and folds its stack into one; the log files keep
every byte. Only a stack after a c10d warning (``[W...] [c10d] ...``) is folded. (Turning
c10's warnings off, as ``rallypoint._core.cpp_log`` does, would not do: a thread blocked
in a store for the whole run would keep every C++ warning of the process off.)
"""

from __future__ import annotations

import re

__all__ = ["StackFold"]

_WARNING = re.compile(rb"^\[W\d{4} [\d:.]+ [^\]]+\] \[c10d\] ")
_STACK_START = b"Exception raised from "
_FRAME = re.compile(rb"^(frame #\d+: |<omitting python frames>$)")


class StackFold:
    """One stream's console lines, with the C++ stacks of c10d's warnings folded (state
    carries over from one batch of lines to the next)."""

    __slots__ = ("_after_warning", "_folded")

    def __init__(self) -> None:
        self._after_warning = False
        self._folded: int | None = None
        """Lines of the stack being folded (``None``: not in one)."""

    def lines(self, lines: list[bytes]) -> list[bytes]:
        out: list[bytes] = []
        for line in lines:
            if self._folded is not None:
                if _FRAME.match(line):
                    self._folded += 1
                    continue
                out.append(self._note())
                if not line.strip():
                    continue  # the empty line that ends the stack
            if self._after_warning and line.startswith(_STACK_START):
                self._after_warning, self._folded = False, 1
                continue
            self._after_warning = bool(_WARNING.match(line))
            out.append(line)
        return out

    def flush(self) -> list[bytes]:
        """At the stream's end: the note of a stack still being folded."""
        return [self._note()] if self._folded is not None else []

    def _note(self) -> bytes:
        count, self._folded = self._folded or 0, None
        return b"  (the warning's C++ stack, %d lines, is left out of the console)" % count
