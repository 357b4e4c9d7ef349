"""Chaos for ``rallypoint.ft``: replica groups that train for minutes under random faults.

G groups of N ranks (``rallypoint run`` each, gloo, ``tests/ft/_ft_train.py``: a small MLP
and a sleep a step) and one ``rallypoint lighthouse --min_replicas 1``. Every 4 to 10 s
(seeded) one fault, of the kinds asked for:

- ``kill``: SIGKILL one worker (its agent restarts its group, which heals);
- ``stop``: SIGSTOP one worker for 1 to 6 s, then SIGCONT;
- ``lighthouse``: SIGKILL the lighthouse, start it again 0.5 to 3 s later on the same port;
- ``node``: SIGKILL a group's launcher with its whole tree, start it again (a lost node
  and its replacement).

Then no more faults, and every group must reach the last step. Printed: each fault and
how long the groups committed nothing after it (the lighthouse's own start-up, about 2 s
of importing torch, is part of a ``lighthouse`` fault's pause), every pause over
``--stall`` seconds, and the checks the tests make: no process's step goes back, every
group ends with exit code 0, and the groups end with the same parameters rank by rank.

    python benchmarks/quorum_chaos.py [--groups 4] [--nproc 2] [--seconds 300] [--seed 1]
        [--kinds kill,stop,lighthouse,node] [--steps 4000] [--out DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch

from rallypoint._core.net import reserved_port

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "tests" / "ft" / "_ft_train.py"
RALLYPOINT = [sys.executable, "-m", "rallypoint"]
KINDS = ("kill", "stop", "lighthouse", "node")


class Job:
    def __init__(self, out: Path, port: int, nproc: int, steps: int, sleep: float) -> None:
        self.out, self.port, self.nproc, self.steps, self.sleep = out, port, nproc, steps, sleep
        self.env = {**os.environ, "RES_OPTIONS": "timeout:1 attempts:1"}
        self.house = self.lighthouse()
        self.groups: dict[int, subprocess.Popen[bytes]] = {}
        self.faults: list[tuple[float, str]] = []

    def lighthouse(self) -> subprocess.Popen[bytes]:
        argv = ["lighthouse", "--bind", f"[::]:{self.port}", "--min_replicas", "1"]
        return self._spawn(argv, "lighthouse.log", self.env)

    def start(self, group: int) -> None:
        env = {
            **self.env,
            "REPLICA_GROUP_ID": str(group),
            "TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{self.port}",
            "FT_STEP_SLEEP": str(self.sleep),
        }
        # the faults are staged: the same kill three times in a row is chance, not a bug
        # that --max-same-failure (3) should end the job for
        argv = ["run", "--nproc-per-node", str(self.nproc), "--max-restarts", "1000"]
        argv += ["--max-same-failure", "1000"]
        argv += [str(TRAIN), str(self.out), str(self.steps)]
        self.groups[group] = self._spawn(argv, f"group-{group}.log", env, new_session=True)

    def _spawn(
        self, argv: list[str], log: str, env: dict[str, str], new_session: bool = False
    ) -> subprocess.Popen[bytes]:
        """``python -m rallypoint ARGV``, its output appended to ``log``."""
        fd = os.open(self.out / log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            return subprocess.Popen(
                [*RALLYPOINT, *argv],
                stdout=fd,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=new_session,
            )
        finally:
            os.close(fd)

    def workers(self, group: int) -> list[psutil.Process]:
        try:
            tree = psutil.Process(self.groups[group].pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        found = []
        for proc in tree:
            try:
                if "rallypoint worker rank" in " ".join(proc.cmdline()):
                    found.append(proc)
            except psutil.Error:
                pass
        return found

    def fault(self, kind: str, rng: random.Random) -> None:
        group = rng.randrange(len(self.groups))
        workers = self.workers(group)
        if kind in ("kill", "stop") and not workers:
            return
        if kind == "kill":
            victim = rng.choice(workers)
            self._note(f"kill: group {group}, {_rank(victim)}")
            victim.send_signal(signal.SIGKILL)
        elif kind == "stop":
            victim, held = rng.choice(workers), rng.uniform(1, 6)
            self._note(f"stop: group {group}, {_rank(victim)}, for {held:.1f} s")
            victim.send_signal(signal.SIGSTOP)
            time.sleep(held)
            with contextlib.suppress(psutil.Error):
                victim.send_signal(signal.SIGCONT)
        elif kind == "lighthouse":
            away = rng.uniform(0.5, 3)
            self._note(f"lighthouse: killed, started again {away:.1f} s later")
            self.house.kill()
            self.house.wait()
            time.sleep(away)
            self.house = self.lighthouse()
        else:
            self._note(f"node: group {group}'s launcher and its tree killed, started again")
            os.killpg(self.groups[group].pid, signal.SIGKILL)
            self.groups[group].wait()
            time.sleep(rng.uniform(0.5, 3))
            self.start(group)

    def _note(self, what: str) -> None:
        self.faults.append((time.time(), what))
        print(f"{time.strftime('%H:%M:%S')} {what}", flush=True)

    def finish(self, timeout: float) -> dict[int, int | str]:
        deadline = time.monotonic() + timeout
        codes: dict[int, int | str] = {}
        for group, proc in self.groups.items():
            try:
                codes[group] = proc.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                codes[group] = "did not end"
                os.killpg(proc.pid, signal.SIGKILL)
        self.house.kill()
        return codes


def _rank(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline()[0].split()[2:4])  # "rank R"
    except (psutil.Error, IndexError):
        return "a worker"


def commits(out: Path, group: int) -> list[tuple[float, int, int]]:
    """``(time, step, pid)`` of each step the group's ranks committed."""
    rows = []
    for line in (out / f"steps-{group}").read_text().splitlines():
        when, step, _, pid = line.split()
        rows.append((float(when), int(step), int(pid)))
    return sorted(rows)


