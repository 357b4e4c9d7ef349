"""Hang detection, stacks and the events file through ``rallypoint run`` (single node)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from _support import cli_zygote

HANGS_ONCE = """
import os, time
import torch, torch.distributed as dist
import rallypoint.launcher as rl

dist.init_process_group("gloo")
rank = dist.get_rank()
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
t = torch.ones(1)
for step in range(3):
    rl.progress()
    if attempt == 0 and rank == 1 and step == 1:
        time.sleep(3600)          # the straggler
    dist.all_reduce(t)
print(f"done rank={rank} attempt={attempt} value={t.item()}", flush=True)
dist.destroy_process_group()
"""


def _run(args: list[str], timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return cli_zygote.run(
        [sys.executable, "-m", "rallypoint", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        later=False,  # a worker's first step imports torch._dynamo itself (--setup-timeout)
    )


@pytest.mark.timeout(120)
def test_hang_prints_grouped_stacks_restarts_and_writes_events(tmp_path: Path) -> None:
    script = tmp_path / "hang.py"
    script.write_text(HANGS_ONCE)
    events = tmp_path / "events.jsonl"
    proc = _run(
        [
            "run",
            "--nproc-per-node",
            "3",
            "--max-restarts",
            "1",
            "--hang-timeout",
            "2",
            "--events",
            str(events),
            str(script),
        ]
    )
    assert proc.returncode == 0, proc.stderr
    err = proc.stderr
    assert "no worker reported progress for" in err
    # grouped: the two ranks waiting in all_reduce share one stack, the sleeper has its own
    assert "ranks 0,2: all_reduce" in err, err
    assert "rank 1: sleep" in err, err
    assert "restarting the worker group (restart 1 of 1)" in err
    for rank in range(3):
        assert f"done rank={rank} attempt=1 value=27.0" in proc.stdout
    kinds = [json.loads(line)["kind"] for line in events.read_text().splitlines()]
    for kind in ("round", "members", "worker_start", "worker_exit", "hang", "restart", "job_end"):
        assert kind in kinds, kinds
    end = json.loads(events.read_text().splitlines()[-1])
    assert end["kind"] == "job_end" and end["status"] == "succeeded"
    hang = next(json.loads(x) for x in events.read_text().splitlines() if '"hang"' in x)
    assert hang["action"] == "restart" and hang["idle_s"] >= 2.0
    out = tmp_path / "timeline.html"
    rep = _run(["report", str(events), "-o", str(out)])
    assert rep.returncode == 0, rep.stderr
    assert "<svg" in out.read_text() and "wrote" in rep.stdout


@pytest.mark.timeout(90)
def test_on_hang_fail_exits_1_with_the_stacks(tmp_path: Path) -> None:
    script = tmp_path / "hang.py"
    script.write_text(HANGS_ONCE)
    proc = _run(
        ["run", "--nproc-per-node", "2", "--hang-timeout", "1.5", "--on-hang", "fail", str(script)]
    )
    assert proc.returncode == 1
    assert "rank 1: sleep" in proc.stderr
    assert "--on-hang fail" in proc.stderr.splitlines()[-1]


SLOW_SETUP = """
import os, sys, time
import torch, torch.distributed as dist
import rallypoint.launcher as rl

dist.init_process_group("gloo")
rank = dist.get_rank()
model = torch.nn.Linear(8, 4)
opt = torch.optim.Adam(model.parameters())  # the first one imports torch._dynamo and sympy
time.sleep(float(sys.argv[1]) if rank == 1 else 0.0)  # a slow set-up (data, say)
for step in range(3):
    model(torch.randn(4, 8)).sum().backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
    opt.step()
    rl.progress()
