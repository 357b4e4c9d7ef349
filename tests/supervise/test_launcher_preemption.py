"""Preemption: a SIGTERM or SIGINT that reaches the job by any route a cluster uses lets
the workers' own handlers finish, as torchrun does; checked against torchrun in the same
test, both launchers running at once (the test compares what happens, not timing).

Routes: the launcher alone (``kill PID``), the launcher's process group (``timeout``,
``kill -- -PGID``, a terminal's ^C), every process of the job at once (SLURM's
``scancel`` and time limit signal each process of the step), and a multi-node job whose
nodes' agents are signalled (a scheduler cancelling the job on every node).

The workers' handler needs 2 s (a checkpoint): it records each call, sleeps, then writes
``saved``. Before the fix the warm process took any SIGTERM for its parent's death and
SIGKILLed the workers within ~45 ms (no ``saved``), and each worker was signalled twice
by the launcher (its session, then again as a descendant).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from _support.store_host import store_host

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

HANDLER = """
import os, signal, sys, time
from pathlib import Path
out = Path(sys.argv[1])
rank = os.environ["RANK"]
def on_signal(signum, frame):
    with open(out / f"calls{rank}", "a") as fp:
        fp.write("x")
    time.sleep(2)  # saving a checkpoint
    (out / f"saved{rank}").write_text(str(signum))
    sys.exit(0)
