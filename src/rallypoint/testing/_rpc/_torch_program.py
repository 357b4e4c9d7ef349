"""Write a program of ``rallypoint.testing`` out as torch's program: only its imports change.

A program module marks its import block with two comment lines; :func:`torch_version`
replaces the lines between them with torch's imports and writes the result into a
directory, so that a test can run torch's program next to ours and compare them.
"""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path
from typing import Any

START = "# ---- imports (the only lines a torch program changes) ----"
END = "# ---- end of imports ----"
_MARKERS = re.compile(rf"({re.escape(START)}\n)(.*?)(\n{re.escape(END)})", re.S)


def torch_version(source_file: str, torch_imports: str, directory: Path, module_name: str) -> Path:
    """``source_file`` with ``torch_imports`` between its markers, as ``module_name.py``."""
    source = Path(source_file).read_text()
    torch_source, count = _MARKERS.subn(lambda m: m[1] + torch_imports + m[3], source)
    if count != 1:
        raise RuntimeError(f"{source_file}: the import markers are missing or repeated")
    path = directory / f"{module_name}.py"
    path.write_text(torch_source)
    return path


def run_written_program(path: str, *args: Any) -> Any:
    """Import the program written at ``path`` (its directory first on ``sys.path``, as a
    script's is) and return its ``run_program(*args)``: what a worker runs for it, since a
    worker forked by the zygote has not imported a module written after the session began."""
    directory = str(Path(path).parent)
    if directory not in sys.path:
        sys.path.insert(0, directory)
    return importlib.import_module(Path(path).stem).run_program(*args)
