"""A Ctrl-C while an in-process restart's next attempt cannot reach its store.

On two nodes, the node that hosts the store may stop (its agent takes the store with it)
while the other node's ranks begin their next attempt: c10d retries a refused connect in
C++, where no SIGINT handler runs, so those ranks were killed after the 4 s grace. The
worker now tries the store itself before the function starts, where the stop is heard.
Staged with this test as the agent, over the worker's real control channel; torch's own
TCPStore connect to the same closed port is the control (it must stay deaf).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _support.staged_agent import FAILS_THEN_CONNECTS, park, start_worker
from rallypoint._core.net import free_port
from rallypoint._worker_side._control import Assign, Stop, encode

TORCH_ALONE = """
import os
from datetime import timedelta
import torch.distributed as dist
print("connecting", flush=True)
dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), is_master=False,
              timeout=timedelta(seconds=30))
"""


def _stopped_after(proc: subprocess.Popen[str], limit: float) -> float | None:
    """SIGINT now; the seconds until ``proc`` ended, or ``None`` past ``limit``."""
    pressed = time.monotonic()
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        return None
    return time.monotonic() - pressed


def _wait_for_line(proc: subprocess.Popen[str], text: str) -> None:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert text in line, line


@pytest.mark.timeout(120)
def test_a_ctrl_c_is_heard_while_the_next_attempt_waits_for_a_store_that_is_gone(
    tmp_path: Path,
) -> None:
    closed = free_port()  # nothing listens there: every connect is refused
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "MASTER_PORT": str(closed)}
    script = tmp_path / "torch_alone.py"
    script.write_text(TORCH_ALONE)
    alone = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        _wait_for_line(alone, "connecting")
        time.sleep(0.5)  # inside c10d's connect retries
        deaf = _stopped_after(alone, limit=3.0)
    finally:
        alone.kill()
        alone.wait()
    assert deaf is None, f"torch's connect heard the SIGINT ({deaf:.2f} s): the stage is wrong"

    script = tmp_path / "worker.py"
    script.write_text(FAILS_THEN_CONNECTS)
    proc, agent = start_worker(script, env)
    try:
        park(agent)  # the first attempt failed on its own; a fault elsewhere, said the agent
        agent.send(encode(Assign({"ATTEMPT": "1", "MASTER_ADDR": "127.0.0.1"})))
        time.sleep(1.0)  # the next attempt would be in c10d's connect by now
        agent.send(encode(Stop()))  # a Ctrl-C: the agent says so, then signals
        took = _stopped_after(proc, limit=3.0)
    finally:
        proc.kill()
        out, err = proc.communicate()
        agent.close()
    assert took is not None and took < 1.5, (took, out, err)
    assert "connecting" not in out, out  # the function did not start its connect
    assert proc.returncode != 0, (out, err)
