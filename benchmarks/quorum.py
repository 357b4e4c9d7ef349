"""Benchmark: per-step quorum, ``rallypoint.ft`` against torchft, in one run.

Three replica groups of one rank each, gloo, a small MLP at about 0.15 s a step (a sleep),
the same program written against torchft's public API (``Manager``,
``DistributedDataParallel``, ``Optimizer``, ``ProcessGroupGloo``), with only its import
changed for rallypoint. Group 1's first process SIGKILLs itself once it has committed step
20. The stacks, alternated by repeat:

- torchft, defaults: ``torchft_lighthouse --min_replicas 1`` and ``torchrun`` per group;
- torchft, ``--heartbeat_timeout_ms 1000``;
- rallypoint, defaults: ``rallypoint lighthouse --min_replicas 1`` and ``rallypoint run``.

For each: the healthy groups' longest pause between two commits after the fault (seconds,
and in steps of their median time), the failed group's return (the fault to its first
commit after it), the step it resumed at against the peers', and whether the three end
with the same parameters. Then the heal's bandwidth for a 100 MB state, each transport in
one process over loopback: torchft's HTTPTransport against rallypoint's authenticated
stream. Without torchft installed it measures rallypoint alone and says so.

    python benchmarks/quorum.py [--repeat N] [--state-mb 100]
    python benchmarks/quorum.py --steady --rounds 2000 [--cpu]   # the median step, no fault
    python benchmarks/quorum.py --scale 64        # rounds per second at 64 members
    python benchmarks/quorum.py --scale 4 --store etcd   # the lighthouse over etcd
    python benchmarks/quorum.py --diloco          # a DiLoCo sync, a fault (quorum_diloco.py)
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

from ports import free_port

FAULT, STEPS = 20, 60

WORKER = """
import importlib, os, signal, sys, time
from datetime import timedelta
import torch

torchft = importlib.import_module(os.environ["FT_IMPL"])
OUT, STEPS, FAULT = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
GROUP = int(os.environ["REPLICA_GROUP_ID"])
FIRST = not os.path.exists(f"{OUT}/started-{GROUP}")
open(f"{OUT}/started-{GROUP}", "a").close()
torch.manual_seed(GROUP)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
inner = torch.optim.Adam(model.parameters(), lr=1e-3)


def load_state_dict(sd):
    model.load_state_dict(sd["model"])
    inner.load_state_dict(sd["optim"])


manager = torchft.Manager(
    pg=torchft.ProcessGroupGloo(timeout=timedelta(seconds=10)), min_replica_size=1,
    load_state_dict=load_state_dict,
    state_dict=lambda: {"model": model.state_dict(), "optim": inner.state_dict()},
    replica_id=str(GROUP), timeout=timedelta(seconds=10),
)
ddp = torchft.DistributedDataParallel(manager, model)
opt = torchft.Optimizer(manager, inner)
with open(f"{OUT}/steps-{GROUP}", "a", buffering=1) as log:
    while manager.current_step() < STEPS:
        step = manager.current_step()
        g = torch.Generator().manual_seed(1000 * step + GROUP)
        opt.zero_grad()
        ddp(torch.randn(8, 16, generator=g)).pow(2).mean().backward()
        opt.step()
        if manager.current_step() > step:
            log.write(f"{time.time()!r} {manager.current_step()}\\n")
        if FIRST and GROUP == 1 and manager.current_step() >= FAULT:
            log.write(f"{time.time()!r} fault\\n")
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.15)
torch.save({k: v.clone() for k, v in model.state_dict().items()}, f"{OUT}/final-{GROUP}.pt")
manager.shutdown()
"""

STACKS = {
    "torchft, defaults": ("torchft", []),
    "torchft, --heartbeat_timeout_ms 1000": ("torchft", ["--heartbeat_timeout_ms", "1000"]),
    "rallypoint.ft, defaults": ("rallypoint", []),
}


def _lighthouse(kind: str, port: int, flags: list[str]) -> subprocess.Popen[bytes]:
    if kind == "torchft":
        cmd = [str(Path(sys.executable).with_name("torchft_lighthouse"))]
    else:
        cmd = [sys.executable, "-m", "rallypoint", "lighthouse"]
    least = [] if "--min_replicas" in flags else ["--min_replicas", "1"]  # torchft's: once
    cmd += [*least, "--bind", f"[::]:{port}", *flags]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _group(
    kind: str, group: int, port: int, script: Path, out: Path, args: tuple[int, ...] = ()
) -> subprocess.Popen[bytes]:
    """One replica group of one rank under its stack's launcher; ``args`` after ``out``
    (this worker's steps and fault step by default)."""
    env = dict(os.environ, REPLICA_GROUP_ID=str(group), OMP_NUM_THREADS="1",
               TORCHFT_LIGHTHOUSE=f"http://localhost:{port}",
               FT_IMPL="torchft" if kind == "torchft" else "rallypoint.ft")  # fmt: skip
    if kind == "torchft":
        head = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    else:
        head = [sys.executable, "-m", "rallypoint", "run"]
    cmd = [*head, "--nproc-per-node", "1", "--max-restarts", "3", str(script), str(out),
           *map(str, args or (STEPS, FAULT))]  # fmt: skip
    log = open(out / f"group-{group}.log", "wb")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip


def _rows(out: Path, group: int) -> tuple[list[tuple[float, int]], float | None]:
    rows, fault = [], None
    path = out / f"steps-{group}"
    for line in path.read_text().splitlines() if path.exists() else []:
        t, what = line.split()
        if what == "fault":
            fault = float(t)
        else:
            rows.append((float(t), int(what)))
    return rows, fault


def run_once(name: str, timeout: float) -> dict[str, object]:
    kind, flags = STACKS[name]
    out = Path(tempfile.mkdtemp(prefix="rp-quorum-"))
    script = out / "worker.py"
    script.write_text(WORKER)
    port = free_port()
    house = _lighthouse(kind, port, flags)
    time.sleep(1.0)
    groups = [_group(kind, g, port, script, out) for g in range(3)]
    deadline = time.monotonic() + timeout
    try:
        for p in groups:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in [*groups, house]:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL) if p is not house else p.kill()
                p.wait()
    result = _measure(out, [p.returncode for p in groups])
    shutil.rmtree(out, ignore_errors=True)
    return result


