"""Benchmark: an in-process restart (``@rallypoint.restartable``) vs a full restart, with
torchrun beside them, in one run on the same machine.

The time measured is from a fault until every rank has finished its next step: a rank
SIGKILLs itself at step 10 of the first attempt (after writing the time), and each rank
writes when it finished its first step of the next attempt; recovery is the last of those
minus the fault. Every process runs a set-up above the training function first: it
sleeps 2 s (loading data, reading a checkpoint) and builds a small model and an SGD
optimizer. The function sets up gloo and runs steps of about 20 ms (one all_reduce of the
gradients, then a sleep to a steady step).

Scenarios, alternated within each repeat:

- 4 ranks, one agent (``--max-restarts 1``):
  - rallypoint, in process: the function is ``@rallypoint.restartable``; the killed rank
    alone gets a fresh process (it runs the set-up again), the others stay in theirs;
  - the same with ``--preload torch._dynamo`` (the warm process has imported what a fresh
    worker's first optimizer would import);
  - the same with ``--spare-workers 1``: a spare worker runs the set-up while the ranks
    train and takes the killed rank's place (the fault comes at step 160, after the spare's
    set-up; the columns of the replaced rank's own set-up are then empty);
  - rallypoint, full restart: the same script, the function not decorated;
  - torchrun (``--standalone``): a full restart, new interpreters;
- 2 agents x 2 ranks on loopback (c10d rendezvous, ``--max-restarts 1``): rallypoint with
  the decorated script (in process where this version restarts jobs of several nodes in
  process, else fully: the last column says how many processes ran the set-up again),
  the same script not decorated (a full restart), and torchrun's two agents.

torchrun gets a timeout: on this machine its restarted gloo workers can hang or fail to
reach a stale address (docs/launcher.md, "Restarts"); the table says what happened.
The goal: on CPU, with the default flags, an in-process recovery no slower than the
replaced rank's own set-up (first line of the script to the call of the function, as that
rank measured it) plus 0.5 s.

    .venv/bin/python benchmarks/restart.py                  # 3 repeats, 5-7 minutes on 2 busy cores
    .venv/bin/python benchmarks/restart.py --repeat 1 --skip-torchrun
    .venv/bin/python benchmarks/restart.py --positions 8 --repeat 2   # every position
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import restart_positions
from ports import free_port

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

SETUP_SLEEP, FAULT_STEP, FAULT_RANK = 2.0, 10, 1
SPARE_FAULT_STEP = 160
"""With a spare: the fault after 160 steps of 20 ms, once the spare (forked when the ranks
enter the function) has finished its 2 s set-up."""
START_TIMEOUT = 90.0
GOAL = 0.5
"""Seconds an in-process recovery may take beyond the replaced rank's set-up."""

WORKER = """
import os, time
T0 = time.time()  # the set-up starts here
with open("/proc/self/stat") as fp, open("/proc/uptime") as up:  # ticks since boot
    START = int(fp.read().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
    AGE = float(up.read().split()[0]) - START
import signal, sys
import torch
import torch.distributed as dist
import rallypoint

OUT, DECORATED = sys.argv[1], sys.argv[2] == "1"
SETUP_SLEEP, FAULT_STEP, FAULT_RANK = float(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
STEP, STEPS_AFTER = 0.02, 5
# the attempt: 1 once the fault happened (torchrun's agents number their restarts apart)
attempt0 = int(os.path.exists(f"{OUT}/fault"))
rank0 = os.environ.get("RANK", "spare")  # a spare worker (--spare-workers) has no rank yet

time.sleep(SETUP_SLEEP)  # loading data, reading a checkpoint, ...
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
x = torch.randn(32, 64)
with open(f"{OUT}/setup-{attempt0}-{rank0}-{os.getpid()}", "w") as fp:
    fp.write(f"{T0 - AGE!r} {T0!r} {time.time()!r}")


def _stamp(name):
    with open(f"{OUT}/.{name}", "w") as fp:  # not matched by the harness's globs
        fp.write(repr(time.time()))
    os.rename(f"{OUT}/.{name}", f"{OUT}/{name}")


def train():
    restart = int(os.path.exists(f"{OUT}/fault"))
    if restart:
        _stamp(f"enter-{restart}-{rank0}")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for step in range(FAULT_STEP + 10_000 if restart == 0 else STEPS_AFTER):
        begin = time.monotonic()
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters()])
        dist.all_reduce(grads)
        opt.step()
        time.sleep(max(0.0, STEP - (time.monotonic() - begin)))
        if restart > 0 and step == 0:
            _stamp(f"first-{restart}-{rank}")
        if restart == 0 and rank == FAULT_RANK and step + 1 == FAULT_STEP:
            _stamp("fault")
            os.kill(os.getpid(), signal.SIGKILL)
    dist.destroy_process_group()


(rallypoint.restartable(train) if DECORATED else train)()
"""


