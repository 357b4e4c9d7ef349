"""Per-iteration cost of a Join context on a small DDP model (CPU, gloo).

Runs the same training loop in the same processes with no Join, torch's ``Join``,
rallypoint's ``Join``, and rallypoint's ``Join`` with ``join.iterate(inputs)`` (join mode
only for the last, uneven iterations), interleaved in many short rounds so that machine
noise hits every variant alike, and prints a markdown table with ratios. Inputs are even:
what is measured is the price of being inside a Join context (in join mode DDP issues two
1-element all-reduces per step), not the shadowing of uneven inputs.

    .venv/bin/python benchmarks/join.py                  # 2 ranks, 24 rounds x 25 iterations
    .venv/bin/python benchmarks/join.py --iters 10 --rounds 4 --plot join.png
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join as TorchJoin
from torch.distributed.algorithms.join import _JoinConfig
from torch.nn.parallel import DistributedDataParallel as DDP

from rallypoint.join import Join
from rallypoint.testing import run_workers

VARIANTS = ("no Join", "torch Join", "rallypoint Join", "rallypoint Join.iterate")


def _context(variant: str, model: DDP) -> AbstractContextManager[Any]:
    if variant == "torch Join":
        return TorchJoin([model])
    if variant.startswith("rallypoint Join"):
        return Join([model])
    return nullcontext()


def _worker(iters: int, rounds: int, width: int, batch: int) -> dict[str, list[float]]:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    torch.manual_seed(0)
    model = DDP(
        torch.nn.Sequential(
            torch.nn.Linear(width, width),
            torch.nn.ReLU(),
            torch.nn.Linear(width, width),
            torch.nn.ReLU(),
            torch.nn.Linear(width, 10),
        )
    )
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(batch, width)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()

    for _ in range(10):  # warm up buckets and allocator
        step()
    for round_ in range(rounds):
        shift = round_ % len(VARIANTS)
        order = VARIANTS[shift:] + VARIANTS[:shift]
        for variant in order:
            dist.barrier()
            with _context(variant, model) as join:
                steps = join.iterate(range(iters)) if variant.endswith("iterate") else range(iters)
                for _ in steps:
                    start = time.perf_counter()
                    step()
                    times[variant].append(time.perf_counter() - start)
            # torch's Join leaves DDP's join config enabled after the context (rallypoint's
            # restores it): reset it so that the next variant starts from a plain DDP
            model._join_config = _JoinConfig.construct_disabled_join_config()
    dist.destroy_process_group()
    return times


def _table(times: dict[str, list[float]], world: int, iters: int, rounds: int) -> str:
    base = statistics.median(times["no Join"])
    torch_median = statistics.median(times["torch Join"])
    lines = [
        f"Join overhead, DDP on CPU/gloo, {world} ranks, {rounds} rounds x {iters} iterations "
        f"({datetime.date.today()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"{platform.python_implementation()} {platform.python_version()})",
        "",
        "| variant | median ms/iter | mean ms/iter | vs no Join | vs torch Join |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for variant in VARIANTS:
        values = times[variant]
        median = statistics.median(values)
        lines.append(
            f"| {variant} | {median * 1e3:.3f} | {statistics.fmean(values) * 1e3:.3f} | "
            f"{median / base:.3f} | {median / torch_median:.3f} |"
        )
    return "\n".join(lines)


def _plot(times: dict[str, list[float]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.8))
    ax.boxplot([[t * 1e3 for t in times[v]] for v in VARIANTS], showfliers=False)
    ax.set_xticks(range(1, len(VARIANTS) + 1), [v.replace(" Join", "\nJoin") for v in VARIANTS])
    ax.set_ylabel("ms per iteration (rank 0)")
    ax.set_title("DDP step time inside a Join context (CPU, gloo)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--iters", type=int, default=25, help="iterations per round")
    parser.add_argument("--rounds", type=int, default=24, help="rounds (variants interleaved)")
    parser.add_argument("--width", type=int, default=512, help="hidden width of the MLP")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--plot", metavar="FILE", help="write a box plot (needs matplotlib)")
    args = parser.parse_args(argv)
    worker: Callable[..., dict[str, list[float]]] = _worker
    results = run_workers(
        worker,
        args.world_size,
        args.iters,
        args.rounds,
        args.width,
        args.batch,
        timeout=3600,
    )
    times = results[0]
    print(_table(times, args.world_size, args.iters, args.rounds))
    if args.plot:
        _plot(times, args.plot)
        print(f"\nplot written to {args.plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
