"""Which source files are the user's: the frames a stack, a traceback or a repeated
failure is told by, as opposed to Python's, installed packages' and rallypoint's own."""

from __future__ import annotations

import functools
import os
import sys
import sysconfig

__all__ = ["is_library"]


@functools.cache
def _library_prefixes() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    roots = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    roots.add(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # rallypoint
    roots.update(
        p for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix) if p
    )
    return tuple(sorted(os.path.join(os.path.abspath(r), "") for r in roots))


def is_library(filename: str) -> bool:
    """Whether ``filename`` (a frame's) is not the user's: ``<frozen runpy>``, ``<string>``,
    or a file under Python's, the installed packages' or rallypoint's directories."""
    return filename.startswith("<") or os.path.abspath(filename).startswith(_library_prefixes())