@dataclass
class Run:
    recovery: float | None = None
    """The fault to every rank's first step of the next attempt (s)."""
    started: float | None = None
    """The fault to the start of the replaced rank's new process (fork or exec, s)."""
    setup: float | None = None
    """The replaced rank's set-up, as it measured it: its script's first line to the call
    of the function (s)."""
    last: float | None = None
    """The end of that set-up to every rank's first step (init_process_group, a step)."""
    kept: float | None = None
    """The fault to the last kept rank's entry into the function (in process only)."""
    setups_again: int = 0
    """Processes that ran the set-up in the next attempt."""
    note: str = ""
    """What went wrong, if anything."""
    loads: list[float] = field(default_factory=list)


VARIANTS = {
    "inproc": ("rallypoint, in process", 1),
    "inproc-preload": ("rallypoint, in process, `--preload torch._dynamo`", 1),
    "inproc-spare": ("rallypoint, in process, the preload and `--spare-workers 1`", 1),
    "full": ("rallypoint, full restart (not decorated)", 1),
    "torchrun": ("torchrun `--standalone`, full restart", 1),
    "nodes": ("rallypoint, decorated", 2),
    "nodes-full": ("rallypoint, full restart (not decorated)", 2),
    "nodes-torchrun": ("torchrun, full restart", 2),
}


def _commands(variant: str, script: Path, out: Path) -> list[list[str]]:
    py = sys.executable
    decorated = "0" if variant in ("full", "nodes-full") else "1"
    argv = [str(script), str(out), decorated, str(SETUP_SLEEP), str(FAULT_STEP), str(FAULT_RANK)]
    rallypoint = [py, "-m", "rallypoint", "run", "--max-restarts", "1"]
    torchrun = [py, "-m", "torch.distributed.run", "--max-restarts", "1"]
    if variant in ("inproc", "full"):
        return [[*rallypoint, "--nproc-per-node", "4", *argv]]
    if variant == "inproc-preload":
        return [[*rallypoint, "--nproc-per-node", "4", "--preload", "torch._dynamo", *argv]]
    if variant == "inproc-spare":  # the fault comes once the spare's set-up is done
        argv[4] = str(SPARE_FAULT_STEP)
        spare = ["--preload", "torch._dynamo", "--spare-workers", "1"]
        return [[*rallypoint, "--nproc-per-node", "4", *spare, *argv]]
    if variant == "torchrun":
        return [[*torchrun, "--standalone", "--nproc-per-node", "4", *argv]]
    port = free_port()
    head = torchrun if variant == "nodes-torchrun" else rallypoint
    nodes = [
        "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"restart{port}",
    ]  # fmt: skip
    return [[*head, *nodes, *argv] for _ in range(2)]


