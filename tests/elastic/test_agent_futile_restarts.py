"""No futile restarts across nodes: two agents on loopback; a root cause that repeats
identically ends the job after ``--max-same-failure`` rounds on every node, and
``rallypoint.FatalError`` ends it at once, without spending the budget."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from _support import cli_zygote

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]

WORKER = """
import os, sys
import rallypoint
print("round", os.environ["TORCHELASTIC_RESTART_COUNT"], "rank", os.environ["RANK"], flush=True)
if os.environ["RANK"] == "1":
    if sys.argv[1] == "fatal":
        raise rallypoint.FatalError("the dataset is missing")
    config = {}
    config["batch_size"]  # the same KeyError at the same line every round
"""


def _agents(endpoint: str, run_id: str, script: Path, mode: str) -> list[tuple[int, str]]:
    cmd = [
        sys.executable, "-m", "rallypoint", "run",
        "--nnodes", "2", "--nproc-per-node", "1",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id,
        "--rdzv-conf", "is_host=false,read_timeout=20",
        "--max-restarts", "20", "--shutdown-timeout", "5",
        "--max-node-failures", "off",  # else node exclusion (at 2) ends a 2-node job first
        str(script), mode,
    ]  # fmt: skip
    procs = [
        cli_zygote.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    ends = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        ends.append((p.returncode, out + err))
    return ends


def test_a_repeated_failure_ends_the_job_on_every_node(tmp_path: Path, endpoint: str) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    ends = _agents(endpoint, "same", script, "keyerror")
    text = "".join(t for _, t in ends)
    assert [code for code, _ in ends] == [1, 1], text
    assert "round 2" in text and "round 3" not in text, "three rounds, then no restart"
    for _, t in ends:  # every node says why, once
        assert t.count(f"the same failure (KeyError at {script}:9) ended 3 attempts") == 1, t
        assert "KeyError: 'batch_size'" in t[t.index("Root cause") :]
        assert "FAILED (2 restart(s) used of 20)" in t, t  # not "20 of 20"


def test_fatal_error_ends_the_job_at_once_on_every_node(tmp_path: Path, endpoint: str) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    ends = _agents(endpoint, "fatal", script, "fatal")
    text = "".join(t for _, t in ends)
    assert [code for code, _ in ends] == [1, 1], text
    assert "round 1" not in text, "no restart"
    for _, t in ends:
        assert "rallypoint: rank 1 raised FatalError; not restarting" in t, t
        assert "FatalError: the dataset is missing" in t[t.index("Root cause") :]
        assert "FAILED (0 restart(s) used of 20)" in t, t
