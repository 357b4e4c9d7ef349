"""Benchmark: launcher start to "every worker finished its first gloo all_reduce".

Compares, in one run on the same machine, ``rallypoint run``, torchrun
(``python -m torch.distributed.run --standalone``) and ``torch.multiprocessing.spawn`` for
N = 2, 4, 8, 16 workers, the recovery time after a worker dies (rallypoint and torchrun,
N = 4, ``--max-restarts 1``; torchrun gets a timeout because its restarted gloo workers can
hang), and, on a host with a GPU, N = 8 workers that each start CUDA first (rallypoint and
torchrun; skipped with the reason printed elsewhere).

The headline is rallypoint's time over one bare ``import torch`` in a new interpreter,
measured in the same run (with a GPU, also over one ``import torch`` that starts CUDA):
something must import torch once, and that floor is what a machine's cores and disk
decide, so the difference holds across machines where a ratio to torchrun does not
(torchrun's N separate imports queue for the CPU on 2 cores, much less on 16).

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
from collections.abc import Callable
from pathlib import Path

from ports import free_port

WORKER = """
import os, sys, time
import torch
import torch.distributed as dist
out = os.environ["BENCH_OUT"]
if os.environ.get("BENCH_CUDA") == "1":  # the CUDA case: each worker starts CUDA first
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
    torch.ones(1, device="cuda")
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


def _run(
    cmd: list[str], out: Path, n: int, timeout: float, die: bool = False, cuda: bool = False
) -> float | None:
    """Seconds from start to the last first-all_reduce stamp of attempt ``die`` (0 or 1)."""
    out.unlink(missing_ok=True)
    Path(f"{out}.death").unlink(missing_ok=True)
    env = dict(os.environ, BENCH_OUT=str(out), OMP_NUM_THREADS="1")
    if die:
        env["BENCH_DIE"] = "1"
    if cuda:
        env["BENCH_CUDA"] = "1"
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


def _floor(code: str, repeat: int) -> float:
    """Median seconds of ``python -c code`` in a new interpreter."""
    times = []
    for _ in range(max(3, repeat)):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _gpus() -> int:
    """GPUs CUDA sees, asked in a child (this process never starts CUDA)."""
    code = "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    return int(proc.stdout.strip() or 0) if proc.returncode == 0 else 0


def _launchers(worker: Path, driver: Path) -> dict[str, Callable[[int], list[str]]]:
    py = sys.executable
    return {
        "rallypoint": lambda n: [
            py, "-m", "rallypoint", "run", f"--nproc-per-node={n}", str(worker)
        ],
        "torchrun": lambda n: [
            py, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", str(worker)
        ],
        "mp.spawn": lambda n: [py, str(driver), str(n), str(free_port())],
    }  # fmt: skip


_Table = dict[str, dict[int, float | None]]


def _measure(
    launchers: dict[str, Callable[[int], list[str]]],
    sizes: list[int],
    args: argparse.Namespace,
    out: Path,
    cuda: bool = False,
) -> _Table:
    results: _Table = {name: {} for name in launchers}
    for n in sizes:
        for name, cmd in launchers.items():
            runs = [_run(cmd(n), out, n, args.timeout, cuda=cuda) for _ in range(args.repeat)]
            results[name][n] = _median(runs)
            case = "cuda " if cuda else ""
            print(f"  {case}N={n:<3} {name:<11} {_fmt(results[name][n], args.timeout)}",
                  file=sys.stderr)  # fmt: skip
    return results


def _recovery(worker: Path, out: Path, args: argparse.Namespace) -> dict[str, float | None]:
    py = sys.executable
    rcmd = {
        "rallypoint": [py, "-m", "rallypoint", "run", "--nproc-per-node=4", "--max-restarts=1"],
        "torchrun": [
            py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
            "--max-restarts=1",
        ],
    }  # fmt: skip
    recovery: dict[str, float | None] = {}
    for name, cmd in rcmd.items():
        runs = [
            _run([*cmd, str(worker)], out, 4, args.recovery_timeout, die=True)
            for _ in range(args.repeat)
        ]
        recovery[name] = _median(runs)
        print(f"  recovery {name:<11} {_fmt(recovery[name], args.recovery_timeout)}",
              file=sys.stderr)  # fmt: skip
    return recovery


def _over(value: float | None, floor: float) -> str:
    return f"{value - floor:+.2f}" if value is not None else "n/a"


def _headline(what: str, table: _Table, n: int, floor: float, floor_name: str) -> str:
    r, t = table["rallypoint"][n], table["torchrun"][n]
    if r is None:
        return f"{what}: rallypoint did not finish"
    torchrun = f"{t:.2f} s, {_ratio(t, r)}" if t is not None else "did not finish"
    return (
        f"{what}: rallypoint {r:.2f} s, {_over(r, floor)} s over one {floor_name} "
        f"({floor:.2f} s); torchrun {torchrun}"
    )