def _kill(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def _observed(logs: list[Path]) -> str:
    """The first exception of the agents' output that is not the first attempt's (a peer
    closed its connections) nor the agent's summary, for a run that did not recover."""
    pattern = re.compile(r"^(?:\[rank\d+\]: )?([\w.]*(?:Error|Exception)): (.+)")
    for log in logs:
        for line in log.read_text(errors="replace").splitlines():
            m = pattern.match(line.strip())
            if m and "ChildFailedError" not in m[1] and "by peer" not in m[2]:
                return f"{m[1].rsplit('.', 1)[-1]}: {m[2].strip()}"[:160]
    return "no exception in the output"


def run_once(variant: str, timeout: float, keep: Path | None) -> Run:
    """One job with a fault; waits until every rank finished its first step after it."""
    result = Run(loads=[os.getloadavg()[0]])
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        script = out / "worker.py"
        script.write_text(WORKER)
        env = dict(os.environ, OMP_NUM_THREADS="1")
        logs, procs = [], []
        for i, cmd in enumerate(_commands(variant, script, out)):
            logs.append(out / f"agent{i}.log")
            with open(logs[-1], "wb") as log:
                procs.append(
                    subprocess.Popen(
                        cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                    )
                )
        start = time.monotonic()
        fault: float | None = None
        try:
            while True:
                firsts = sorted(out.glob("first-1-*"))
                if fault is None and (out / "fault").exists():
                    fault = float((out / "fault").read_text())
                if fault is not None and len(firsts) == 4:
                    result.recovery = max(float(p.read_text()) for p in firsts) - fault
                    break
                if all(p.poll() is not None for p in procs):
                    when = f"{time.time() - fault:.1f} s after the fault" if fault else "early"
                    codes = ", ".join(str(p.returncode) for p in procs)
                    result.note = f"fails: exited {codes} {when}; {_observed(logs)}"
                    break
                if fault is not None:
                    late = time.time() - fault > timeout
                else:  # the start (4 interpreters import torch) gets its own allowance
                    late = time.monotonic() - start > START_TIMEOUT
                if late:
                    what = f"{timeout:.0f} s after" if fault else f"{START_TIMEOUT:.0f} s, no"
                    entered = len(list(out.glob("enter-1-*")))
                    where = f"{entered} of 4 ranks entered the function, {len(firsts)} stepped"
                    result.note = f"hangs (>{what} fault; {where}): {_observed(logs)}"
                    break
                time.sleep(0.01)
            if result.recovery is not None:  # the next attempt ends by itself: cleanly?
                with contextlib.suppress(subprocess.TimeoutExpired):
                    for p in procs:
                        p.wait(timeout=30)
                codes = [p.poll() for p in procs]
                if None in codes:
                    result.note = "recovered, then still running 30 s later"
                elif any(codes):
                    result.note = f"recovered, then exited {codes}: {_observed(logs)}"
            _setups(out, result)
        finally:
            _kill(procs)
            result.loads.append(os.getloadavg()[0])
            if keep is not None:
                dest = keep / f"{variant}-{time.strftime('%H%M%S')}"
                subprocess.run(["cp", "-r", str(out), str(dest)], check=False)
    return result


def _setups(out: Path, result: Run) -> None:
    if not (out / "fault").exists():
        return
    fault = float((out / "fault").read_text())
    again = {p.name.split("-")[2]: p for p in out.glob("setup-1-*")}
    result.setups_again = len(again)
    if str(FAULT_RANK) in again:
        born, t0, done = (float(v) for v in again[str(FAULT_RANK)].read_text().split())
        result.started, result.setup = born - fault, done - t0
        if result.recovery is not None:
            result.last = result.recovery - (done - fault)
    kept = [float(p.read_text()) for p in out.glob("enter-1-*") if p.name[8:] not in again]
    if kept:
        result.kept = max(kept) - fault


# ---------------------------------------------------------------------------- report


def _stats(values: list[float | None]) -> str:
    done = [v for v in values if v is not None]
    if not done:
        return "-"
    text = f"{statistics.median(done):.2f}"
    if len(done) > 1:
        text += f" ({min(done):.2f}-{max(done):.2f})"
    return text


def _med(values: list[float | None]) -> float | None:
    done = [v for v in values if v is not None]
    return statistics.median(done) if done else None


def _recovery_cell(runs: list[Run]) -> str:
    text = _stats([r.recovery for r in runs])
    failed = [r for r in runs if r.recovery is None]
    if not failed:
        return text
    hangs = sum(1 for r in failed if r.note.startswith("hangs"))
    how = ", ".join(
        f"{n} {what}" for n, what in ((len(failed) - hangs, "failed"), (hangs, "hung")) if n
    )
    if len(failed) == len(runs):
        return f"did not recover ({how})"
    return f"{text}; {len(failed)} of {len(runs)} did not recover ({how})"


def _label(variant: str, runs: list[Run]) -> str:
    """The variant's name; the decorated script on several nodes says how it restarted."""
    label = VARIANTS[variant][0]
    if variant == "nodes":
        again = {r.setups_again for r in runs if r.recovery is not None}
        if again == {1}:
            label += " (restarted in process)"
        elif again == {4}:
            label += " (restarted fully)"
    return label


def report(results: dict[str, list[Run]], args: argparse.Namespace) -> None:
    import torch

    loads = [x for runs in results.values() for r in runs for x in r.loads]
    print(
        f"\n{time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"{args.repeat} repeats alternated, load average (1 min) "
        f"{min(loads):.1f}-{max(loads):.1f} during the runs"
    )
    print(
        f"\nA rank SIGKILLs itself at step {FAULT_STEP}; recovery: until every rank has "
        f"finished its first step of the next attempt. Set-up: a {SETUP_SLEEP:.0f} s sleep, "
        "a small model and SGD. Median (min-max) in seconds; ratio: to the scenario's first "
        "row. The replaced rank: its new process started after the fault, its set-up, then "
        "the end of its set-up to every rank's first step (init_process_group and a step).\n"
    )
    print(
        "| ranks | variant | recovery (s) | ratio | replaced rank: process started (s) "
        "| its set-up (s) | set-up end to every first step (s) | recovery - set-up (s) "
        "| set-ups run again |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    base: dict[int, float | None] = {}
    for variant, runs in results.items():
        label, agents = _label(variant, runs), VARIANTS[variant][1]
        rec = _med([r.recovery for r in runs])
        first = base.setdefault(agents, rec)
        ratio = f"{rec / first:.2f}x" if rec is not None and first else "-"
        over = [
            r.recovery - r.setup for r in runs if r.recovery is not None and r.setup is not None
        ]
        again = sorted({r.setups_again for r in runs if r.setups_again})
        print(
            f"| {'4' if agents == 1 else '2 agents x 2'} | {label} | {_recovery_cell(runs)} | "
            f"{ratio} | {_stats([r.started for r in runs])} | {_stats([r.setup for r in runs])} "
            f"| {_stats([r.last for r in runs])} | {_stats(list(over))} | "
            f"{', '.join(map(str, again)) or '-'} |"
        )
    print()
    for variant, name in (("inproc", "In process"), ("inproc-preload", "With --preload")):
        done = [r for r in results.get(variant, []) if r.recovery is not None and r.setup]
        if not done:
            continue
        rec, setup = _med([r.recovery for r in done]), _med([r.setup for r in done])
        kept = _med([r.kept for r in done])
        assert rec is not None and setup is not None
        held = sum(1 for r in done if r.recovery is not None and r.recovery <= r.setup + GOAL)
        back = f"; the kept ranks were back in the function {kept:.2f} s after the fault"
        print(
            f"{name}: goal (recovery <= the replaced rank's set-up + {GOAL} s) "
            f"{'holds' if rec <= setup + GOAL else 'missed'}: {rec:.2f} s vs {setup:.2f} "
            f"+ {GOAL} s "
            f"(by medians; {held} of {len(done)} runs){back if kept is not None else ''}."
        )
    notes = [(v, r) for v, runs in results.items() for r in runs if r.note]
    if notes:
        print("\nRuns that did not end cleanly:")
        for variant, r in notes:
            print(f"- {variant}: {r.note}")
    raw = {v: [None if r.recovery is None else round(r.recovery, 3) for r in rs]
           for v, rs in results.items()}  # fmt: skip
    print(f"\nraw recovery (s): {raw}")


def plot(results: dict[str, list[Run]], path: str) -> None:
    """Stacked bars per variant: the fault to the replaced rank's new process, its set-up,
    the end of its set-up to every rank's first step (medians)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(names) + 1.2))
    parts = [("process started", "started", "#bbbbbb"), ("set-up", "setup", "#4c72b0"),
             ("to every first step", "last", "#dd8452")]  # fmt: skip
    right = 0.0
    for y, variant in enumerate(names):
        runs = results[variant]
        left = 0.0
        for label, attr, colour in parts:
            value = _med([getattr(r, attr) for r in runs]) or 0.0
            ax.barh(y, value, left=left, color=colour, label=label if y == 0 else None)
            left += value
        right = max(right, left)
        rec = _med([r.recovery for r in runs])
        ax.text(left + 0.1, y, f"{rec:.2f} s" if rec is not None else "did not recover",
                va="center", fontsize=8)  # fmt: skip
    labels = [("4: " if VARIANTS[v][1] == 1 else "2x2: ") + _label(v, results[v]) for v in names]
    ax.set_yticks(range(len(names)), [x.replace("`", "") for x in labels], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("seconds from the fault (medians)")
    ax.set_title("Fault to every rank's first step of the next attempt", fontsize=10)
    ax.set_xlim(0, right * 1.3)
    fig.legend(fontsize=8, loc="lower center", ncol=3, frameon=False)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=120)
    print(f"\nplot: {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per rallypoint run")
    parser.add_argument(
        "--torchrun-timeout", type=float, default=30.0, help="seconds a torchrun run may take"
    )
    parser.add_argument("--skip-torchrun", action="store_true")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=",".join(VARIANTS))
    parser.add_argument("--keep", type=Path, help="copy each run's files and logs here")
    parser.add_argument("--plot", help="write a PNG plot here")
    parser.add_argument(
        "--positions",
        type=int,
        metavar="N",
        help="instead: N ranks, the fault at each position in turn (restart_positions.py)",
    )
    args = parser.parse_args()
    if args.positions:
        restart_positions.measure(args.positions, args.repeat)
        return
    variants = [v for v in args.variants.split(",") if v in VARIANTS]
    if args.skip_torchrun:
        variants = [v for v in variants if "torchrun" not in v]
    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[Run]] = {v: [] for v in variants}
    for i in range(args.repeat):
        for variant in variants:
            timeout = args.torchrun_timeout if "torchrun" in variant else args.timeout
            r = run_once(variant, timeout, args.keep)
            results[variant].append(r)
            shown = f"{r.recovery:.2f} s" if r.recovery is not None else r.note
            print(f"  {i + 1}/{args.repeat} {variant:<15} {shown}", file=sys.stderr, flush=True)
    report(results, args)
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
