"""A fault while the kept ranks import what a first step imports (script:
``_restart_imports.py``, 3 ranks, gloo, no ``--preload``).

A worker's first ``torch.optim.Adam`` imports ``torch._dynamo`` and sympy. An interruption
raised in the middle of that import left half-imported modules in the kept processes
(``module 'sympy' has no attribute 'core'``), and every later attempt failed: the
interruption now waits until the import is done. Rank 1 faults (SIGKILLed, or raising) at
ten moments of the others' first step, from their model's construction through their
first Adam to their first steps; each job ends well, with ranks 0 and 2 kept.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

from _support import cli_zygote
from rallypoint._worker_side._restartable import importing

SCRIPT = Path(__file__).with_name("_restart_imports.py")
MOMENTS = [
    ("kill", 0.0),
    ("raise", 0.05),
    ("kill", 0.15),
    ("raise", 0.25),
    ("kill", 0.35),
    ("raise", 0.5),
    ("kill", 0.7),
    ("raise", 0.9),
    ("kill", 1.3),
    ("raise", 2.5),
]
"""(how rank 1 faults, seconds after the barrier that follows ``init_process_group``). The
first Adam's imports take about a second on an idle machine, and longer under load."""
GRACE = 90
"""``--restart-grace``: a kept rank leaves its function once its import is done, which took
more than the default 10 s with three ranks importing beside the rest of the suite on 2
cores (a CI run: both kept ranks were replaced, still in ``torch._dynamo``'s import). What
is tested is that the import is not cut, not how fast it is: the grace is a ceiling."""


def _pids(out: Path, restart: int) -> dict[int, int]:
    found = {}
    for path in out.glob(f"enter-{restart}-*"):
        if path.suffix != ".tmp":
            found[int(path.name.rsplit("-", 1)[1])] = int(path.read_text())
    return found


@pytest.mark.timeout(200)
@pytest.mark.parametrize(("kind", "delay"), MOMENTS)
def test_a_fault_during_the_first_steps_imports_keeps_every_survivor(
    tmp_path: Path, kind: str, delay: float
) -> None:
    cmd = [
        sys.executable, "-m", "rallypoint", "run", "--nproc-per-node", "3",
        "--max-restarts", "2", "--restart-grace", str(GRACE),
        str(SCRIPT), str(tmp_path), kind, str(delay), "5",
    ]  # fmt: skip
    # later=False: the workers import what a first step imports themselves, as a user's do
    done = cli_zygote.run(cmd, capture_output=True, text=True, timeout=180, later=False)
    text = done.stdout + done.stderr
    assert done.returncode == 0, text[-6000:]
    assert "partially initialized" not in text and "has no attribute" not in text, text[-6000:]
    replaced = "killed by SIGKILL" if kind == "kill" else "exited with 1"
    line = "in-process restart 1 of 2: ranks 0, 2 kept"
    assert line in text and f"rank 1 replaced ({replaced})" in text, text[-6000:]
    first, second = _pids(tmp_path, 0), _pids(tmp_path, 1)
    assert sorted(second) == [0, 1, 2], second
    assert {r for r in second if second[r] != first[r]} == {1}, (first, second)
    assert (tmp_path / "done").exists()
    for rank in (0, 2):  # each kept rank left its first attempt interrupted, not failed
        assert (tmp_path / f"left-0-{rank}").exists(), text[-4000:]


def test_an_import_inside_the_function_is_told_from_one_outside_it(tmp_path: Path) -> None:
    """``importing`` finds the import machinery on the main thread's stack; a frame of plain
    code is not in an import."""
    (tmp_path / "_probe_import.py").write_text("import sys\nFRAME = sys._getframe()\n")
    sys.path.insert(0, str(tmp_path))
    try:
        frame = importlib.import_module("_probe_import").FRAME
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("_probe_import", None)
    assert importing(frame)
    assert not importing(sys._getframe())
    assert not importing(None)
