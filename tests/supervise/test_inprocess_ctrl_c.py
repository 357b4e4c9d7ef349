"""Ctrl-C stops a job within 5 s, runs the workers' own SIGINT handlers, and says
"interrupted" in one line (script: ``_restart_ctrl_c.py``, 4 ranks, each with a handler).

The SIGINT goes to the launcher's process group, as a terminal sends it (the workers lead
sessions of their own: the launcher forwards it). Before, during an in-process restart the
kept ranks waited in ``init_process_group`` for a replacement still in its set-up, in C++
where no Python handler runs: they were SIGKILLed after ``--shutdown-timeout`` (30 s) and
their handlers never ran; in the steady state every rank printed a traceback. Now the
launcher tells each worker first (``Stop``), a worker still there a second later cuts its
attempt's connections (its wait fails, its handler runs), a worker prints nothing of the
stop, and what is still running 4 s later is killed, or at once on a second Ctrl-C.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("_restart_ctrl_c.py")
LINE = "rallypoint run: interrupted: received SIGINT and stopped the workers"


def _ctrl_c(out: Path, phase: str, handler: str, presses: int) -> tuple[int, float, str]:
    """Run the job, press Ctrl-C ``presses`` times once it is in ``phase``; returns the exit
    status, the seconds from the first press to the launcher's exit, and its output."""
    cmd = [
        sys.executable, "-m", "rallypoint", "run", "--nproc-per-node", "4",
        "--max-restarts", "3", str(SCRIPT), str(out), phase, handler,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        start_new_session=True,  # the launcher leads a process group, as a shell's job
    )  # fmt: skip
    try:
        mark = out / ("slow-setup" if phase == "restart" else "steady")
        deadline = time.monotonic() + 120
        while not mark.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        time.sleep(0.5)  # the kept ranks are in init_process_group's wait now
        pressed = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        for _ in range(presses - 1):
            time.sleep(1.1)  # not the first one's echo (``_signals.ECHO``)
            os.killpg(proc.pid, signal.SIGINT)
        text, _ = proc.communicate(timeout=60)
        return proc.returncode, time.monotonic() - pressed, text
    finally:
        proc.kill()


def _handlers(out: Path) -> set[int]:
    return {int(p.name.split("-")[1]) for p in out.glob("handler-*")}


def _ours(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("rallypoint")]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("phase", ["restart", "steady"])
def test_ctrl_c_stops_the_job_and_runs_every_handler(tmp_path: Path, phase: str) -> None:
    code, took, text = _ctrl_c(tmp_path, phase, "raise", presses=1)
    assert code == 130, text[-4000:]
    assert took < 5.0, f"{took:.1f} s\n{text[-4000:]}"
    assert _handlers(tmp_path) == {0, 1, 2, 3}, text[-4000:]
    ours = _ours(text)
    assert ours[-1] == LINE and sum("SIGINT" in line for line in ours) == 1, text[-4000:]
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-4000:]
    if phase == "restart":
        assert ours[0].startswith("rallypoint: in-process restart 1 of 3: ranks 0, 2, 3 kept")


@pytest.mark.timeout(200)
@pytest.mark.parametrize("phase", ["restart", "steady"])
def test_a_second_ctrl_c_kills_handlers_that_linger(tmp_path: Path, phase: str) -> None:
    """Handlers that never end: the second Ctrl-C kills them at once, and the line says
    which ranks were killed."""
    code, took, text = _ctrl_c(tmp_path, phase, "linger", presses=2)
    assert code == 130, text[-4000:]
    assert took < 4.0, f"{took:.1f} s: the second Ctrl-C came at 1.1 s\n{text[-4000:]}"
    ours = _ours(text)
    killed = "ranks 0, 1, 2, 3 were killed (SIGKILL): still running after 4 s or a second Ctrl-C"
    assert ours[-1] == f"{LINE}; {killed}", text[-4000:]
    assert sum("SIGINT" in line for line in ours) == 1, text[-4000:]
    assert "Traceback" not in text, text[-4000:]


@pytest.mark.timeout(200)
def test_one_ctrl_c_kills_handlers_that_linger_after_4_s(tmp_path: Path) -> None:
    code, took, text = _ctrl_c(tmp_path, "steady", "linger", presses=1)
    assert code == 130, text[-4000:]
    assert 3.5 < took < 8.0, f"{took:.1f} s\n{text[-4000:]}"
    assert _handlers(tmp_path) == {0, 1, 2, 3}, text[-4000:]
    assert _ours(text)[-1].startswith(f"{LINE}; ranks 0, 1, 2, 3 were killed"), text[-4000:]


@pytest.mark.timeout(200)
def test_on_two_nodes_each_says_interrupted_once(tmp_path: Path, endpoint: str) -> None:
    """A Ctrl-C at each node's terminal during an in-process restart: one line per node."""
    cmd = [
        sys.executable, "-m", "rallypoint", "run", "--nnodes", "2", "--nproc-per-node", "2",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "ctrl-c",
        "--rdzv-conf", "is_host=false", "--max-restarts", "3",
        str(SCRIPT), str(tmp_path), "restart", "raise",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    agents = [
        subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            start_new_session=True,
        )
        for _ in range(2)
    ]
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "slow-setup").exists():
            assert time.monotonic() < deadline, [a.poll() for a in agents]
            time.sleep(0.05)
        time.sleep(0.5)
        pressed = time.monotonic()
        for a in agents:
            os.killpg(a.pid, signal.SIGINT)
        texts = [a.communicate(timeout=60)[0] for a in agents]
        took = time.monotonic() - pressed
    finally:
        for a in agents:
            a.kill()
    joined = "\n\n".join(t[-3000:] for t in texts)
    assert [a.returncode for a in agents] == [130, 130], joined
    # a node whose peer stopped first can have ranks in a connect to the peer's store, gone
    # with it: c10d retries the connect through the signal, in C++ where no Python handler
    # runs, so those ranks are killed after 4 s, as the line then says (seen once, with two
    # suites and more beside); a known gap of the stop, docs/launcher.md
    assert took < 8.0, f"{took:.1f} s\n{joined}"
    killed: set[int] = set()
    for text in texts:
        [line] = [x for x in _ours(text) if "SIGINT" in x]
        if line != LINE:
            ranks, _, why = line.removeprefix(f"{LINE}; ranks ").partition(" were killed ")
            assert why == "(SIGKILL): still running after 4 s or a second Ctrl-C", joined
            killed |= {int(r) for r in ranks.split(", ")}
        assert "Traceback" not in text, joined
    assert _handlers(tmp_path) == {0, 1, 2, 3} - killed, joined
