"""``@rallypoint.restartable`` with the fault at every rank's position: every survivor is kept.

gloo collectives are rings and trees, so a dead rank's neighbours fail at once while a
survivor that waits on another survivor stays blocked until that one lets go; the kept
ranks must all leave the function, wherever the fault sits. One job per case: attempt
``k`` faults at rank ``k`` (``_restart_positions.py``), so one run covers every position.
Each case checks, for every restart, that the faulty rank alone got a new process, that
every rank resumed at the last snapshot, that nobody needed ``--restart-grace``, and that
the job ended well. 4 and 8 ranks, one node and two, gradients averaged by hand and by
DDP, ranks killed, spinning, and failing before ``init_process_group``.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from _support import cli_zygote

SCRIPT = Path(__file__).with_name("_restart_positions.py")
GAP = 3  # steps each attempt runs before its fault (the script's GAP)
STEPS = 40
SPIN_FLAGS = ["--hang-timeout", "3", "--preload", "torch._dynamo"]
"""A spinning rank is found by the hang timeout, which counts the set-up too (a hang before
the first progress is a hang): each worker's own import of ``torch._dynamo`` in its first
optimizer took over 5 s with 8 ranks on 2 loaded cores; the warm process imports it first,
and the set-up is then a fork."""


def _cmd(out: Path, nproc: int, kind: str, grad: str, *flags: str) -> list[str]:
    restarts = str(nproc * (2 if "--nnodes" in flags else 1))
    return [
        sys.executable, "-m", "rallypoint", "run", "--nproc-per-node", str(nproc),
        "--max-restarts", restarts, "--max-same-failure", "100", *flags,
        str(SCRIPT), str(out), kind, grad, str(STEPS),
    ]  # fmt: skip


def _one_node(out: Path, world: int, kind: str, grad: str, *flags: str) -> str:
    done = cli_zygote.run(
        _cmd(out, world, kind, grad, *flags),
        capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    text = done.stdout + done.stderr
    assert done.returncode == 0, text[-6000:]
    return text


def _two_nodes(out: Path, world: int, kind: str, grad: str, endpoint: str, *flags: str) -> str:
    conf = [
        "--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
        "--rdzv-id", "positions", "--rdzv-conf", "is_host=false",
        "--max-node-failures", "100", *flags,
    ]  # fmt: skip
    agents = [
        cli_zygote.Popen(
            _cmd(out, world // 2, kind, grad, *conf),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(2)
    ]
    texts = _finish(agents, 240)
    assert [a.returncode for a in agents] == [0, 0], "\n\n".join(t[-4000:] for t in texts)
    return "\n".join(texts)


def _finish(agents: list[subprocess.Popen[str]], timeout: float) -> list[str]:
    """Both agents' output; a job still running after ``timeout`` is stopped with SIGTERM
    (then SIGKILL) and fails the test with what each agent said until then."""
    deadline = time.monotonic() + timeout
    try:
        return [a.communicate(timeout=max(1.0, deadline - time.monotonic()))[0] for a in agents]
    except subprocess.TimeoutExpired:
        for a in agents:
            a.terminate()
        said = []
        for a in agents:
            try:
                said.append(a.communicate(timeout=20)[0])
            except subprocess.TimeoutExpired:
                a.kill()
                said.append(a.communicate()[0])
        tails = "\n\n".join(f"agent {i}:\n{t[-5000:]}" for i, t in enumerate(said))
        pytest.fail(f"the job did not end within {timeout:g} s:\n{tails}")
    finally:
        for a in agents:
            a.kill()


def _entries(out: Path, attempt: int) -> dict[int, tuple[int, int]]:
    """``{rank: (pid, start step)}`` of the entries into the function at ``attempt``."""
    found = {}
    for path in out.glob(f"enter-{attempt}-*"):
        if path.suffix != ".tmp":
            pid, start = path.read_text().split()
            found[int(path.name.rsplit("-", 1)[1])] = (int(pid), int(start))
    return found


def _check(out: Path, world: int, text: str) -> None:
    assert "did not leave the function" not in text, text[-6000:]
    assert (out / "final.pt").exists()
    previous = _entries(out, 0)
    assert sorted(previous) == list(range(world))
    assert {start for _, start in previous.values()} == {0}
    for attempt in range(1, world + 1):
        now = _entries(out, attempt)
        faulty = attempt - 1
        assert sorted(now) == list(range(world)), (attempt, now)
        new = {r for r in now if now[r][0] != previous[r][0]}
        lines = "\n".join(x for x in text.splitlines() if x.startswith("rallypoint"))
        assert new == {faulty}, f"attempt {attempt}: new processes for {sorted(new)}\n{lines}"
        starts = {start for _, start in now.values()}
        assert len(starts) == 1, (attempt, now)  # every rank resumed at the same step
        before = previous[0][1]
        (start,) = starts
        assert before + GAP - 1 <= start <= before + GAP, (attempt, before, start)
        previous = now


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("world", "kind", "grad"),
    [(4, "kill", "hand"), (4, "spin", "ddp"), (8, "mixed", "ddp")],
)
def test_one_node_keeps_every_survivor_at_every_position(
    tmp_path: Path, world: int, kind: str, grad: str
) -> None:
    flags = SPIN_FLAGS if kind in ("spin", "mixed") else []
    text = _one_node(tmp_path, world, kind, grad, *flags)
    _check(tmp_path, world, text)
    for attempt in range(1, world + 1):
        assert f"in-process restart {attempt} of {world}:" in text, text[-4000:]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("world", "kind", "grad"), [(4, "mixed", "hand"), (8, "kill", "hand")])
def test_two_nodes_keep_every_survivor_at_every_position(
    tmp_path: Path, endpoint: str, world: int, kind: str, grad: str
) -> None:
    flags = SPIN_FLAGS if kind in ("spin", "mixed") else []
    text = _two_nodes(tmp_path, world, kind, grad, endpoint, *flags)
    _check(tmp_path, world, text)


@pytest.mark.timeout(300)
def test_a_rank_failing_before_init_process_group_keeps_the_others(tmp_path: Path) -> None:
    """The others wait in ``init_process_group``'s rendezvous when it fails, and a kept
    replacement may still be in its set-up: the next attempt must not deadlock."""
    text = _one_node(tmp_path, 4, "early", "hand")
    assert "did not leave the function" not in text, text[-6000:]
    for attempt in range(1, 5):  # nobody passes init_process_group before the last one
        others = ", ".join(str(r) for r in range(4) if r != attempt - 1)
        line = f"in-process restart {attempt} of 4: ranks {others} kept"
        assert line in text, text[-6000:]
        assert f"rank {attempt - 1} replaced (exited with 1)" in text, text[-6000:]
    assert sorted(_entries(tmp_path, 4)) == [0, 1, 2, 3]
    assert "found a bad configuration" in text


@pytest.mark.timeout(300)
def test_on_two_nodes_a_rank_failing_before_init_process_group_keeps_the_others(
    tmp_path: Path, endpoint: str
) -> None:
    """Each of 8 ranks on two nodes in turn raises before ``init_process_group`` while the
    others wait in it (in its store rendezvous or in ``ProcessGroupGloo``'s constructor,
    which connects the ranks): only the failing rank is replaced, each time."""
    text = _two_nodes(tmp_path, 8, "early", "hand", endpoint)
    assert "did not leave the function" not in text, text[-6000:]
    lines = [x for x in text.splitlines() if x.startswith("rallypoint") and "in-process" in x]
    replaced = [x for x in lines if "replaced" in x]
    for attempt in range(1, 9):
        line = f"rank {attempt - 1} replaced (exited with 1)"
        assert sum(line in x for x in replaced) == 1, "\n".join(lines)
    assert sum(x.count("replaced") for x in replaced) == 8, "\n".join(lines)
    assert sorted(_entries(tmp_path, 8)) == list(range(8))