signal.signal(signal.SIGTERM, on_signal)
signal.signal(signal.SIGINT, on_signal)
(out / f"ready{rank}").write_text("")
time.sleep(90)
"""

RALLYPOINT = [sys.executable, "-m", "rallypoint", "run"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


class Job:
    """One launcher (or one per node) running the handler script on ``nproc`` ranks."""

    def __init__(self, name: str, cmds: list[list[str]], out: Path, nranks: int) -> None:
        self.name, self.out, self.nranks = name, out, nranks
        out.mkdir()
        self.procs = [
            subprocess.Popen(  # each its own process group, as a shell's job would be
                [*cmd, str(out.parent / "handler.py"), str(out)],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
            for cmd in cmds
        ]
        self.tree: list[psutil.Process] = []

    def wait_ready(self, deadline: float) -> None:
        while not all((self.out / f"ready{r}").exists() for r in range(self.nranks)):
            for p in self.procs:
                assert p.poll() is None, f"{self.name} ended early: {p.communicate()[0]}"
            assert time.monotonic() < deadline, f"{self.name}: workers not ready"
            time.sleep(0.05)
        self.tree = [psutil.Process(p.pid) for p in self.procs]
        for launcher in list(self.tree):
            self.tree += launcher.children(recursive=True)

    def signal(self, route: str, signum: int) -> None:
        match route:
            case "launcher":
                for p in self.procs:
                    p.send_signal(signum)
            case "group":
                for p in self.procs:
                    os.killpg(p.pid, signum)  # each launcher leads its own group
            case "every process":
                for q in self.tree:
                    with contextlib.suppress(psutil.NoSuchProcess):
                        q.send_signal(signum)
            case _:
                raise AssertionError(route)

    def finish(self) -> list[tuple[int, str]]:
        ends = []
        for p in self.procs:
            try:
                text, _ = p.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                text, _ = p.communicate()
            ends.append((p.returncode, text))
        return ends

    def saved(self) -> list[bool]:
        return [(self.out / f"saved{r}").exists() for r in range(self.nranks)]

    def calls(self) -> list[int]:
        return [len((self.out / f"calls{r}").read_text()) for r in range(self.nranks)]

    def survivors(self) -> list[psutil.Process]:
        _, alive = psutil.wait_procs(self.tree, timeout=5)
        return [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]

    def kill(self) -> None:
        for q in self.tree:
            with contextlib.suppress(psutil.NoSuchProcess):
                q.kill()
        for p in self.procs:
            p.kill()


@pytest.fixture
def run_both(tmp_path: Path) -> Iterator[list[Job]]:
    (tmp_path / "handler.py").write_text(HANDLER)
    jobs: list[Job] = []
    yield jobs
    for job in jobs:
        job.kill()


@pytest.mark.parametrize(
    ("route", "signum"),
    [
        ("launcher", signal.SIGTERM),
        ("group", signal.SIGTERM),
        ("group", signal.SIGINT),
        ("every process", signal.SIGTERM),
    ],
)
def test_one_node_handlers_finish_as_under_torchrun(
    tmp_path: Path, run_both: list[Job], route: str, signum: int
) -> None:
    args = ["--nproc-per-node", "2"]
    run_both += [
        Job("rallypoint", [[*RALLYPOINT, *args]], tmp_path / "rallypoint", 2),
        Job("torchrun", [[*TORCHRUN, "--standalone", *args]], tmp_path / "torchrun", 2),
    ]
    ours, theirs = run_both
    deadline = time.monotonic() + 60
    for job in run_both:
        job.wait_ready(deadline)
    for job in run_both:
        job.signal(route, signum)
    [(code, text)] = ours.finish()
    theirs.finish()

    assert theirs.saved() == [True, True], "the staging is wrong: torchrun's handlers failed"
    assert ours.saved() == [True, True], text
    assert code == 128 + signum, text
    assert f"received {signal.Signals(signum).name}" in text, text
    assert "Traceback" not in text, text
    # rallypoint signals each worker once; with every process signalled, the scheduler's
    # own SIGTERM may come on top (as under torchrun, which signals its workers too)
    once = 2 if route == "every process" else 1
    assert max(ours.calls()) <= once, f"a worker's handler ran {ours.calls()} times"
    assert not ours.survivors()


def test_multinode_agents_let_handlers_finish_as_under_torchrun(
    tmp_path: Path, run_both: list[Job]
) -> None:
    with store_host() as port:
        common = [
            "--nnodes",
            "2",
            "--nproc-per-node",
            "1",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            "--rdzv-conf",
            "is_host=false",
        ]
        run_both += [
            Job("rallypoint", [[*RALLYPOINT, *common, "--rdzv-id", "rp"]] * 2, tmp_path / "r", 2),
            Job("torchrun", [[*TORCHRUN, *common, "--rdzv-id", "tr"]] * 2, tmp_path / "t", 2),
        ]
        ours, theirs = run_both
        deadline = time.monotonic() + 90
        for job in run_both:
            job.wait_ready(deadline)
        for job in run_both:  # the scheduler cancels the job: each node's agent, its group
            job.signal("group", signal.SIGTERM)
        ends = ours.finish()
        theirs.finish()

    assert theirs.saved() == [True, True], "the staging is wrong: torchrun's handlers failed"
    assert ours.saved() == [True, True], ends
    assert ours.calls() == [1, 1]
    for code, text in ends:
        assert code == 143, text
        assert "Traceback" not in text, text
    assert not ours.survivors()


def test_an_early_sigint_is_one_line_and_leaves_nothing(tmp_path: Path) -> None:
    """^C while the launcher still imports and parses (before its own handlers are in):
    it printed a ``KeyboardInterrupt`` traceback."""
    script = tmp_path / "ok.py"
    script.write_text("print('hi')\n")
    for delay in (0.0, 0.02, 0.05):
        proc = subprocess.Popen(
            [*RALLYPOINT, "--nproc-per-node", "2", str(script)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        launcher = psutil.Process(proc.pid)
        deadline = time.monotonic() + 10
        while not (tree := launcher.children()):  # the warm process: our code runs
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
            time.sleep(0.001)
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
        assert "Traceback" not in err, err
        if proc.returncode == 0:  # the job was quicker than the signal
            continue
        assert proc.returncode == 130, err
        [line] = err.strip().splitlines()[-1:]
        assert "received SIGINT" in line, err
        _, alive = psutil.wait_procs(tree, timeout=5)
        assert not alive
