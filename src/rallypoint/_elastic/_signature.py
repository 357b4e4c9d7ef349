"""When two failures are "the same": the rule that stops futile restarts.

A restart helps a transient failure (a lost node, a flaky link); it cannot help a bug or a
bad config that fails the same way every attempt. Two root causes are the same when they
raised the same exception type at the same innermost frame of the user's code (torch's and
Python's own frames below it do not count), or, without a Python exception (a crash, an
``exit(3)``), when the same rank ended the same way. :func:`failure_signature` gives the
text that is compared; the run store counts it across rounds (``RunStore.same_failure``).
"""

from __future__ import annotations

import re

from rallypoint._core.frames import is_library

__all__ = ["failure_signature", "repeated_line"]

_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+)')
_EXCEPTION = re.compile(r"^([A-Za-z_][\w.]*)(?::|$)")
_TRACEBACK_START = "Traceback (most recent call last):"


def failure_signature(rank: int, detail: str, traceback_text: str) -> str:
    """What identifies a root cause across attempts (see the module docstring):
    ``"KeyError at train.py:12"``, or ``"rank 1 exited with 3"``."""
    block = traceback_text[traceback_text.rfind(_TRACEBACK_START) :]
    if traceback_text.rfind(_TRACEBACK_START) < 0:
        block = ""
    lines = block.splitlines()
    frame = ""
    for line in lines:
        m = _FRAME.match(line)
        if m and not is_library(m.group(1)):
            frame = f"{m.group(1)}:{m.group(2)}"
    exception = ""
    for line in reversed(lines):
        m = _EXCEPTION.match(line)
        if m and not line.startswith((" ", "\t")):
            exception = m.group(1)
            break
    if exception and frame:
        return f"{exception} at {frame}"
    return f"rank {rank} {detail}"


def repeated_line(signature: str, count: int, limit: int) -> str:
    """The line that ends a job whose failure repeats."""
    return (
        f"the same failure ({signature}) ended {count} attempts in a row; not restarting "
        f"(--max-same-failure {limit})"
    )
