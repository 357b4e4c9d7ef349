"""The fault at every rank's position: ``benchmarks/restart.py --positions N``.

One job of N ranks on one node, default flags; attempt ``k`` (below N) kills rank ``k`` five
steps after its first step, so one job puts the fault at every position in turn. Each
process runs restart.py's set-up first (it sleeps 2 s and builds a small model and SGD);
the function sets up gloo and runs steps of about 20 ms (one all_reduce of the gradients).
For each position, recovery is the time from the fault until every rank has finished its
first step of the next attempt, and the replaced rank's set-up (its script's first line to
the call of the function) is recorded beside it. Variants, alternated by repeat:

- in process: the function is ``@rallypoint.restartable``;
- full restart: the same script, not decorated (every process starts afresh).

The goal (default flags): in process, no position slower than the replaced rank's own
set-up plus 0.5 s.
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

SETUP_SLEEP, STEP = 2.0, 0.02
GAP = 5
"""Steps each attempt runs before its fault."""
GOAL_OVER_SETUP = 0.5

WORKER = """
import os, signal, sys, time
T0 = time.time()  # the set-up starts here
import torch
import torch.distributed as dist
import rallypoint

OUT, DECORATED = sys.argv[1], sys.argv[2] == "1"
SETUP_SLEEP, STEP, GAP = float(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5])
time.sleep(SETUP_SLEEP)  # loading data, reading a checkpoint, ...
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
x = torch.randn(32, 64)
SETUP_DONE = time.time()


def _stamp(name, value):
    with open(f"{OUT}/.{name}", "w") as fp:
        fp.write(repr(value))
    os.rename(f"{OUT}/.{name}", f"{OUT}/{name}")


def train():
    global SETUP_DONE
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if SETUP_DONE is not None:  # this process's first entry: its set-up's length
        _stamp(f"setup-{attempt}-{rank}", SETUP_DONE - T0)
        SETUP_DONE = None
    for step in range(GAP + 1 if attempt < world else 1):
        begin = time.monotonic()
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters()])
        dist.all_reduce(grads)
        opt.step()
        time.sleep(max(0.0, STEP - (time.monotonic() - begin)))
        if step == 0 and attempt > 0:
            _stamp(f"first-{attempt}-{rank}", time.time())
        if attempt < world and rank == attempt and step == GAP:
            _stamp(f"fault-{attempt}", time.time())
            os.kill(os.getpid(), signal.SIGKILL)
    dist.destroy_process_group()


(rallypoint.restartable(train) if DECORATED else train)()
"""

VARIANTS = {"in process": "1", "full restart": "0"}


def run_job(nproc: int, decorated: str, timeout: float) -> dict[int, tuple[float, float]]:
    """``{position: (recovery, the replaced rank's set-up)}`` of one job (s)."""
    with tempfile.TemporaryDirectory(prefix="rp-positions-") as tmp:
        out = Path(tmp)
        script = out / "worker.py"
        script.write_text(WORKER)
        cmd = [
            sys.executable, "-m", "rallypoint", "run", "--nproc-per-node", str(nproc),
            "--max-restarts", str(nproc), "--max-same-failure", str(nproc + 1), str(script),
            str(out), decorated, str(SETUP_SLEEP), str(STEP), str(GAP),
        ]  # fmt: skip
        env = dict(os.environ, OMP_NUM_THREADS="1")
        proc = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        try:
            text, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            text, _ = proc.communicate()
        if proc.returncode != 0:
            tail = text.decode(errors="replace")[-2000:]
            print(f"job exited {proc.returncode}:\n{tail}", file=sys.stderr)
        found = {}
        for position in range(nproc):
            attempt = position + 1
            fault_file = out / f"fault-{position}"
            firsts = [float(p.read_text()) for p in out.glob(f"first-{attempt}-*")]
            setup = out / f"setup-{attempt}-{position}"
            if fault_file.exists() and len(firsts) == nproc and setup.exists():
                fault = float(fault_file.read_text())
                found[position] = (max(firsts) - fault, float(setup.read_text()))
        return found


def measure(nproc: int, repeat: int, timeout: float = 600.0) -> None:
    """Run the variants ``repeat`` times, alternating, and print the table."""
    results: dict[str, list[dict[int, tuple[float, float]]]] = {v: [] for v in VARIANTS}
    for r in range(repeat):
        for name in VARIANTS if r % 2 == 0 else list(VARIANTS)[::-1]:
            results[name].append(run_job(nproc, VARIANTS[name], timeout))
            print(f"  {name}: {results[name][-1]}", file=sys.stderr)
    load = os.getloadavg()[0]
    print(
        f"\n{nproc} ranks on one node, a rank killed at each position in turn, default flags "
        f"({os.cpu_count()} CPUs, load {load:.1f}); median over {repeat} job(s) per position\n"
    )
    print("| variant | median position (s) | slowest position (s) | replaced rank's set-up (s) |")
    print("| --- | --- | --- | --- |")
    medians: dict[str, dict[int, float]] = {}
    for name, jobs in results.items():
        per = {
            p: statistics.median(j[p][0] for j in jobs if p in j)
            for p in range(nproc)
            if any(p in j for j in jobs)
        }
        setups = [j[p][1] for j in jobs for p in j]
        medians[name] = per
        if not per:
            print(f"| {name} | failed | failed | - |")
            continue
        slow = max(per, key=lambda p: per[p])
        missing = nproc - len(per)
        note = f" ({missing} position(s) missing)" if missing else ""
        print(
            f"| {name} | {statistics.median(per.values()):.2f} | {per[slow]:.2f} "
            f"(rank {slow}){note} | {statistics.median(setups):.2f} |"
        )
    inproc = medians.get("in process", {})
    if inproc:
        setups = [j[p][1] for j in results["in process"] for p in j]
        goal = statistics.median(setups) + GOAL_OVER_SETUP
        verdict = "holds" if max(inproc.values()) <= goal else "missed"
        print(f"\ngoal (in process, every position at most set-up + {GOAL_OVER_SETUP} s = "
              f"{goal:.2f} s): {verdict}")  # fmt: skip
        print("per position (s): " + ", ".join(f"{p}: {v:.2f}" for p, v in sorted(inproc.items())))


if __name__ == "__main__":
    measure(int(sys.argv[1]) if len(sys.argv) > 1 else 8, 1)
