"""Spares: with ``--nnodes 2:2`` a third agent is a spare; it says so
once (the job and the round it waits out), then takes the place of a SIGKILLed node."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from _support import cli_zygote

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]

WORKER = """
import os, sys, time
import torch, torch.distributed as dist

dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
nodes = os.environ["GROUP_WORLD_SIZE"]
out = os.path.join(sys.argv[1], f"{sys.argv[2]}-pid{os.getpid()}-n{nodes}")
open(out, "w").close()
if not os.path.exists(os.path.join(sys.argv[1], "lost")):
    while not os.path.exists(os.path.join(sys.argv[1], "lost")):  # train until a node is lost
        time.sleep(0.05)
    time.sleep(30)  # the survivor's workers are stopped by the re-rendezvous
dist.destroy_process_group()
"""


def _agent(endpoint: str, script: Path, out: Path, name: str) -> subprocess.Popen[str]:
    cmd = [
        sys.executable, "-m", "rallypoint", "run",
        "--nnodes", "2:2", "--nproc-per-node", "1",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "spares",
        "--rdzv-conf",
        "is_host=false,read_timeout=20,keep_alive_interval=0.5,keep_alive_max_attempt=3",
        "--shutdown-timeout", "2", str(script), str(out), name,
    ]  # fmt: skip
    return cli_zygote.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(directory: Path, pattern: str, count: int, timeout: float = 60) -> list[Path]:
    deadline = time.monotonic() + timeout
    while len(found := list(directory.glob(pattern))) < count:
        assert time.monotonic() < deadline, sorted(p.name for p in directory.iterdir())
        time.sleep(0.05)
    return found


def _read_until(proc: subprocess.Popen[str], text: str, timeout: float = 60) -> list[str]:
    """The lines of ``proc``'s stderr up to the first that contains ``text``."""
    assert proc.stderr is not None
    lines: list[str] = []
    done = threading.Event()

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            if text in line:
                break
        done.set()

    threading.Thread(target=read, daemon=True).start()
    assert done.wait(timeout), lines
    return lines


def test_a_spare_says_so_then_replaces_a_sigkilled_node(tmp_path: Path, endpoint: str) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = tmp_path / "out"
    out.mkdir()
    members = [_agent(endpoint, script, out, name) for name in ("a", "b")]
    agents = list(members)
    try:
        _wait_for(out, "*-n2", 2)  # the round is full at MAX: two nodes train
        spare = _agent(endpoint, script, out, "spare")
        agents.append(spare)
        said = _read_until(spare, "this node is a spare")
        assert spare.poll() is None and not list(out.glob("spare-*"))
        victim = members[1]
        victim.kill()  # SIGKILL: no goodbye
        victim.wait(10)
        (out / "lost").touch()
        ends = []
        for p in (members[0], spare):
            stdout, stderr = p.communicate(timeout=90)
            ends.append((p.returncode, stdout + stderr))
    finally:
        for a in agents:
            a.kill()
    (code_a, text_a), (code_s, text_s) = ends
    assert code_a == 0 and code_s == 0, text_a + text_s
    text_s = "".join(said) + text_s
    line = "rallypoint: this node is a spare: job 'spares' is full in round 0; it waits to take "
    assert text_s.count(line) == 1, text_s
    assert "rallypoint: the spare joins job 'spares' in round 1 as node " in text_s, text_s
    assert "this node is a spare" not in text_a, text_a
    assert len(list(out.glob("spare-*-n2"))) == 1, "the spare's worker trained with a"
    assert len(list(out.glob("a-*-n2"))) == 2, "a trained in round 0 and with the spare"
