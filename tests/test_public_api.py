"""The public surface: what `import rallypoint` offers, and that it stays cheap."""

from __future__ import annotations

import subprocess
import sys

import rallypoint


def test_all_names_resolve() -> None:
    for name in rallypoint.__all__:
        assert getattr(rallypoint, name) is not None, name


def test_import_does_not_load_torch() -> None:
    code = "import sys, rallypoint; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
