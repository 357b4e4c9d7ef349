"""Health checks across nodes: three agents on loopback, a c10d
rendezvous for 2 to 3 nodes; the node whose ``--health-check`` fails stays out (exit code 3
and a screen naming the check) while the two healthy ones train at MIN."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from _support import cli_zygote
from rallypoint.observe import read_events

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]

WORKER = """
import json, os, sys
import torch, torch.distributed as dist

dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
out = os.path.join(sys.argv[1], f"rank{os.environ['RANK']}.json")
with open(out, "w") as fp:
    json.dump({"world": int(os.environ["WORLD_SIZE"]), "sum": t.item()}, fp)
dist.destroy_process_group()
"""


def _agent(
    endpoint: str, script: Path, out: Path, *checks: str, events: Path | None = None
) -> subprocess.Popen[str]:
    cmd = [
        sys.executable, "-m", "rallypoint", "run",
        "--nnodes", "2:3", "--nproc-per-node", "1",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "health",
        "--rdzv-conf", "is_host=false,read_timeout=20,last_call_timeout=3",
        *(["--events", str(events)] if events else []),
        *[a for c in checks for a in ("--health-check", c)],
        "--health-check-timeout", "20", "--shutdown-timeout", "5",
        str(script), str(out),
    ]  # fmt: skip
    return cli_zygote.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_node_failing_its_check_stays_out_while_two_others_train(
    tmp_path: Path, endpoint: str
) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = tmp_path / "out"
    out.mkdir()
    events = tmp_path / "events.jsonl"
    good = ("builtin:store", "builtin:disk")
    bad = "echo 'nvidia-smi: GPU 3 has fallen off the bus' >&2; exit 12"
    agents = [
        _agent(endpoint, script, out, *good, events=events),
        _agent(endpoint, script, out, *good, events=events),
        _agent(endpoint, script, out, "true", bad),
    ]
    ends = []
    for p in agents:
        try:
            stdout, stderr = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            for q in agents:
                q.kill()
            raise
        ends.append((p.returncode, stdout + stderr))
    (code_a, text_a), (code_b, text_b), (code_c, text_c) = ends
    assert (code_a, code_b) == (0, 0), text_a + text_b
    assert code_c == 3, text_c
    assert f"rallypoint: health check failed: {bad}\n  exit code 12\n" in text_c, text_c
    assert "    nvidia-smi: GPU 3 has fallen off the bus" in text_c, text_c
    assert "this node stays out of the job; exit code 3" in text_c, text_c
    results = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    assert results == [{"world": 2, "sum": 2.0}] * 2, results  # two nodes trained, at MIN
    checks = [e for e in read_events(events) if e.kind == "health"]
    store = [e for e in checks if e.get("check") == "builtin:store"]
    assert len(store) == 2 and all(e.get("ok") for e in store), checks
    assert all(e.get("skipped") is None for e in store), "the store check ran on both nodes"


FAILS_ONCE = """
import os, sys
import torch, torch.distributed as dist

dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
name, out = sys.argv[2], sys.argv[1]
open(os.path.join(out, f"{name}-n{os.environ['GROUP_WORLD_SIZE']}"), "a").close()
dist.barrier()
if name == "c" and os.environ["GROUP_WORLD_SIZE"] == "3":
    raise SystemExit(9)  # its GPU broke during the round
dist.destroy_process_group()
"""


def test_a_node_that_breaks_is_checked_again_before_it_rejoins(
    tmp_path: Path, endpoint: str
) -> None:
    script = tmp_path / "worker.py"
    script.write_text(FAILS_ONCE)
    out = tmp_path / "out"
    out.mkdir()
    count = tmp_path / "checks-c"
    # healthy at the first check, broken at the second (after its workers failed)
    flaky = f"echo x >> {count}; test $(wc -l < {count}) -lt 2 || {{ echo 'GPU lost'; exit 4; }}"
    agents = []
    for name, checks in (("a", ["true"]), ("b", ["true"]), ("c", [flaky])):
        cmd = [
            sys.executable, "-m", "rallypoint", "run",
            "--nnodes", "2:3", "--nproc-per-node", "1", "--max-restarts", "2",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "rejoin",
            "--rdzv-conf", "is_host=false,read_timeout=20,last_call_timeout=3",
            *[a for c in checks for a in ("--health-check", c)],
            "--shutdown-timeout", "5", str(script), str(out), name,
        ]  # fmt: skip
        agents.append(
            cli_zygote.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    ends = []
    for p in agents:
        try:
            stdout, stderr = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            for q in agents:
                q.kill()
            raise
        ends.append((p.returncode, stdout + stderr))
    (code_a, text_a), (code_b, text_b), (code_c, text_c) = ends
    assert code_c == 3, text_c
    assert f"rallypoint: health check failed: {flaky}\n  exit code 4\n" in text_c, text_c
    assert "    GPU lost" in text_c, text_c
    assert (code_a, code_b) == (0, 0), text_a + text_b
    assert sorted(p.name for p in out.iterdir()) == ["a-n2", "a-n3", "b-n2", "b-n3", "c-n3"]
