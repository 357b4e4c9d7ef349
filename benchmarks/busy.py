"""CPU-bound processes beside a benchmark (``--hogs``): a machine where something else
computes too, as data loader workers or another job do. Imports neither torch nor
rallypoint, so a benchmark's parent process can use it before it forks its groups."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def busy_processes(count: int) -> Iterator[None]:
    """``count`` processes that only burn CPU while the block runs."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait(10)
