"""Exclusion of a node that keeps failing (issue 42, part 2): three agents on loopback, each
with its own ``--local-addr`` (its name in the exclusion list); node C's workers crash at
start every attempt (a broken GPU, say). Before, the job spent its whole budget on
restarts and every agent exited 1, though A and B were a healthy world at MIN."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from rallypoint.observe._events import read_events
from rallypoint.observe._timeline import build_timeline

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]

WORKER = """
import os, sys, time
import torch, torch.distributed as dist
out, mode = sys.argv[1], sys.argv[2]
if mode == "bad":
    raise RuntimeError("CUDA error: uncorrectable ECC error encountered")
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
open(os.path.join(out, f"trained-{os.environ['RANK']}-{t.item():.0f}"), "w").close()
while not os.path.exists(os.path.join(out, "finish")):
    time.sleep(0.05)
dist.destroy_process_group()
"""

NODES = {"A": "127.0.0.2", "B": "127.0.0.3", "C": "127.0.0.4"}


def _agent(endpoint: str, nnodes: str, node: str, out: Path, mode: str) -> subprocess.Popen[str]:
    cmd = [
        sys.executable, "-m", "rallypoint", "run",
        "--nnodes", nnodes, "--nproc-per-node", "1", "--local-addr", NODES[node],
        "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "excl",
        "--rdzv-conf", "is_host=false,read_timeout=20,last_call_timeout=1",
        "--max-restarts", "3", "--shutdown-timeout", "3",
        "--events", str(out / f"events-{node}.jsonl"),
        str(out / "worker.py"), str(out), mode,
    ]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _end(p: subprocess.Popen[str], timeout: float = 100) -> tuple[int, str]:
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        raise AssertionError(f"agent did not end:\n{out}{err}") from None
    return p.returncode, out + err


def test_a_node_failing_twice_is_excluded_and_the_others_finish(
    tmp_path: Path, endpoint: str
) -> None:
    (tmp_path / "worker.py").write_text(WORKER)
    agents = {n: _agent(endpoint, "2:3", n, tmp_path, "bad" if n == "C" else "good") for n in NODES}
    try:
        code, text = _end(agents["C"])
        assert code == 4, text
        line = "excluded node 127.0.0.4"
        assert f"rallypoint run: {line}" in text and "failures in a row" in text, text
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("trained-*-2"))) < 2:  # A and B: a world of two
            assert time.monotonic() < deadline, "A and B did not train without C"
            time.sleep(0.1)
        again = _agent(endpoint, "2:3", "C", tmp_path, "good")  # a new agent on the bad node
        code, text = _end(again, 60)
        assert code == 4, text
        [refused] = [ln for ln in text.splitlines() if "excluded from job" in ln]
        assert "this node (127.0.0.4) is excluded from job 'excl'" in refused
        assert "not joining" in refused
        (tmp_path / "finish").write_text("")
        for n in ("A", "B"):
            code, text = _end(agents[n])
            assert code == 0, text
            assert "excluded node 127.0.0.4" in text, text
            assert "(restarts used: 1 of 3)" in text, "the exclusion spends no restart"
        timeline = build_timeline(read_events(sorted(tmp_path.glob("events-*.jsonl"))))
        [mark] = [m for m in timeline.marks if m.kind == "exclusion"]
        assert mark.label.startswith("excluded node 127.0.0.4 (")
    finally:
        (tmp_path / "finish").write_text("")
        for p in agents.values():
            p.kill()


def test_excluding_below_min_nodes_ends_the_job_saying_so(tmp_path: Path, endpoint: str) -> None:
    (tmp_path / "worker.py").write_text(WORKER)
    (tmp_path / "finish").write_text("")
    agents = {n: _agent(endpoint, "3:3", n, tmp_path, "bad" if n == "C" else "good") for n in NODES}
    try:
        for n, p in agents.items():
            code, text = _end(p)
            assert code == 1, (n, text)
            assert "node 127.0.0.4 was the root cause of 2 failures in a row" in text, text
            assert "fewer than the minimum of 3 (--nnodes): ending the job" in text
    finally:
        for p in agents.values():
            p.kill()
