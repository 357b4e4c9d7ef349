"""The node's snapshot server dies (SIGKILL, the OOM killer): the next attempt gets a new
one, and the screen says so. It was neither replaced nor reported: every later restart's
workers fell back to their own memory and silently started from step 0."""

from __future__ import annotations

from pathlib import Path

import pytest

from rallypoint._cli._run import run_main

pytestmark = pytest.mark.timeout(90)

SCRIPT = """
import os, signal, sys, time
import psutil, torch
from rallypoint import snapshot
from rallypoint._snapshot._api import current_session

attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
state = {"w": torch.zeros(1)}
start = snapshot.restore(state) or 0
print(f"attempt {attempt} starts at {start} on {type(current_session()).__name__}", flush=True)
for step in range(start, 10):
    state["w"] += 1
    snapshot.save(state, step=step)
    if attempt == 0 and step == 5:
        snapshot.wait()
        warm = psutil.Process(os.getppid())
        [server] = [p for p in warm.children() if os.getpgid(p.pid) == p.pid
                    and os.getsid(p.pid) != p.pid]  # workers lead sessions; it leads a group
        server.send_signal(signal.SIGKILL)
        server.wait(10)
        sys.exit(3)
snapshot.wait()
print(f"attempt {attempt} done", flush=True)
"""


def test_a_killed_snapshot_server_is_replaced_and_said(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    assert run_main(["--nproc-per-node", "1", "--max-restarts", "1", str(script)]) == 0
    out, err = capfd.readouterr()
    assert "attempt 0 starts at 0 on NodeSession" in out
    assert "attempt 1 starts at 0 on NodeSession" in out, out + err
    assert "attempt 1 done" in out
    [line] = [ln for ln in err.splitlines() if "snapshot server" in ln]
    assert "the node's snapshot server killed by SIGKILL; started a new one" in line
