"""The distributed-autograd training step, rallypoint vs TensorPipe, in paired epochs.

Two groups of three processes run at once, one per backend, each a two-stage
model-parallel model (``Linear(64, 64)`` + ReLU on worker1 and on worker2, created with
``remote``) driven by worker0 with ``rpc_sync`` (batch 32): forward, ``dist_autograd``
backward and a ``DistributedOptimizer`` (SGD) step, in one context. A coordinator lets
one group run an *epoch* of steps while the other waits on a pipe, then the other, and
alternates which goes first. Each epoch's median step is paired with the other
backend's epoch next to it, so both see the same moment of a shared host: on the 2-vCPU
VM of the README one run of either backend could be 1.5x slower than the next, which a
comparison of separate runs cannot tell from a difference of the backends.

Reported per backend: the median over epochs of the epoch's median step, and the CPU
time of the group's three processes per step; and the median over epochs of the ratio
of the two backends' steps (with its range). ``python benchmarks/rpc_step.py [--quick]``
prints them.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import signal
import statistics
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import torch
from busy import busy_processes
from ports import free_port

from rallypoint import rpc

BACKENDS = ("RALLYPOINT", "TENSORPIPE")
WARMUP_STEPS = 20


class Stage(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x))


def _stage_forward(stage: Any, x: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = stage.local_value()(x)
    return out


def _stage_params(stage: Any) -> list[Any]:
    return [rpc.RRef(p) for p in stage.local_value().parameters()]


def _cpu_seconds() -> float:
    return time.process_time()


def join_group(backend: str, rank: int, port: int) -> None:
    """``init_rpc`` as worker ``rank`` of a group of three on ``port``, one thread each."""
    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": "3",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
            "RALLYPOINT_RPC_SECRET": "benchmark-secret",
        }
    )
    torch.set_num_threads(1)
    options = rpc.construct_rpc_backend_options(rpc.BackendType[backend], rpc_timeout=120)
    rpc.init_rpc(
        f"worker{rank}",
        backend=rpc.BackendType[backend],
        rank=rank,
        world_size=3,
        rpc_backend_options=options,
    )


def _member(backend: str, rank: int, port: int, pipe: Connection | None, width: int) -> None:
    """One process of a group: worker0 runs the epochs it is told to, the stages serve."""
    join_group(backend, rank, port)
    if pipe is not None:
        _drive(pipe, width)
    rpc.shutdown()
    if rank == 0 and backend == "TENSORPIPE":
        time.sleep(0.5)  # torch's shutdown: the store host must outlive the others' barrier


def training_step(width: int = 64) -> Callable[[], None]:
    """On worker0: build the two stages and the optimizer; the function that runs a step."""
    from rallypoint.rpc import dist_autograd

    stage1 = rpc.remote("worker1", Stage, args=(width,))
    stage2 = rpc.remote("worker2", Stage, args=(width,))
    params = rpc.rpc_sync("worker1", _stage_params, args=(stage1,))
    params += rpc.rpc_sync("worker2", _stage_params, args=(stage2,))
    opt = rpc.DistributedOptimizer(torch.optim.SGD, params, lr=0.01)
    x = torch.randn(32, width)

    def step() -> None:
        with dist_autograd.context() as context_id:
            h = rpc.rpc_sync("worker1", _stage_forward, args=(stage1, x))
            y = rpc.rpc_sync("worker2", _stage_forward, args=(stage2, h))
            dist_autograd.backward(context_id, [y.square().mean()])
            opt.step(context_id)

    return step


def _drive(pipe: Connection, width: int) -> None:
    step = training_step(width)

    def group_cpu() -> float:
        return time.process_time() + sum(
            float(rpc.rpc_sync(f"worker{r}", _cpu_seconds)) for r in (1, 2)
        )

    for _ in range(WARMUP_STEPS):
        step()
    pipe.send("ready")
    while (steps := pipe.recv()) is not None:
        cpu_at = group_cpu()
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        pipe.send((statistics.median(times), (group_cpu() - cpu_at) / steps))


IDLE_CPU: dict[str, list[float]] = {}
"""Per backend: the CPUs its waiting (stopped) group used while the other ran, per epoch:
a check that it was stopped."""


def _cpu_of(pids: list[int]) -> float:
    """CPU seconds (user and system) that processes ``pids`` used so far."""
    ticks = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


def _pause(pids: list[int]) -> None:
    """Stop a waiting group (``SIGSTOP``), and wait until it has stopped: TensorPipe's
    threads busy-poll while they wait (~0.7 of a CPU here), which would slow the group
    that runs."""
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 5
    for pid in pids:
        while _state(pid) not in ("T", "t") and time.monotonic() < deadline:
            time.sleep(0.001)


def _resume(pids: list[int]) -> None:
    for pid in pids:
        os.kill(pid, signal.SIGCONT)


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0]


def paired_epochs(epochs: int, steps: int, width: int = 64) -> dict[str, list[tuple[float, float]]]:
    """Per backend, per epoch: (median step, CPU seconds per step of its three processes).

    Epoch ``i`` of the two backends ran back to back, the first of them alternating; the
    group that waits is stopped meanwhile."""
    ctx = multiprocessing.get_context("fork")
    procs: list[Any] = []
    pipes: dict[str, Connection] = {}
    results: dict[str, list[tuple[float, float]]] = {b: [] for b in BACKENDS}
    idle: dict[str, list[float]] = IDLE_CPU
    idle.update({b: [] for b in BACKENDS})
    try:
        for backend in BACKENDS:
            port = free_port()
            ours, theirs = ctx.Pipe()
            pipes[backend] = ours
            for rank in range(3):
                pipe = theirs if rank == 0 else None
                proc = ctx.Process(target=_member, args=(backend, rank, port, pipe, width))
                proc.start()
                procs.append(proc)
        for backend in BACKENDS:
            if not pipes[backend].poll(300) or pipes[backend].recv() != "ready":
                raise RuntimeError(f"the {backend} group did not start")
        pids = {b: [p.pid for p in procs[3 * i : 3 * i + 3]] for i, b in enumerate(BACKENDS)}
        for backend in BACKENDS:
            _pause(pids[backend])
        for epoch in range(epochs):
            for backend in BACKENDS if epoch % 2 == 0 else BACKENDS[::-1]:
                other = BACKENDS[1 - BACKENDS.index(backend)]
                _resume(pids[backend])
                idle_at, t0 = _cpu_of(pids[other]), time.perf_counter()
                pipes[backend].send(steps)
                if not pipes[backend].poll(300):
                    raise RuntimeError(f"the {backend} group did not finish epoch {epoch}")
                results[backend].append(pipes[backend].recv())
                idle[other].append((_cpu_of(pids[other]) - idle_at) / (time.perf_counter() - t0))
                _pause(pids[backend])
        for backend in BACKENDS:
            _resume(pids[backend])
            pipes[backend].send(None)
        deadline = time.monotonic() + 120
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        failed = [p.exitcode for p in procs if p.exitcode != 0]
        if failed:
            raise RuntimeError(f"group processes exited with {failed}")
    finally:
        for proc in procs:
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGKILL)
                proc.join(10)
    return results


def summary(results: dict[str, list[tuple[float, float]]]) -> dict[str, float]:
    """Medians over epochs (µs), and the epoch-paired ratio TensorPipe / rallypoint."""
    ours, theirs = results["RALLYPOINT"], results["TENSORPIPE"]
    ratios = sorted(t[0] / o[0] for o, t in zip(ours, theirs, strict=True))
    return {
        "rallypoint_step_us": statistics.median(s for s, _ in ours) * 1e6,
        "tensorpipe_step_us": statistics.median(s for s, _ in theirs) * 1e6,
        "rallypoint_cpu_us": statistics.median(c for _, c in ours) * 1e6,
        "tensorpipe_cpu_us": statistics.median(c for _, c in theirs) * 1e6,
        "ratio": statistics.median(ratios),
        "ratio_low": ratios[0],
        "ratio_high": ratios[-1],
        "epochs": len(ratios),
        "rallypoint_idle_cpus": statistics.median(IDLE_CPU.get("RALLYPOINT") or [0.0]),
        "tensorpipe_idle_cpus": statistics.median(IDLE_CPU.get("TENSORPIPE") or [0.0]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="6 epochs of 100 steps")
    parser.add_argument(
        "--hogs", type=int, default=0, help="CPU-bound processes running beside the groups"
    )
    args = parser.parse_args()
    if args.hogs < 0:
        parser.error("--hogs must be 0 or more")
    epochs, steps = (6, 100) if args.quick else (20, 150)
    with busy_processes(args.hogs):
        result = summary(paired_epochs(epochs, steps))
    print(
        f"torch {torch.__version__}, {os.cpu_count()} CPUs, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {epochs} epochs of {steps} "
        f"steps, {args.hogs} CPU-bound processes beside"
    )
    print(
        f"step: rallypoint {result['rallypoint_step_us']:.0f} µs, TensorPipe "
        f"{result['tensorpipe_step_us']:.0f} µs; CPU per step {result['rallypoint_cpu_us']:.0f} "
        f"vs {result['tensorpipe_cpu_us']:.0f} µs; paired ratio {result['ratio']:.2f}x "
        f"({result['ratio_low']:.2f}-{result['ratio_high']:.2f}); a waiting group used "
        f"{result['rallypoint_idle_cpus']:.3f} (rallypoint) and "
        f"{result['tensorpipe_idle_cpus']:.3f} (TensorPipe) CPUs"
    )


if __name__ == "__main__":
    main()