def _measure(out: Path, codes: list[int | None]) -> dict[str, object]:
    import torch

    rows1, fault = _rows(out, 1)
    result: dict[str, object] = {"exits": codes}
    if fault is None:
        return {**result, "note": "the fault never came"}
    pauses, medians = [], []
    for g in (0, 2):
        rows, _ = _rows(out, g)
        gaps = [b[0] - a[0] for a, b in itertools.pairwise(rows) if b[0] > fault - 1.0]
        every = [b[0] - a[0] for a, b in itertools.pairwise(rows)]
        pauses.append(max(gaps, default=float("nan")))
        medians.append(statistics.median(every) if every else float("nan"))
    after = [(t, s) for t, s in rows1 if t > fault]
    peers = [s for t, s in _rows(out, 0)[0] if after and t <= after[0][0]]
    result.update(
        pause=max(pauses), steps=max(pauses) / statistics.median(medians),
        back=(after[0][0] - fault) if after else None,
        resumed=after[0][1] if after else None, peers=peers[-1] if peers else None,
    )  # fmt: skip
    finals = [out / f"final-{g}.pt" for g in range(3)]
    if all(f.exists() for f in finals):
        states = [torch.load(f) for f in finals]
        result["same"] = all(torch.equal(states[0][k], s[k]) for s in states[1:] for k in states[0])
    return result


