"""Benchmark rallypoint's RPC backend against torch's TensorPipe, through one API.

Both backends run in the same invocation on the same machine, each in fresh forked
processes (torch's RPC state is global per process):

- round trip of a no-op ``rpc_sync`` (median, microseconds)
- round trip of an ``rpc_sync`` that echoes one 32x64 float tensor (8 KiB, sent inline)
- ``rpc_async`` throughput with 5,000 calls outstanding (calls per second)
- tensor echo bandwidth for 1 MiB and 64 MiB (payload bytes / round-trip time)
- each of these four: the median of 5 runs that alternate the order of the backends
- ``init_rpc`` and ``shutdown`` wall time for 2, 4 and 8 workers (slowest worker, median
  of 3 runs)
- the machine's floor for one dependent hop, with no RPC at all: the median round trip of
  a 24-byte ping-pong between two processes over a Unix socket pair (printed under the
  table; every cross-process hop of the training step pays at least half of it; on a VM
  it depends on whether the scheduler puts the two processes on one vCPU)
- what waking up costs the work that follows, with no RPC: the median time of one stage's
  forward and backward (``Linear(64, 64)`` + ReLU, batch 32) in a loop that never sleeps,
  and in one that sleeps 200 µs before each iteration (every hop of the training step
  starts in a process that was asleep; printed under the table too)
- a chain with no RPC: a message handed around three processes, each running that
  stage's forward and backward before passing it on, every hop waiting by blocking or by
  yielding busy-polls of up to 1 ms (what a rallypoint agent's thread does while the
  rest of its process waits too; printed under the table)
- one training step with distributed autograd of a two-stage model-parallel model:
  stage 1 (``Linear(64, 64)`` + ReLU) on worker1 and stage 2 on worker2, both created with
  ``remote``, driven by worker0 with ``rpc_sync`` (batch 32); forward, ``dist_autograd``
  backward and a ``DistributedOptimizer`` (SGD) step, in one context. Both backends' groups
  run at once and take turns, epoch by epoch (``benchmarks/rpc_step.py``: 20 epochs of 150
  steps): the row is the median over epochs of each epoch's median step, and the ratio of
  the epochs paired in time is printed under the table (on the shared 2-vCPU VM one run
  of either backend could be 1.5x slower than the next). A second row gives the CPU time
  the three processes spent per step (all threads).
- with a GPU (``--only cuda``, and in a full run; otherwise the run says why they are
  skipped): two processes sharing cuda:0, worker0 mapping ``{0: 0}`` to worker1, each the
  median of 5 runs that alternate the order of the backends: the round trip of an
  ``rpc_sync`` echoing a 32x64 CUDA tensor, a 64 MiB CUDA echo (ms, both ends
  synchronized), and a distributed-autograd step (a CUDA input that requires grad sent to
  a ``Linear(1024, 1024)`` held by worker1, ``dist_autograd`` backward, whose gradient goes
  back to worker0's GPU, and a ``DistributedOptimizer`` step)

Usage: ``python benchmarks/rpc.py [--quick] [--only calls|throughput|lifecycle|autograd|cuda]
[--plot rpc.png]``. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

import rpc_step
import torch
from rpc_step import Stage

from rallypoint import rpc
from rallypoint.testing import run_workers

BACKENDS = ("RALLYPOINT", "TENSORPIPE")


def _noop() -> None:
    return None


def _echo(x: torch.Tensor) -> torch.Tensor:
    return x


def _options(backend: str) -> Any:
    return rpc.construct_rpc_backend_options(rpc.BackendType[backend], rpc_timeout=120)


def _init(backend: str, world_size: int) -> int:
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    rpc.init_rpc(
        f"worker{rank}",
        backend=rpc.BackendType[backend],
        rank=rank,
        world_size=world_size,
        rpc_backend_options=_options(backend),
    )
    return rank


def _pair(backend: str, quick: bool, only: str = "all") -> dict[str, float]:
    rank = _init(backend, 2)
    out: dict[str, float] = {}
    if rank == 0:
        peer = "worker1"
        n = 300 if quick else 3000
        for _ in range(100):
            rpc.rpc_sync(peer, _noop)
        samples = []
        for _ in range(n if only in ("all", "calls") else 0):
            t0 = time.perf_counter()
            rpc.rpc_sync(peer, _noop)
            samples.append(time.perf_counter() - t0)
        out["rtt_us"] = statistics.median(samples) * 1e6 if samples else float("nan")
        small = torch.randn(32, 64)  # a batch of activations: 8 KiB, inline
        samples = []
        for i in range(-100, n if only in ("all", "calls") else 0):
            t0 = time.perf_counter()
            rpc.rpc_sync(peer, _echo, args=(small,))
            if i >= 0:
                samples.append(time.perf_counter() - t0)
        out["rtt_tensor_us"] = statistics.median(samples) * 1e6 if samples else float("nan")

        outstanding = 5000
        rounds = 2 if quick else 5
        rates = []
        for _ in range(rounds + 1):
            t0 = time.perf_counter()
            futs = [rpc.rpc_async(peer, _noop) for _ in range(outstanding)]
            torch.futures.wait_all(futs)
            rates.append(outstanding / (time.perf_counter() - t0))
        out["async_calls_per_s"] = statistics.median(rates[1:])

        every = only in ("all", "calls")
        sizes = (("1MiB", 1 << 20, 50), ("64MiB", 64 << 20, 10)) if every else ()
        for label, nbytes, reps in sizes:
            reps = max(3, reps // (5 if quick else 1))
            x = torch.ones(nbytes // 4)
            rpc.rpc_sync(peer, _echo, args=(x,))
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                y = rpc.rpc_sync(peer, _echo, args=(x,))
                times.append(time.perf_counter() - t0)
                del y
            out[f"echo_{label}_GBps"] = nbytes / statistics.median(times) / 1e9
    rpc.shutdown()
    return out


def _lifecycle(backend: str, world_size: int) -> tuple[float, float]:
    rank = int(os.environ["RANK"])
    t0 = time.perf_counter()
    rpc.init_rpc(
        f"worker{rank}",
        backend=rpc.BackendType[backend],
        rank=rank,
        world_size=world_size,
        rpc_backend_options=_options(backend),
    )
    t1 = time.perf_counter()
    rpc.shutdown()
    return t1 - t0, time.perf_counter() - t1


def _autograd(quick: bool) -> dict[str, tuple[float, float]]:
    """Median step time and CPU per step (µs) per backend, both groups running at once in
    paired epochs (:mod:`rpc_step`); the paired ratio is kept for the printout."""
    summary = rpc_step.summary(rpc_step.paired_epochs(6 if quick else 20, 100 if quick else 150))
    PAIRED.update(summary)
    return {
        "RALLYPOINT": (summary["rallypoint_step_us"], summary["rallypoint_cpu_us"]),
        "TENSORPIPE": (summary["tensorpipe_step_us"], summary["tensorpipe_cpu_us"]),
    }


PAIRED: dict[str, float] = {}


def socket_floor_us(rounds: int = 3000) -> float:
    """Median round trip (µs) of a raw ping-pong between two processes: no RPC, no torch."""
    ours, theirs = socket.socketpair()
    pid = os.fork()
    if pid == 0:  # the echoing process
        ours.close()
        try:
            while data := theirs.recv(64):
                theirs.sendall(data)
        finally:
            os._exit(0)
    theirs.close()
    times = []
    for _ in range(rounds + 200):
        t0 = time.perf_counter()
        ours.sendall(b"x" * 24)
        ours.recv(64)
        times.append(time.perf_counter() - t0)
    ours.close()
    os.waitpid(pid, 0)
    return statistics.median(times[200:]) * 1e6


def wake_penalty_us(rounds: int = 2000, pause: float = 0.0002) -> tuple[float, float]:
    """Median µs of one stage's forward and backward, in a loop that never sleeps and in
    one that sleeps ``pause`` seconds before each iteration (no RPC, one process)."""
    torch.set_num_threads(1)
    stage, x = Stage(64), torch.randn(32, 64)

    def run(sleep: float) -> float:
        times = []
        for _ in range(rounds):
            if sleep:
                time.sleep(sleep)
            t0 = time.perf_counter()
            stage(x).sum().backward()
            times.append(time.perf_counter() - t0)
        return statistics.median(times[100:]) * 1e6

    return run(0.0), run(pause)


def _chain_wait(sock: socket.socket, poller: Any, spin_s: float) -> bytes:
    """Read one byte, after yielding busy-polls for up to ``spin_s`` (0: block at once)."""
    if spin_s:
        until = time.perf_counter() + spin_s
        while not poller.poll(0) and time.perf_counter() < until:
            os.sched_yield()
    return sock.recv(1)


def chain_round_us(spin_s: float, rounds: int = 2000) -> float:
    """Median µs of one round of a message handed along a ring of three processes, each
    running one stage's forward and backward before passing it on (no RPC): every hop
    waits by blocking, or by yielding busy-polls of up to ``spin_s`` first."""
    import select

    torch.set_num_threads(1)
    stage, x = Stage(64), torch.randn(32, 64)
    ring = [socket.socketpair() for _ in range(3)]  # ring[i][1] -> ring[i][0]: into i
    kids = []
    for me in (1, 2):
        pid = os.fork()
        if pid == 0:  # a stage: wait, work, pass on
            try:
                inbox, out = ring[me][0], ring[(me + 1) % 3][1]
                poller = select.poll()
                poller.register(inbox, select.POLLIN)
                while _chain_wait(inbox, poller, spin_s) == b"x":
                    stage(x).sum().backward()
                    out.send(b"x")
                out.send(b"q")
            finally:
                os._exit(0)
        kids.append(pid)
    inbox, out = ring[0][0], ring[1][1]
    poller = select.poll()
    poller.register(inbox, select.POLLIN)
    times = []
    for _ in range(rounds + 100):
        t0 = time.perf_counter()
        stage(x).sum().backward()
        out.send(b"x")
        _chain_wait(inbox, poller, spin_s)
        times.append(time.perf_counter() - t0)
    out.send(b"q")
    _chain_wait(inbox, poller, 0.0)
    for pid in kids:
        os.waitpid(pid, 0)
    for a, b in ring:
        a.close()
        b.close()
    return statistics.median(times[100:]) * 1e6


def gpu_count() -> int:
    """GPUs a worker sees, asked of a child process: this one forks the workers, and a
    process that initialised CUDA cannot fork workers that use it."""
    if torch.version.cuda is None:
        return 0
    probe = "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    return int(done.stdout.strip() or 0) if done.returncode == 0 else 0


class _CudaStage(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(1024, 1024).cuda(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x))


def _cuda_forward(stage: Any, x: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = stage.local_value()(x)
    return out


def _cuda_params(stage: Any) -> list[Any]:
    return [rpc.RRef(p) for p in stage.local_value().parameters()]


def _median_us(fn: Any, n: int, warmup: int = 20) -> float:
    times = []
    for i in range(-warmup, n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        if i >= 0:
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def _cuda_pair(backend: str, quick: bool) -> dict[str, float]:
    rank = int(os.environ["RANK"])
    kind = rpc.BackendType[backend]
    options = _options(backend)
    if rank == 0:
        options.set_device_map("worker1", {0: 0})
    torch.cuda.set_device(0)
    rpc.init_rpc(
        f"worker{rank}", backend=kind, rank=rank, world_size=2, rpc_backend_options=options
    )
    out: dict[str, float] = {}
    if rank == 0:
        from rallypoint.rpc import DistributedOptimizer, dist_autograd

        n = 200 if quick else 2000
        small = torch.randn(32, 64, device="cuda:0")
        out["cuda_rtt_us"] = _median_us(lambda: rpc.rpc_sync("worker1", _echo, args=(small,)), n)
        big = torch.rand(16 << 20, device="cuda:0")  # 64 MiB
        rounds = 5 if quick else 30
        echo = _median_us(lambda: rpc.rpc_sync("worker1", _echo, args=(big,)), rounds, 3)
        out["cuda_echo_64MiB_ms"] = echo / 1e3
        stage = rpc.remote("worker1", _CudaStage)
        params = rpc.rpc_sync("worker1", _cuda_params, args=(stage,))
        opt = DistributedOptimizer(torch.optim.SGD, params, lr=1e-3)
        x = torch.randn(32, 1024, device="cuda:0", requires_grad=True)

        def step() -> None:
            with dist_autograd.context() as cid:
                y = rpc.rpc_sync("worker1", _cuda_forward, args=(stage, x))
                dist_autograd.backward(cid, [y.sum()])
                opt.step(cid)

        out["cuda_autograd_step_us"] = _median_us(step, n // 4)
    rpc.shutdown()
    return out


def _cuda(quick: bool) -> dict[str, dict[str, float]]:
    """The CUDA cases: the median of runs that alternate the order of the backends."""
    runs: dict[str, list[dict[str, float]]] = {b: [] for b in BACKENDS}
    for r in range(1 if quick else 5):
        for backend in BACKENDS if r % 2 == 0 else BACKENDS[::-1]:
            run = run_workers(_cuda_pair, 2, backend, quick, timeout=600, env=_env)
            runs[backend].append(run[0])
    return {
        b: {key: statistics.median(run[key] for run in v) for key in v[0]} for b, v in runs.items()
    }


def _pairs(quick: bool, only: str) -> dict[str, dict[str, float]]:
    """Each call metric: the median of runs that alternate the order of the backends (one
    run of TensorPipe's round trip ranged from 122 to 340 µs on the same idle machine)."""
    runs: dict[str, list[dict[str, float]]] = {b: [] for b in BACKENDS}
    for r in range(1 if quick else 5):
        for backend in BACKENDS if r % 2 == 0 else BACKENDS[::-1]:
            runs[backend].append(
                run_workers(_pair, 2, backend, quick, only, timeout=600, env=_env)[0]
            )
    return {
        b: {key: statistics.median(run[key] for run in v) for key in v[0]} for b, v in runs.items()
    }


def _env(rank: int) -> dict[str, str]:
    return {"RALLYPOINT_RPC_SECRET": "benchmark-secret"}


def measure(quick: bool, only: str = "all") -> dict[str, dict[str, float]]:
    results: dict[str, dict[str, float]] = {b: {} for b in BACKENDS}
    if only in ("all", "cuda"):
        gpus = gpu_count()
        if gpus:
            for backend, res in _cuda(quick).items():
                results[backend].update(res)
        else:
            print("CUDA cases skipped: no GPU (torch sees none in a worker process)\n")
    if only in ("all", "autograd"):
        for backend, (step, cpu) in _autograd(quick).items():
            results[backend]["autograd_step_us"] = step
            results[backend]["autograd_cpu_us"] = cpu
    if only in ("all", "calls", "throughput"):
        for backend, res in _pairs(quick, only).items():
            results[backend].update(res)
    for backend in BACKENDS if only not in ("autograd", "cuda") else ():
        res = {}
        for ws in (2, 4, 8) if only in ("all", "lifecycle") else ():
            # slowest worker of each run, median of runs (one run is at the mercy of noise)
            runs = [
                run_workers(_lifecycle, ws, backend, ws, timeout=300, env=_env)
                for _ in range(1 if quick else 3)
            ]
            res[f"init_{ws}_s"] = statistics.median(max(t[0] for t in ts) for ts in runs)
            res[f"shutdown_{ws}_s"] = statistics.median(max(t[1] for t in ts) for ts in runs)
        results[backend].update(res)
    return results


ROWS = [
    ("no-op rpc_sync round trip (µs)", "rtt_us", False),
    ("rpc_sync round trip of a 32x64 tensor, echoed (µs)", "rtt_tensor_us", False),
    ("rpc_async throughput, 5,000 outstanding (calls/s)", "async_calls_per_s", True),
    ("1 MiB echo (GB/s, payload / round trip)", "echo_1MiB_GBps", True),
    ("64 MiB echo (GB/s, payload / round trip)", "echo_64MiB_GBps", True),
    *[(f"init_rpc, {ws} workers (s)", f"init_{ws}_s", False) for ws in (2, 4, 8)],
    *[(f"shutdown, {ws} workers (s)", f"shutdown_{ws}_s", False) for ws in (2, 4, 8)],
    ("dist-autograd training step, 2 stages (µs)", "autograd_step_us", False),
    ("  its CPU time, 3 processes together (µs per step)", "autograd_cpu_us", False),
    ("CUDA rpc_sync round trip of a 32x64 tensor on cuda:0, echoed (µs)", "cuda_rtt_us", False),
    ("CUDA 64 MiB echo, one host (ms)", "cuda_echo_64MiB_ms", False),
    ("CUDA dist-autograd step, Linear(1024) on worker1 (µs)", "cuda_autograd_step_us", False),
]


def table(results: dict[str, dict[str, float]]) -> str:
    ours, theirs = results["RALLYPOINT"], results["TENSORPIPE"]
    keys = ours.keys() & theirs.keys()
    lines = [
        "| metric | rallypoint | TensorPipe | rallypoint advantage |",
        "| --- | ---: | ---: | ---: |",
    ]
    for label, key, higher_better in ROWS:
        if key not in keys or ours[key] != ours[key]:  # not measured (or NaN)
            continue
        a, b = ours[key], theirs[key]
        ratio = (a / b if higher_better else b / a) if a and b else float("nan")
        lines.append(f"| {label} | {a:,.4g} | {b:,.4g} | {ratio:.2f}x |")
    return "\n".join(lines)


def plot(results: dict[str, dict[str, float]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = [row for row in ROWS if all(row[1] in results[b] for b in BACKENDS)]
    cols = 5
    rows = (len(measured) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(3 * cols, 3 * rows), squeeze=False)
    for ax in axes.flat[len(measured) :]:
        ax.set_visible(False)
    for ax, (label, key, _) in zip(axes.flat, measured, strict=False):
        values = [results[b][key] for b in BACKENDS]
        ax.bar(["rallypoint", "TensorPipe"], values, color=["tab:blue", "tab:gray"])
        ax.set_title(label, fontsize=7)
        ax.tick_params(labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument(
        "--only",
        choices=("all", "calls", "throughput", "lifecycle", "autograd", "cuda"),
        default="all",
        help="calls: round trip, rpc_async and echo (no init/shutdown); throughput: only "
        "the rpc_async metric; lifecycle: only init_rpc/shutdown; autograd: only the "
        "distributed-autograd training step; cuda: only the CUDA cases (needs a GPU)",
    )
    parser.add_argument("--plot", metavar="FILE", help="write a bar chart (needs matplotlib)")
    args = parser.parse_args()
    results = measure(args.quick, args.only)
    print(
        f"torch {torch.__version__}, {os.cpu_count()} CPUs, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n"
    )
    print(table(results))
    if PAIRED:
        print(
            f"\ntraining step, epochs paired in time: TensorPipe / rallypoint "
            f"{PAIRED['ratio']:.2f}x (median of {PAIRED['epochs']:.0f} epochs, "
            f"{PAIRED['ratio_low']:.2f}-{PAIRED['ratio_high']:.2f}); the waiting group used "
            f"{PAIRED['rallypoint_idle_cpus']:.3f} CPUs (rallypoint) and "
            f"{PAIRED['tensorpipe_idle_cpus']:.3f} (TensorPipe)"
        )
    if args.only in ("all", "autograd"):
        floors = sorted(socket_floor_us() for _ in range(5))
        print(
            "\nfloor, no RPC: ping-pong between two processes over a Unix socket, round "
            f"trip {floors[2]:.1f} µs (median of 5 runs, {floors[0]:.1f}-{floors[-1]:.1f})"
        )
        awake, woken = wake_penalty_us()
        print(
            f"after a sleep, no RPC: one stage's forward and backward takes {awake:.1f} µs in a "
            f"loop that never sleeps and {woken:.1f} µs when each iteration follows a 200 µs "
            f"sleep ({woken / awake:.2f}x)"
        )
        blocking, spinning = chain_round_us(0.0), chain_round_us(0.001)
        print(
            "a chain, no RPC: a message handed around three processes, each running that "
            f"forward and backward, takes {blocking:.1f} µs per round when every hop blocks "
            f"and {spinning:.1f} µs when it waits by yielding busy-polls of up to 1 ms "
            f"({blocking / spinning:.2f}x)"
        )
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