def _report(
    args: argparse.Namespace,
    sizes: list[int],
    floors: dict[str, float],
    results: _Table,
    cuda: _Table | None,
    recovery: dict[str, float | None],
) -> None:
    import torch

    import_torch = floors["import torch"]
    print(
        f"\nLaunch to every worker's first gloo all_reduce (median of {args.repeat}; "
        f"{os.cpu_count()} CPUs, torch {torch.__version__}, {time.strftime('%Y-%m-%d')})\n"
    )
    n = max(sizes)
    print(_headline(f"Headline, {n} workers", results, n, import_torch, "`import torch`"))
    if cuda is not None:
        m = max(cuda["rallypoint"])
        floor = floors["import torch + CUDA"]
        print(_headline(f"{m} workers that each start CUDA", cuda, m, floor,
                        "`import torch` that starts CUDA"))  # fmt: skip
    print("\n| N | rallypoint (s) | rallypoint - import torch (s) | torchrun (s) | mp.spawn (s) "
          "| torchrun / rallypoint | mp.spawn / rallypoint |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for n in sizes:
        r, t, s = results["rallypoint"][n], results["torchrun"][n], results["mp.spawn"][n]
        print(
            f"| {n} | {_fmt(r, args.timeout)} | {_over(r, import_torch)} | "
            f"{_fmt(t, args.timeout)} | {_fmt(s, args.timeout)} | {_ratio(t, r)} | "
            f"{_ratio(s, r)} |"
        )
    print(f"\nOne bare `import torch` (new interpreter): {import_torch:.2f} s")
    if cuda is None:
        print("\nWorkers that each start CUDA: skipped, no GPU (torch.cuda.device_count() == 0)")
    else:
        floor = floors["import torch + CUDA"]
        print(f"\nWorkers that each start CUDA first (cuda:LOCAL_RANK % GPUs); one `import "
              f"torch` that starts CUDA: {floor:.2f} s\n")  # fmt: skip
        print("| N | rallypoint (s) | rallypoint - import torch + CUDA (s) | torchrun (s) "
              "| torchrun / rallypoint |")  # fmt: skip
        print("|---|---|---|---|---|")
        for n, r in cuda["rallypoint"].items():
            t = cuda["torchrun"][n]
            print(f"| {n} | {_fmt(r, args.timeout)} | {_over(r, floor)} | "
                  f"{_fmt(t, args.timeout)} | {_ratio(t, r)} |")  # fmt: skip
    if recovery:
        print("\nRecovery at N = 4 (a rank dies right after its first all_reduce; until every "
              "rank has passed the first all_reduce of the restarted attempt)\n")  # fmt: skip
        print("| launcher | recovery (s) |")
        print("|---|---|")
        for name, value in recovery.items():
            print(f"| {name} | {_fmt(value, args.recovery_timeout)} |")
        ratio = _ratio(recovery.get("torchrun"), recovery.get("rallypoint"))
        print(f"\ntorchrun / rallypoint recovery: {ratio}")


def _plot(path: str, sizes: list[int], results: _Table, import_torch: float) -> None:
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
    fig.savefig(path, dpi=120)
    print(f"\nplot: {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="2,4,8,16", help="worker counts, comma separated")
    parser.add_argument("--cuda-sizes", default="8", help="worker counts of the CUDA case")
    parser.add_argument("--repeat", type=int, default=3, help="runs per cell (median)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per launch")
    parser.add_argument("--recovery-timeout", type=float, default=30.0)
    parser.add_argument("--skip-recovery", action="store_true")
    parser.add_argument("--plot", help="write a PNG plot here")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="rallypoint_bench_"))
    worker = tmp / "worker.py"
    worker.write_text(WORKER)
    driver = tmp / "spawn_driver.py"
    driver.write_text(SPAWN_DRIVER)
    out = tmp / "stamps.txt"

    floors = {"import torch": _floor("import torch", args.repeat)}
    launchers = _launchers(worker, driver)
    results = _measure(launchers, sizes, args, out)
    cuda = None
    if _gpus():
        floors["import torch + CUDA"] = _floor(
            "import torch; torch.ones(1, device='cuda')", args.repeat
        )
        two = {name: launchers[name] for name in ("rallypoint", "torchrun")}
        cuda_sizes = [int(s) for s in args.cuda_sizes.split(",")]
        cuda = _measure(two, cuda_sizes, args, out, cuda=True)
    else:
        print("CUDA case skipped: no GPU (torch.cuda.device_count() == 0)", file=sys.stderr)
    recovery = {} if args.skip_recovery else _recovery(worker, out, args)
    _report(args, sizes, floors, results, cuda, recovery)
    if args.plot:
        _plot(args.plot, sizes, results, floors["import torch"])


if __name__ == "__main__":
    main()
