"""The test as a worker's agent: a ``@rallypoint.restartable`` script run as a plain
subprocess over a real control channel (``envvars.CONTROL_FD``), this process at the
other end, so that a test can put the worker exactly where it wants it (parked between
attempts, waiting for the next attempt's store) before it says :class:`Stop`."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from rallypoint._core import envvars
from rallypoint._worker_side._control import Hello, Parked, Raised, Verdict, decode, encode

__all__ = ["FAILS_THEN_CONNECTS", "next_message", "park", "start_worker"]

FAILS_THEN_CONNECTS = """
import os
from datetime import timedelta
import torch.distributed as dist
import rallypoint

@rallypoint.restartable
def main():
    if os.environ.get("ATTEMPT") != "1":
        raise RuntimeError("the first attempt fails")
    print("connecting", flush=True)
    dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                  is_master=False, timeout=timedelta(seconds=30))

main()
"""
"""The worker :func:`park` expects: its first attempt raises on its own; the next one
(``ATTEMPT=1``) says ``connecting`` and connects to its store (``MASTER_ADDR``/``_PORT``)."""


def start_worker(
    script: Path, env: dict[str, str], *argv: str
) -> tuple[subprocess.Popen[str], socket.socket]:
    """``python SCRIPT ARGV`` with ``env`` (this process's ``sys.path`` on its
    ``PYTHONPATH``), its output piped; and this process's end of its control channel."""
    agent, worker_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    env = {**env, "PYTHONPATH": os.pathsep.join(sys.path),
           envvars.CONTROL_FD: str(worker_end.fileno())}  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, str(script), *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env=env, pass_fds=[worker_end.fileno()],
    )  # fmt: skip
    worker_end.close()
    return proc, agent


def next_message(agent: socket.socket, timeout: float = 60) -> object:
    agent.settimeout(timeout)
    return decode(agent.recv(1 << 22))


def park(agent: socket.socket) -> None:
    """A worker whose first attempt raises on its own: the agent says the fault was
    elsewhere, and the worker parks, waiting for its next attempt."""
    assert isinstance(next_message(agent), Hello)
    assert isinstance(next_message(agent), Raised)
    agent.send(encode(Verdict(restart=True)))
    assert isinstance(next_message(agent), Parked)