def heal_bandwidth(mb: int) -> dict[str, float]:
    """Seconds to move a ``mb`` MB state to a receiver, per transport (one process)."""
    import torch

    from rallypoint.ft._heal import HealServer, fetch_state

    state = {"model": {"w": torch.rand(mb * (1 << 20) // 4)}}
    out: dict[str, float] = {}
    server = HealServer(b"benchmark", host="127.0.0.1")
    server.allow(1, state)
    t0 = time.perf_counter()
    got, _ = fetch_state(f"127.0.0.1:{server.port}", b"benchmark", 1, 60.0)
    out["rallypoint"] = time.perf_counter() - t0
    assert torch.equal(got["model"]["w"], state["model"]["w"])
    server.close()
    if importlib.util.find_spec("torchft") is not None:
        from torchft.checkpointing.http_transport import HTTPTransport

        sender = HTTPTransport(timeout=timedelta(seconds=60), num_chunks=0)
        receiver = HTTPTransport(timeout=timedelta(seconds=60), num_chunks=0)
        t0 = time.perf_counter()
        sender.send_checkpoint([1], 1, state, timedelta(seconds=60))
        got = receiver.recv_checkpoint(0, sender.metadata(), 1, timedelta(seconds=60))
        out["torchft"] = time.perf_counter() - t0
        sender.shutdown()
        receiver.shutdown()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--state-mb", type=int, default=100)
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--steady", action="store_true", help="the median step, no fault")
    parser.add_argument("--cpu", action="store_true", help="--steady: the CPU a step, by part")
    parser.add_argument("--scale", type=int, metavar="G", help="G members' rounds per second")
    parser.add_argument("--store", choices=["etcd"], help="--scale: the lighthouse over etcd")
    parser.add_argument("--rounds", type=int, default=200, help="--scale rounds, --steady steps")
    parser.add_argument("--growth", type=int, metavar="R", help="keys and RSS over R rounds")
    parser.add_argument("--diloco", action="store_true", help="a DiLoCo sync, and a fault")
    args = parser.parse_args()
    if args.diloco:
        from quorum_diloco import diloco

        diloco(args.repeat, args.state_mb)
        return
    if args.steady or args.scale or args.growth:
        from quorum_modes import growth, scale, steady

        print(f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}")
        if args.steady:  # stacks interleaved, each run's median step; then their median
            cpus: list[dict[str, dict[str, float]]] = [{} for _ in range(args.repeat)]
            runs = [steady(args.rounds, cpus[r] if args.cpu else None) for r in range(args.repeat)]
            for name in runs[0]:
                each = [1000 * run[name] for run in runs]
                print(f"| {name} | {statistics.median(each):.1f} ms | "
                      f"{', '.join(f'{v:.1f}' for v in each)} |")  # fmt: skip
            for name in cpus[0] if args.cpu else []:  # each part's median over the runs
                parts = sorted({part for c in cpus for part in c[name]})
                print(f"{name}, CPU ms a step: " + ", ".join(
                    f"{part} {statistics.median(c[name].get(part, 0.0) for c in cpus):.2f}"
                    for part in parts))  # fmt: skip
        if args.scale:  # repeats alternate which stack runs first; each run's ratio
            ratios = []
            for r in range(args.repeat):
                rows = scale(args.scale, args.rounds, args.store or "", second_first=r % 2 == 1)
                for name, row in rows.items():
                    print(f"| {args.scale} | {name} | {row['rounds/s']:.1f} rounds/s | "
                          f"{row['median wait ms']:.1f} ms |", flush=True)  # fmt: skip
                first, second = (row["rounds/s"] for row in rows.values())
                ratios.append(second / first)
            each = ", ".join(f"{x:.2f}x" for x in ratios)
            print(f"{' / '.join(list(rows)[::-1])}, each run: {each} "
                  f"(median {statistics.median(ratios):.2f}x)")  # fmt: skip
        if args.growth:
            for name, value in growth(args.growth).items():
                print(f"| {name} | {value:.1f} |")
        return
    names = list(STACKS)
    if importlib.util.find_spec("torchft") is None:
        print("torchft is not installed (pip install torchft==0.2.0): rallypoint alone")
        names = [n for n in names if n.startswith("rallypoint")]
    results: dict[str, list[dict[str, object]]] = {n: [] for n in names}
    for r in range(args.repeat):
        for name in names if r % 2 == 0 else names[::-1]:
            results[name].append(run_once(name, args.timeout))
            print(f"  {name}: {results[name][-1]}", file=sys.stderr, flush=True)
    print(f"\n{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; 3 groups x 1 rank, gloo, "
          f"a step ~0.15 s; group 1 killed after step {FAULT}\n")  # fmt: skip
    print("| stack | healthy groups' longest pause | failed group back | resumed at (peers') "
          "| same parameters | runs |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- |")
    for name, runs in results.items():
        ok = [r for r in runs if "pause" in r]
        if not ok:
            print(f"| {name} | {runs[0].get('note', 'failed')} | - | - | - | 0 of {len(runs)} |")
            continue
        pause = statistics.median(float(r["pause"]) for r in ok)  # type: ignore[arg-type]
        steps = statistics.median(float(r["steps"]) for r in ok)  # type: ignore[arg-type]
        backs = [float(r["back"]) for r in ok if r.get("back") is not None]  # type: ignore[arg-type]
        back = f"{statistics.median(backs):.2f} s" if backs else "never"
        last = ok[-1]
        same = all(r.get("same") for r in ok)
        print(f"| {name} | {pause:.2f} s ({steps:.1f} steps) | {back} | "
              f"{last.get('resumed')} ({last.get('peers')}) | {'yes' if same else 'no'} | "
              f"{len(ok)} of {len(runs)} |")  # fmt: skip
    heal = heal_bandwidth(args.state_mb)
    print(f"\nheal of a {args.state_mb} MB state over loopback: " + ", ".join(
        f"{k} {v:.2f} s ({args.state_mb / v:.0f} MB/s)" for k, v in heal.items()))  # fmt: skip


if __name__ == "__main__":
    main()
