"""``@rallypoint.restartable`` at its edges (script: ``_restart_edges.py``, 4 ranks, gloo).

- A decorated function called twice in a process: its first call restarts in process; a
  later call is a plain call, said by rank 0 alone, and a failure in it replaces the processes
  (before, the replacement's first call was paired with the kept ranks' second, and hung).
- Nested decorated functions: the outermost call is the one that restarts.
- A spare worker whose set-up never ends does not hold the rank it would take.
- A spare whose SIGTERM handler lingers does not delay the job's end (spares hold no state).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from _support import cli_zygote

SCRIPT = Path(__file__).with_name("_restart_edges.py")


def _run(out: Path, mode: str, *flags: str) -> tuple[str, float]:
    cmd = [
        sys.executable, "-m", "rallypoint", "run", "--nproc-per-node", "4",
        "--max-restarts", "3", *flags, str(SCRIPT), str(out), mode,
    ]  # fmt: skip
    done = cli_zygote.run(cmd, capture_output=True, text=True, timeout=200)
    ended = time.time()
    text = done.stdout + done.stderr
    assert done.returncode == 0, text[-5000:]
    return text, ended


def _pids(out: Path, name: str, restart: int) -> dict[int, int]:
    found = {}
    for path in out.glob(f"enter-{name}-{restart}-*"):
        if path.suffix != ".tmp":
            found[int(path.name.rsplit("-", 1)[1])] = int(path.read_text())
    return found


@pytest.mark.timeout(300)
def test_a_second_call_is_a_plain_call_and_its_failure_replaces_the_processes(
    tmp_path: Path,
) -> None:
    text, _ = _run(tmp_path, "twice")
    # the first call's failure: in process, rank 1 alone replaced
    assert "in-process restart 1 of 3: ranks 0, 2, 3 kept" in text, text[-4000:]
    first, second = _pids(tmp_path, "train0", 0), _pids(tmp_path, "train0", 1)
    assert {r for r in second if second[r] != first.get(r)} == {1}
    # the second call is said by rank 0 alone, not once per rank (4 lines an attempt):
    # by the kept rank 0 of restart 1 (whose line may be cut with its process, ms later)
    # and by the new rank 0 of restart 2 (its failure started every rank afresh)
    line = "@restartable train() called again in this process: only the first call restarts"
    said = text.count(line)
    assert 1 <= said <= 2 and text.count(f"[rank0]: rallypoint: {line}") == said, text[-4000:]
    again = _pids(tmp_path, "train0", 2)
    assert sorted(again) == [0, 1, 2, 3]
    assert not set(again.values()) & set(second.values()), (second, again)
    assert sorted(_pids(tmp_path, "train1", 2)) == [0, 1, 2, 3]  # and the job finished


@pytest.mark.timeout(300)
def test_nested_functions_restart_at_the_outermost_call(tmp_path: Path) -> None:
    text, _ = _run(tmp_path, "nested")
    assert "in-process restart 1 of 3: ranks 0, 2, 3 kept" in text, text[-4000:]
    assert "called again" not in text
    first, second = _pids(tmp_path, "outer", 0), _pids(tmp_path, "outer", 1)
    assert {r for r in second if second[r] != first[r]} == {1}
    assert sorted(_pids(tmp_path, "inner", 1)) == [0, 1, 2, 3]  # the outer call ran it again


@pytest.mark.timeout(300)
def test_a_spare_whose_set_up_never_ends_does_not_hold_the_rank(tmp_path: Path) -> None:
    text, _ = _run(tmp_path, "spare-hangs", "--spare-workers", "1")
    assert "local rank 1 starts in a new process: the spare worker(s)" in text, text[-4000:]
    assert "still in the script's set-up" in text
    assert "in-process restart 1 of 3: ranks 0, 2, 3 kept" in text


@pytest.mark.timeout(300)
def test_a_spare_with_a_lingering_sigterm_handler_does_not_delay_the_end(tmp_path: Path) -> None:
    _, ended = _run(tmp_path, "spare-lingers", "--spare-workers", "1")
    assert list(tmp_path.glob("spare-*")), "no spare was started"
    done = float((tmp_path / "done").read_text())
    assert ended - done < 10.0, f"the job ended {ended - done:.1f} s after its work"