def _alone_at_the_end(rows: dict[int, list[tuple[float, int, int]]]) -> set[int]:
    """The groups whose last process started after every other group had ended (a node
    replaced just before the end): alone in every quorum, they trained from step 0."""
    ended = {g: r[-1][0] for g, r in rows.items() if r}
    alone = set()
    for g, r in rows.items():
        others = [t for h, t in ended.items() if h != g]
        if r and others and min(t for t, _, pid in r if pid == r[-1][2]) > max(others):
            alone.add(g)
    return alone


def report(job: Job, groups: int, codes: dict[int, int | str], stall: float) -> bool:
    ok = all(code == 0 for code in codes.values())
    print(f"exit codes: {codes}")
    rows = {g: commits(job.out, g) for g in range(groups)}
    every = sorted(t for r in rows.values() for t, _, _ in r)
    print("after each fault, the longest time no group committed (until the next fault):")
    ends = [when for when, _ in job.faults[1:]] + [every[-1] if every else 0.0]
    for (when, what), until in zip(job.faults, ends, strict=True):
        # a gap that runs past the next fault is that fault's from then on (counting it
        # whole here named a kill for the 5 s of a node loss that came after it)
        inside = [when, *(t for t in every if when < t < until), until]
        gap = max((b - a for a, b in itertools.pairwise(inside)), default=0.0)
        print(f"  {gap:6.2f} s  {what}")
    for g in range(groups):
        by_pid: dict[int, list[int]] = {}
        for _, step, pid in rows[g]:
            by_pid.setdefault(pid, []).append(step)
        for pid, steps in by_pid.items():
            back = [(a, b) for a, b in itertools.pairwise(steps) if b <= a]
            if back:
                ok = False
                print(f"group {g}, process {pid}: its step went back {back[:3]}")
    for a, b in itertools.pairwise(every):
        if b - a > stall:
            before = [what for when, what in job.faults if when <= a + 0.5]
            print(f"STALL: no group committed for {b - a:.1f} s (last fault: {before[-1:]})")
    alone = _alone_at_the_end(rows)
    for g in alone:
        print(f"group {g} came back after the others had ended and trained alone from its own")
        print("  start (--min_replicas 1 lets it): its parameters are not compared")
    finals: dict[str, list[tuple[str, dict[str, torch.Tensor]]]] = {}
    for path in sorted(job.out.glob("final-*.pt")):
        if int(path.stem.split("-")[1]) in alone:
            continue
        rank = path.stem.split("-rank")[1] if "-rank" in path.stem else "0"
        finals.setdefault(rank, []).append((path.name, torch.load(path)))
    for saved in finals.values():
        first_name, first = saved[0]
        for name, other in saved[1:]:
            if any(not torch.equal(first[k], other[k]) for k in first):
                ok = False
                print(f"parameters differ: {name} and {first_name}")
    count = sum(len(saved) for saved in finals.values())
    print(f"parameters compared: {count} files; {'every check holds' if ok else 'FAILED'}")
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--nproc", type=int, default=2, help="ranks per group")
    parser.add_argument("--seconds", type=float, default=300.0, help="how long faults come")
    parser.add_argument("--steps", type=int, default=4000, help="the last step")
    parser.add_argument("--step-sleep", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--stall", type=float, default=8.0, help="report pauses over this")
    parser.add_argument("--out", type=Path, help="where the logs go (default: a temp dir)")
    args = parser.parse_args()
    kinds = args.kinds.split(",")
    if not set(kinds) <= set(KINDS):
        parser.error(f"--kinds: each of {', '.join(KINDS)}")
    out = args.out or Path(tempfile.mkdtemp(prefix="quorum-chaos-"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"logs in {out}")
    with reserved_port() as port:  # held (never listening) while the lighthouses bind it
        job = Job(out, port, args.nproc, args.steps, args.step_sleep)
        rng = random.Random(args.seed)
        time.sleep(2)
        for group in range(args.groups):
            job.start(group)
        time.sleep(15)
        end = time.monotonic() + args.seconds
        while time.monotonic() < end:
            time.sleep(rng.uniform(4, 10))
            job.fault(rng.choice(kinds), rng)
        print("no more faults; waiting for every group's last step")
        codes = job.finish(timeout=900)
    sys.exit(0 if report(job, args.groups, codes, args.stall) else 1)


if __name__ == "__main__":
    main()
