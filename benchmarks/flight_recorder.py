"""Training-step cost of torch's Flight Recorder as rallypoint turns it on (CPU, gloo).

The Flight Recorder's size is read once per process, when its first process group is
made, so recording and not recording cannot share processes. The benchmark runs paired
epochs instead: each pair starts one group of workers with ``TORCH_FR_BUFFER_SIZE=2000``
(rallypoint's default) and one with ``0`` (off), in an order that alternates from pair to
pair, and every epoch times the same DDP training steps after a warm-up. The ratio is
per pair (median step time recording / not recording), and the table gives the median of
those ratios with a bootstrap 95% interval. ``--model tiny`` (a 1-element all_reduce per
step and nothing else) is the worst case: the recorder's fixed cost per collective.

    .venv/bin/python benchmarks/flight_recorder.py               # 2 ranks, 12 pairs
    .venv/bin/python benchmarks/flight_recorder.py --model tiny --plot fr.png
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import random
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from rallypoint.testing import run_workers

VARIANTS = {"recording (2000)": "2000", "off": "0"}


def _epoch(model_kind: str, steps: int, warmup: int, width: int, batch: int) -> list[float]:
    """One epoch in one worker: its step times (s), after ``warmup`` untimed steps."""
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    if model_kind == "tiny":
        t = torch.ones(1)

        def step() -> None:
            dist.all_reduce(t)

    else:
        net = torch.nn.Sequential(
            torch.nn.Linear(width, width),
            torch.nn.ReLU(),
            torch.nn.Linear(width, width),
            torch.nn.ReLU(),
            torch.nn.Linear(width, 10),
        )
        model = DDP(net, bucket_cap_mb=1)  # a few buckets: several all_reduces per step
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        x, y = torch.randn(batch, width), torch.randint(0, 10, (batch,))

        def step() -> None:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()

    times = []
    for i in range(warmup + steps):
        dist.barrier()
        start = time.perf_counter()
        step()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    dist.destroy_process_group()
    return times


def _bootstrap(values: list[float], n: int = 2000) -> tuple[float, float]:
    rng = random.Random(0)
    meds = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(n))
    return meds[int(0.025 * n)], meds[int(0.975 * n) - 1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--pairs", type=int, default=12)
    parser.add_argument("--steps", type=int, default=200, help="timed steps per epoch")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--model", choices=("mlp", "tiny"), default="mlp")
    parser.add_argument("--width", type=int, default=512, help="hidden width of the MLP")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--plot", metavar="FILE", help="write a box plot (needs matplotlib)")
    args = parser.parse_args(argv)
    medians: dict[str, list[float]] = {v: [] for v in VARIANTS}
    ratios = []
    for pair in range(args.pairs):
        order = list(VARIANTS) if pair % 2 == 0 else list(reversed(VARIANTS))
        for variant in order:
            env = {"TORCH_FR_BUFFER_SIZE": VARIANTS[variant]}
            per_rank = run_workers(
                _epoch,
                args.world_size,
                args.model,
                args.steps,
                args.warmup,
                args.width,
                args.batch,
                env=env,
                timeout=600,
            )
            # a step is as slow as its slowest rank
            medians[variant].append(
                statistics.median(max(ts) for ts in zip(*per_rank, strict=True))
            )
        ratios.append(medians["recording (2000)"][-1] / medians["off"][-1])
    low, high = _bootstrap(ratios)
    print(
        f"# Flight Recorder cost, {datetime.date.today()}, {platform.node()}, "
        f"{os.cpu_count()} cores, torch {torch.__version__}, {args.world_size} ranks gloo, "
        f"model {args.model}, {args.pairs} pairs x {args.steps} steps"
    )
    print("| variant | median step (ms) |")
    print("| --- | --- |")
    for variant, values in medians.items():
        print(f"| {variant} | {statistics.median(values) * 1e3:.3f} |")
    print(
        f"\nrecording / off, paired: median {statistics.median(ratios):.3f}x "
        f"(95% CI {low:.3f}-{high:.3f}x; target <= 1.03x)"
    )
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(4, 3.5))
        ax.boxplot([ratios], showfliers=False)
        ax.axhline(1.03, color="grey", linestyle=":", linewidth=1)
        ax.set_xticks([1], [f"{args.model}, {args.world_size} ranks"])
        ax.set_ylabel("step time, recording / off (paired)")
        ax.set_title("Flight Recorder cost (CPU, gloo)")
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"\nplot written to {args.plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
