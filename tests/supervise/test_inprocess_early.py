"""A rank that fails before ``init_process_group`` keeps every other rank, quickly (script:
``_restart_early.py``), on one node (4 ranks) and on two (2 agents, 2 ranks each).

The others are in ``init_process_group`` when the failure comes: ``ProcessGroupGloo``'s
constructor waits in the store for the failing rank's address, which never comes. A rank
told to leave while in C++ runs its signal handler only when the call returns: one whose
store connection was made just after its attempt was cut stayed in the constructor until
``--restart-grace`` replaced it. ``race`` fails a rank at once, the others anywhere in
``init_process_group``; ``late`` makes the connection after the cut every time.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from _support import cli_zygote

SCRIPT = Path(__file__).with_name("_restart_early.py")
GRACE = 60
"""``--restart-grace``: a survivor still blocked is replaced after it, far past ``QUICK``
(and says so: ``did not leave the function``)."""
QUICK = 30.0
"""Seconds from the failure to every rank done in the next attempt: about 1 s on an idle
machine, 15 s once on a loaded one (10 s was too tight there). Half the grace: a survivor
that left only by a timeout of its own is not counted quick."""


def _cmd(out: Path, nproc: int, failing: int, mode: str, *flags: str) -> list[str]:
    return [
        sys.executable, "-m", "rallypoint", "run", "--nproc-per-node", str(nproc),
        "--max-restarts", "1", "--restart-grace", str(GRACE), *flags,
        str(SCRIPT), str(out), str(failing), mode,
    ]  # fmt: skip


def _one_node(out: Path, failing: int, mode: str) -> str:
    done = cli_zygote.run(_cmd(out, 4, failing, mode), capture_output=True, text=True, timeout=100)
    text = done.stdout + done.stderr
    assert done.returncode == 0, text[-6000:]
    return text


def _two_nodes(out: Path, failing: int, mode: str, endpoint: str) -> str:
    conf = [
        "--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
        "--rdzv-id", "early", "--rdzv-conf", "is_host=false",
    ]  # fmt: skip
    agents = [
        cli_zygote.Popen(
            _cmd(out, 2, failing, mode, *conf),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(2)
    ]
    try:
        texts = [a.communicate(timeout=100)[0] for a in agents]
    finally:
        for a in agents:
            a.kill()
    assert [a.returncode for a in agents] == [0, 0], "\n\n".join(t[-4000:] for t in texts)
    return "\n".join(texts)


def _records(out: Path, name: str) -> dict[int, tuple[int, float]]:
    """``{rank: (pid, time)}`` of the files ``OUT/<name>-<rank>``."""
    found = {}
    for path in out.glob(f"{name}-*"):
        if path.suffix != ".tmp":
            pid, when = path.read_text().split()
            found[int(path.name.rsplit("-", 1)[1])] = (int(pid), float(when))
    return found


def _check(out: Path, text: str, world: int, failing: int) -> None:
    lines = "\n".join(x for x in text.splitlines() if x.startswith("rallypoint"))
    assert "did not leave the function" not in text, lines
    first, second = _records(out, "start-0"), _records(out, "enter-1")
    assert sorted(first) == sorted(second) == list(range(world)), (first, second)
    new = {r for r in second if second[r][0] != first[r][0]}
    assert new == {failing}, f"new processes for ranks {sorted(new)}\n{lines}"
    done = _records(out, "done-1")
    assert sorted(done) == list(range(world)), done
    _, failed = (out / "failed").read_text().split()
    recovery = max(when for _, when in done.values()) - float(failed)
    assert recovery < QUICK, f"{recovery:.1f} s from the failure to the next attempt's end"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["race", "late"])
def test_on_one_node_a_rank_failing_before_init_process_group_keeps_the_others(
    tmp_path: Path, mode: str
) -> None:
    text = _one_node(tmp_path, 1, mode)
    assert "in-process restart 1 of 1: ranks 0, 2, 3 kept" in text, text[-4000:]
    _check(tmp_path, text, 4, 1)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["race", "late"])
def test_on_two_nodes_a_rank_failing_before_init_process_group_keeps_the_others(
    tmp_path: Path, endpoint: str, mode: str
) -> None:
    """Rank 2, the second node's first, fails: the first node's ranks learn it from the
    rendezvous, the second's from their agent at once."""
    text = _two_nodes(tmp_path, 2, mode, endpoint)
    _check(tmp_path, text, 4, 2)
