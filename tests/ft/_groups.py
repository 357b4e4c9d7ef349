"""A lighthouse and replica groups as a user starts them: ``rallypoint lighthouse`` and one
``rallypoint run`` per group, each running ``_ft_train.py`` (real processes, gloo).

Each command is forked by the command zygote (``_support.cli_zygote``): the command line,
the launcher, its warm process and its workers are those of ``python -m rallypoint``,
without a new interpreter importing torch for each lighthouse (and each of its restarts)
and each group."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from _support import cli_zygote
from rallypoint._core.net import reserved_port

TRAIN = Path(__file__).with_name("_ft_train.py")


def _env(**extra: str) -> dict[str, str]:
    """This process's environment, as the command zygote started with it (its PYTHONPATH
    too: another would need a new interpreter)."""
    env = {**os.environ, **extra}
    env.setdefault("RES_OPTIONS", "timeout:1 attempts:1")
    return env


def start_command(*args: str, **env: str) -> subprocess.Popen[str]:
    """``python -m rallypoint ARGS`` with ``env`` added, its output (stderr too) piped."""
    return cli_zygote.Popen(
        [sys.executable, "-m", "rallypoint", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=_env(**env),
    )


@dataclass
class Lighthouse:
    port: int
    args: list[str]
    proc: subprocess.Popen[str] | None = None
    logs: list[str] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.proc = start_command("lighthouse", "--bind", f"[::]:{self.port}", *self.args)
        assert self.proc.stdout is not None
        # c10d may warn first (a reverse name lookup that timed out): read to the address
        while "TORCHFT_LIGHTHOUSE=" not in (line := self.proc.stdout.readline()):
            self.logs.append(line)
            assert line, "".join(self.logs)  # it ended without saying where it listens
        self.logs.append(line)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        out, _ = self.proc.communicate(timeout=30)
        self.logs.append(out)

    def stop(self) -> str:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            out, _ = self.proc.communicate(timeout=30)
            self.logs.append(out)
        return "".join(self.logs)


def lighthouse(*args: str) -> Lighthouse:
    # the port stays out of other processes' reach until the lighthouse has bound it (a
    # suite beside this one could take a port merely free when picked)
    with reserved_port() as port:
        house = Lighthouse(port, list(args))
        house.start()
    return house


def start_group(
    out: Path,
    group: int,
    lighthouse_addr: str,
    steps: int,
    *flags: str,
    nproc: int = 1,
    restarts: int = 2,
    **env: str,
) -> subprocess.Popen[str]:
    """Group ``group`` of ``nproc`` ranks, ``rallypoint run --max-restarts RESTARTS FLAGS``
    training ``_ft_train.py`` up to ``steps`` (``env`` added to its environment)."""
    extra = {
        "REPLICA_GROUP_ID": str(group),
        "TORCHFT_LIGHTHOUSE": lighthouse_addr,
        "FT_STEP_SLEEP": "0.15",  # the step time
        **env,
    }
    proc = start_command("run", "--nproc-per-node", str(nproc), "--max-restarts", str(restarts),
                         *flags, str(TRAIN), str(out), str(steps), **extra)  # fmt: skip
    STARTED.append(proc)
    return proc


STARTED: list[subprocess.Popen[str]] = []
"""Every group started: a test that fails before :func:`finish` leaves none running
(``conftest.py``)."""


def stop_leftovers() -> None:
    while STARTED:
        proc = STARTED.pop()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # its launcher stops its workers
            try:
                proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()


def finish(groups: list[subprocess.Popen[str]], timeout: float = 200) -> list[str]:
    deadline = time.monotonic() + timeout
    texts = []
    for p in groups:
        try:
            texts.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
        except subprocess.TimeoutExpired:
            p.kill()
            texts.append(p.communicate()[0] + "\n(killed by the test: it did not end)")
    return texts


def steps(out: Path, group: int) -> list[tuple[float, int, int]]:
    """``(time, step, participants)`` of each step the group committed, in order."""
    path = out / f"steps-{group}"
    if not path.exists():
        return []
    rows = [line.split() for line in path.read_text().splitlines() if line.strip()]
    return [(float(t), int(s), int(n)) for t, s, n, _pid in rows]


def steps_by_process(out: Path, group: int) -> list[list[int]]:
    """The steps each of the group's processes committed, one list per process, in order."""
    path = out / f"steps-{group}"
    found: dict[str, list[int]] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            _t, step, _n, pid = line.split()
            found.setdefault(pid, []).append(int(step))
    return list(found.values())


def wait_for_step(out: Path, group: int | tuple[int, ...], step: int, timeout: float = 120) -> None:
    """Until ``group`` (or any of several) has committed ``step``."""
    groups = (group,) if isinstance(group, int) else group
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for g in groups:
            done = steps(out, g)
            if done and done[-1][1] >= step:
                return
        time.sleep(0.05)
    last = {g: steps(out, g)[-3:] for g in groups}
    raise AssertionError(f"no group of {groups} reached step {step}: {last}")


def longest_pause(rows: list[tuple[float, int, int]], after: int = 0) -> tuple[float, float]:
    """The longest time between two commits past step ``after``, and the median one."""
    gaps = [b[0] - a[0] for a, b in itertools.pairwise(rows) if a[1] >= after]
    gaps_sorted = sorted(gaps)
    return (max(gaps) if gaps else 0.0), (gaps_sorted[len(gaps) // 2] if gaps else 0.0)


def never_back(rows: list[tuple[float, int, int]]) -> None:
    """Each commit is one step past the one before (a restarted process starts a new file
    section, at the step it healed to, which is never below the last one). One exception,
    as torchft allows with ``--min_replicas 1``: a group that was alone in a quorum (the
    others were slow to join on a loaded machine) stepped past the others and then died;
    its new process heals to the others' step, behind its old process's last commit, in a
    quorum of more participants than that commit had."""
    for a, b in itertools.pairwise(rows):
        assert b[1] >= a[1] or a[2] < b[2], f"a step went back: {a} then {b}"


def same_parameters(out: Path, groups: list[int], ranks: int = 1) -> None:
    """Each rank of ``groups`` ends with the parameters of the same rank of the first (a
    group's ranks heal from the groups their ranks pick, so rank is compared with rank)."""
    for rank in range(ranks):
        suffix = f"-rank{rank}" if rank else ""
        finals = [torch.load(out / f"final-{g}{suffix}.pt") for g in groups]
        for g, other in zip(groups[1:], finals[1:], strict=True):
            for name in finals[0]:
                same = torch.equal(finals[0][name], other[name])
                assert same, f"group {g}{suffix}: {name} differs"
