"""A Ctrl-C that finds a worker between two attempts of an in-process restart (parked,
waiting for its next attempt, or waiting for that attempt's store) runs the worker's own
SIGINT handler, as it does anywhere else.

The agent says :class:`Stop`, then forwards the SIGINT. A worker that left as soon as it
read the Stop ended before the signal came, or ran its handler only while it exited: on
two nodes under load, a kept rank's handler did not run at all (``test_inprocess_ctrl_c``,
seen once beside a CPU hog). Staged with this test as the agent, over the worker's real
control channel, the SIGINT 50 ms after the Stop.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from _support.staged_agent import FAILS_THEN_CONNECTS, park, start_worker
from rallypoint._core.net import free_port
from rallypoint._worker_side._control import Assign, Stop, encode

WORKER = (
    """
import os, signal, sys

OUT, HANDLER = sys.argv[1], sys.argv[2]

def on_sigint(signum, frame):
    open(os.path.join(OUT, "handler-ran"), "w").close()
    if HANDLER == "raise":
        raise KeyboardInterrupt("the worker's own handler")

signal.signal(signal.SIGINT, on_sigint)
"""
    + FAILS_THEN_CONNECTS
)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["parked", "awaiting the store"])
@pytest.mark.parametrize("handler", ["raise", "return"])
def test_a_ctrl_c_between_attempts_runs_the_workers_own_handler(
    tmp_path: Path, where: str, handler: str
) -> None:
    closed = free_port()  # nothing listens there: the next attempt waits for its store
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {**os.environ, "MASTER_PORT": str(closed)}
    proc, agent = start_worker(script, env, str(tmp_path), handler)
    try:
        park(agent)  # the first attempt failed on its own; a fault elsewhere, said the agent
        if where == "awaiting the store":
            agent.send(encode(Assign({"ATTEMPT": "1", "MASTER_ADDR": "127.0.0.1"})))
            time.sleep(0.5)  # trying the store by now
        pressed = time.monotonic()
        agent.send(encode(Stop()))  # a Ctrl-C: the agent says so, then signals
        time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=10)
        took = time.monotonic() - pressed
    finally:
        proc.kill()
        out, err = proc.communicate()
        agent.close()
    assert (tmp_path / "handler-ran").exists(), (out, err)
    assert proc.returncode != 0, (out, err)
    assert "connecting" not in out, out  # the function did not start again
    # (the KeyboardInterrupt's traceback is printed here: run by the launcher, a worker
    # told to stop prints none, test_inprocess_ctrl_c.py)
    # a handler that raises ends it at once; one that returns, after SIGINT_WAIT (1 s)
    assert took < (1.0 if handler == "raise" else 2.0), (took, err)