print(f"done rank={rank}", flush=True)
dist.destroy_process_group()
"""


@pytest.fixture
def cpu_burner() -> Iterator[None]:
    """A process spinning on a core beside the job, as on a loaded CI machine."""
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        burner.kill()
        burner.wait()


@pytest.mark.timeout(150)
def test_a_set_up_longer_than_the_hang_timeout_is_no_hang(tmp_path: Path, cpu_burner: None) -> None:
    """Before its first ``progress()`` in an attempt a rank is in its set-up (its first
    Adam's imports, then 5 s of its own): ``--setup-timeout`` bounds it, not the 2 s of
    ``--hang-timeout`` (before, a healthy job was reported hung)."""
    script = tmp_path / "slow.py"
    script.write_text(SLOW_SETUP)
    events = tmp_path / "events.jsonl"
    args = ["--nproc-per-node", "2", "--hang-timeout", "2", "--setup-timeout", "60"]
    proc = _run(["run", *args, "--events", str(events), str(script), "5"])
    assert proc.returncode == 0, proc.stderr
    assert "reported progress" not in proc.stderr, proc.stderr
    assert '"hang"' not in events.read_text()
    assert "done rank=0" in proc.stdout and "done rank=1" in proc.stdout


@pytest.mark.timeout(150)
def test_a_rank_stuck_in_its_set_up_is_a_hang_after_the_setup_timeout(
    tmp_path: Path, cpu_burner: None
) -> None:
    """Rank 1 never leaves its set-up, and rank 0 waits for it in its first step: a hang,
    found once ``--setup-timeout`` has passed, and the line says that neither rank had
    reported progress (both in their set-up)."""
    script = tmp_path / "stuck.py"
    script.write_text(SLOW_SETUP)
    events = tmp_path / "events.jsonl"
    args = ["--nproc-per-node", "2", "--hang-timeout", "2", "--setup-timeout", "8"]
    args += ["--on-hang", "fail", "--events", str(events)]
    proc = _run(["run", *args, str(script), "3600"])
    assert proc.returncode == 1, proc.stderr
    line = "in the set-up: ranks 0, 1 have not reported any in this attempt (--setup-timeout)"
    assert line in proc.stderr, proc.stderr
    assert "rank 1: sleep" in proc.stderr, proc.stderr
    hang = next(json.loads(x) for x in events.read_text().splitlines() if '"hang"' in x)
    assert hang["idle_s"] >= 8.0, hang


WIND_DOWN = """
import sys, time
import torch, torch.distributed as dist
import rallypoint.launcher as rl

dist.init_process_group("gloo")
rank = dist.get_rank()
t = torch.ones(1)
for step in range(3):
    dist.all_reduce(t)
    rl.progress()
dist.destroy_process_group()
if rank == 1:
    time.sleep(float(sys.argv[1]))  # its last checkpoint, once rank 0 has finished
print(f"done rank={rank}", flush=True)
"""


@pytest.mark.timeout(120)
def test_a_rank_winding_down_after_another_finished_is_bound_by_the_setup_timeout(
    tmp_path: Path,
) -> None:
    """Once rank 0 finished, rank 1's last save (no progress for 3 s, three times
    ``--hang-timeout``) is no hang; the same save stuck for good is one, after
    ``--setup-timeout``, and the line says the job was winding down."""
    script = tmp_path / "wind_down.py"
    script.write_text(WIND_DOWN)
    args = ["run", "--nproc-per-node", "2", "--hang-timeout", "1", "--setup-timeout", "6"]
    args += ["--on-hang", "fail"]
    proc = _run([*args, str(script), "3"])
    assert proc.returncode == 0, proc.stderr
    assert "done rank=0" in proc.stdout and "done rank=1" in proc.stdout
    events = tmp_path / "events.jsonl"
    proc = _run([*args, "--events", str(events), str(script), "3600"])
    assert proc.returncode == 1, proc.stderr
    line = "in the wind-down: rank 0 has finished (--setup-timeout)"
    assert line in proc.stderr and "rank 1: sleep" in proc.stderr, proc.stderr
    hang = next(json.loads(x) for x in events.read_text().splitlines() if '"hang"' in x)
    assert hang["idle_s"] >= 6.0, hang


@pytest.mark.timeout(120)
def test_across_two_agents_the_wind_down_after_a_node_finished_is_no_hang(
    tmp_path: Path, endpoint: str
) -> None:
    """Rank 0's node finished; rank 1, alone on the other node, saves for 5 s (2.5 times
    ``--hang-timeout``) before it ends: its agent learnt that a node finished, so the
    bound is ``--setup-timeout`` and the job ends well on both nodes."""
    script = tmp_path / "wind_down.py"
    script.write_text(WIND_DOWN)
    cmd = [
        sys.executable, "-m", "rallypoint", "run", "--nnodes", "2",
        "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
        "--rdzv-id", "wind-down", "--rdzv-conf", "is_host=false", "--max-restarts", "0",
        "--hang-timeout", "2", "--setup-timeout", "20", "--on-hang", "fail",
        str(script), "5",
    ]  # fmt: skip
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    agents = [cli_zygote.Popen(cmd, **pipes) for _ in range(2)]
    said = [a.communicate(timeout=90) for a in agents]
    assert [a.returncode for a in agents] == [0, 0], "\n".join(err for _, err in said)
    out = "".join(o for o, _ in said)
    assert "done rank=0" in out and "done rank=1" in out, out


def test_bad_hang_options_are_one_line_errors(tmp_path: Path) -> None:
    script = tmp_path / "ok.py"
    script.write_text("pass\n")
    for args, needle in (
        (["--hang-timeout", "0"], "--hang_timeout: must be > 0, got 0"),
        (["--on-hang", "ignore"], "invalid choice"),
        (["--setup-timeout", "5"], "setup_timeout bounds a hang in the set-up: set hang_"),
        (
            ["--hang-timeout", "8", "--setup-timeout", "5"],
            "setup_timeout must be at least hang_timeout (8 s), got 5 s",
        ),
        (["--events", str(tmp_path / "no" / "dir" / "e.jsonl")], "cannot open events file"),
    ):
        proc = _run(["run", *args, str(script)])
        assert proc.returncode == 2, (args, proc.stderr)
        assert needle in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_progress_is_exported() -> None:
    import rallypoint.launcher as rl

    assert "progress" in rl.__all__
    rl.progress()  # a no-op outside a rallypoint worker
