"""Benchmark: launcher start to "every worker finished its first gloo all_reduce".

Compares, in one run on the same machine, ``rallypoint run``, torchrun
(``python -m torch.distributed.run --standalone``) and ``torch.multiprocessing.spawn`` for
N = 2, 4, 8, 16 workers, the recovery time after a worker dies (rallypoint and torchrun,
N = 4, ``--max-restarts 1``; torchrun gets a timeout because its restarted gloo workers can
hang), and one bare ``import torch`` (the floor: something must import torch once).

    .venv/bin/python benchmarks/launch.py                 # full run
    .venv/bin/python benchmarks/launch.py --sizes 2,4 --repeat 1 --plot launch.png

Every worker appends ``attempt rank unix_time`` to a file right after its first all_reduce;
a launch's time is the last of those stamps minus the moment the launcher was started.
Recovery is the last stamp of attempt 1 minus the stamp the dying rank wrote before dying.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORKER = """
import os, sys, time
import torch
import torch.distributed as dist
out = os.environ["BENCH_OUT"]
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
rank = dist.get_rank()
with open(out, "a") as fp:
    fp.write(f"{attempt} {rank} {time.time()!r}\\n")
if os.environ.get("BENCH_DIE") == "1" and attempt == "0" and rank == 1:
    with open(out + ".death", "w") as fp:
        fp.write(repr(time.time()))
    os._exit(1)
dist.barrier()
dist.destroy_process_group()
"""

SPAWN_DRIVER = """
import os, sys, time
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

def work(rank, world, out):
    dist.init_process_group("gloo", rank=rank, world_size=world)
    t = torch.ones(1)
    dist.all_reduce(t)
    with open(out, "a") as fp:
        fp.write(f"0 {rank} {time.time()!r}\\n")
    dist.barrier()
    dist.destroy_process_group()

if __name__ == "__main__":
    world = int(sys.argv[1])
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = sys.argv[2]
    mp.spawn(work, args=(world, os.environ["BENCH_OUT"]), nprocs=world)
"""


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _run(cmd: list[str], out: Path, n: int, timeout: float, die: bool = False) -> float | None:
    """Seconds from start to the last first-all_reduce stamp of attempt ``die`` (0 or 1)."""
    out.unlink(missing_ok=True)
    Path(f"{out}.death").unlink(missing_ok=True)
    env = dict(os.environ, BENCH_OUT=str(out), OMP_NUM_THREADS="1")
    if die:
        env["BENCH_DIE"] = "1"
    start = time.time()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_tree(proc.pid)
        proc.wait()
    want = "1" if die else "0"
    stamps = []
    if out.exists():
        for line in out.read_text().splitlines():
            attempt, _rank, stamp = line.split()
            if attempt == want:
                stamps.append(float(stamp))
    if len(stamps) < n:
        return None
    if die:
        return max(stamps) - float(Path(f"{out}.death").read_text())
    return max(stamps) - start


def _kill_tree(pid: int) -> None:
    import psutil

    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.kill()


def _median(values: list[float | None]) -> float | None:
    ok = [v for v in values if v is not None]
    return statistics.median(ok) if len(ok) == len(values) and ok else None


def _fmt(value: float | None, timeout: float) -> str:
    return f"{value:.2f}" if value is not None else f"hang (>{timeout:.0f} s)"


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.1f}x" if a is not None and b is not None and b > 0 else "n/a"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="2,4,8,16", help="worker counts, comma separated")
    parser.add_argument("--repeat", type=int, default=3, help="runs per cell (median)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per launch")
    parser.add_argument("--recovery-timeout", type=float, default=30.0)
    parser.add_argument("--skip-recovery", action="store_true")
    parser.add_argument("--plot", help="write a PNG plot here")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    py = sys.executable
    tmp = Path(tempfile.mkdtemp(prefix="rallypoint_bench_"))
    worker = tmp / "worker.py"
    worker.write_text(WORKER)
    driver = tmp / "spawn_driver.py"
    driver.write_text(SPAWN_DRIVER)
    out = tmp / "stamps.txt"

    imports = []
    for _ in range(max(3, args.repeat)):
        t0 = time.perf_counter()
        subprocess.run([py, "-c", "import torch"], check=True)
        imports.append(time.perf_counter() - t0)
    import_torch = statistics.median(imports)

    launchers = {
        "rallypoint": lambda n: [
            py, "-m", "rallypoint", "run", f"--nproc-per-node={n}", str(worker)
        ],
        "torchrun": lambda n: [
            py, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", str(worker)
        ],
        "mp.spawn": lambda n: [py, str(driver), str(n), str(_free_port())],
    }  # fmt: skip
    results: dict[str, dict[int, float | None]] = {name: {} for name in launchers}
    for n in sizes:
        for name, cmd in launchers.items():
            runs = [_run(cmd(n), out, n, args.timeout) for _ in range(args.repeat)]
            results[name][n] = _median(runs)
            print(f"  N={n:<3} {name:<11} {_fmt(results[name][n], args.timeout)}", file=sys.stderr)

    recovery: dict[str, float | None] = {}
    if not args.skip_recovery:
        rcmd = {
            "rallypoint": [py, "-m", "rallypoint", "run", "--nproc-per-node=4", "--max-restarts=1"],
            "torchrun": [
                py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
                "--max-restarts=1",
            ],
        }  # fmt: skip
        for name, cmd in rcmd.items():
            runs = [
                _run([*cmd, str(worker)], out, 4, args.recovery_timeout, die=True)
                for _ in range(args.repeat)
            ]
            recovery[name] = _median(runs)
            print(
                f"  recovery {name:<11} {_fmt(recovery[name], args.recovery_timeout)}",
                file=sys.stderr,
            )

    import torch

    print(
        f"\nLaunch to every worker's first gloo all_reduce (median of {args.repeat}; "
        f"{os.cpu_count()} CPUs, torch {torch.__version__}, {time.strftime('%Y-%m-%d')})\n"
    )
    print(f"One bare `import torch` (new interpreter): {import_torch:.2f} s\n")
    print("| N | rallypoint (s) | torchrun (s) | mp.spawn (s) | torchrun / rallypoint "
          "| mp.spawn / rallypoint | rallypoint - import torch (s) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for n in sizes:
        r, t, s = results["rallypoint"][n], results["torchrun"][n], results["mp.spawn"][n]
        over = f"{r - import_torch:+.2f}" if r is not None else "n/a"
        print(
            f"| {n} | {_fmt(r, args.timeout)} | {_fmt(t, args.timeout)} | "
            f"{_fmt(s, args.timeout)} | {_ratio(t, r)} | {_ratio(s, r)} | {over} |"
        )
    if recovery:
        print("\nRecovery at N = 4 (a rank dies right after its first all_reduce; until every "
              "rank has passed the first all_reduce of the restarted attempt)\n")  # fmt: skip
        print("| launcher | recovery (s) |")
        print("|---|---|")
        for name, value in recovery.items():
            print(f"| {name} | {_fmt(value, args.recovery_timeout)} |")
        ratio = _ratio(recovery.get("torchrun"), recovery.get("rallypoint"))
        print(f"\ntorchrun / rallypoint recovery: {ratio}")

    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for name, series in results.items():
            xs = [n for n in sizes if series[n] is not None]
            ax.plot(xs, [series[n] for n in xs], marker="o", label=name)
        ax.axhline(import_torch, color="grey", linestyle="--", label="one import torch")
        ax.set_xlabel("workers (N)")
        ax.set_ylabel("seconds to first all_reduce")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(n) for n in sizes])
        ax.set_title(f"Launch time, {os.cpu_count()} CPUs")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"\nplot: {args.plot}")


if __name__ == "__main__":
    main()
