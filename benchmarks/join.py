"""Per-iteration cost of a Join context on a small DDP model (CPU, gloo).

Runs the same training loop in the same processes with no Join, torch's ``Join``,
rallypoint's ``Join`` (join mode deferred until a rank runs out, the default), rallypoint's
``Join`` with ``JoinOptions(defer_join_mode=False)`` (join mode from the first step, as
torch), and rallypoint's ``Join`` with ``join.iterate(inputs)``, interleaved (the order
rotates) so that machine noise hits every variant alike.

By default (``--interleave steps``) every variant has its own identical model and its
context stays open for the whole run, and each cycle times one step of every variant (a
barrier before each): costs that a context has while open but outside the step (watcher
threads polling the store) fall on every variant alike, while per-step costs are measured
tightly. ``--interleave rounds`` instead opens each variant's context in turn on one model
for ``--iters`` steps. Ratios are paired: per cycle (or round), the variant's step time
over the no-Join one of the same cycle; the table gives the median of those ratios and
its bootstrap 95% interval. Inputs are even: what is measured is the price of being inside
a Join context (in join mode DDP issues two 1-element all-reduces per step), not the
shadowing of uneven inputs.

    .venv/bin/python benchmarks/join.py                  # 2 ranks, 400 cycles
    .venv/bin/python benchmarks/join.py --interleave rounds --plot join.png
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
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join as TorchJoin
from torch.distributed.algorithms.join import _JoinConfig
from torch.nn.parallel import DistributedDataParallel as DDP

from rallypoint.join import Join, JoinOptions
from rallypoint.testing import run_workers

VARIANTS = (
    "no Join",
    "torch Join",
    "rallypoint Join",
    "rallypoint Join, join mode from step 1",
    "rallypoint Join.iterate",
)
Times = dict[str, list[list[float]]]  # variant -> rounds -> step times (s)


def _context(variant: str, model: DDP) -> AbstractContextManager[Any]:
    if variant == "torch Join":
        return TorchJoin([model])
    if variant == "rallypoint Join, join mode from step 1":
        return Join([model], join_options=JoinOptions(defer_join_mode=False))
    if variant.startswith("rallypoint Join"):
        return Join([model])
    return nullcontext()


def _model(width: int) -> DDP:
    torch.manual_seed(0)
    return DDP(
        torch.nn.Sequential(
            torch.nn.Linear(width, width),
            torch.nn.ReLU(),
            torch.nn.Linear(width, width),
            torch.nn.ReLU(),
            torch.nn.Linear(width, 10),
        )
    )


def _in_group(run: Callable[..., Times], *args: int) -> Times:
    """``run(*args)`` between init_process_group() and destroy_process_group().

    The DDP models must die with ``run``'s frame, before the group is destroyed: a DDP that
    outlives destroy_process_group() holds the last reference to the group in its C++
    Reducer, and freeing it then destroys ProcessGroupGloo while holding the GIL, which
    deadlocks with a gloo worker thread that needs the GIL to free the tensors of the
    collective it is finishing (seen as a hung rank at the end of a run; docs/join.md).
    """
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    times = run(*args)
    dist.destroy_process_group()
    return times


def _worker_steps(cycles: int, width: int, batch: int) -> Times:
    """One model per variant, every context open for the whole run, one step of each
    variant per cycle (order rotating): a cycle is one paired sample."""
    models = {v: _model(width) for v in VARIANTS}
    opts = {v: torch.optim.SGD(m.parameters(), lr=1e-3) for v, m in models.items()}
    x = torch.randn(batch, width)
    times: Times = {v: [] for v in VARIANTS}

    def step(variant: str) -> None:
        opts[variant].zero_grad(set_to_none=True)
        models[variant](x).square().mean().backward()
        opts[variant].step()

    for _ in range(10):  # warm up buckets and allocator
        for variant in VARIANTS:
            step(variant)
    with ExitStack() as stack:
        iterator: Iterator[int] = iter(range(0))
        for variant in VARIANTS:
            join = stack.enter_context(_context(variant, models[variant]))
            if variant.endswith("iterate"):
                iterator = join.iterate(range(cycles))
        for cycle in range(cycles):
            shift = cycle % len(VARIANTS)
            for variant in VARIANTS[shift:] + VARIANTS[:shift]:
                if variant.endswith("iterate"):
                    next(iterator)
                dist.barrier()
                start = time.perf_counter()
                step(variant)
                times[variant].append([time.perf_counter() - start])
        for _ in iterator:  # iterate() must run to its end
            pass
    return times


def _worker(iters: int, rounds: int, width: int, batch: int) -> Times:
    """One model; per round, each variant's context in turn for ``iters`` steps."""
    model = _model(width)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(batch, width)
    times: Times = {v: [] for v in VARIANTS}

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
            this_round: list[float] = []
            with _context(variant, model) as join:
                steps = join.iterate(range(iters)) if variant.endswith("iterate") else range(iters)
                for _ in steps:
                    dist.barrier()  # start every step together: less noise from skew
                    start = time.perf_counter()
                    step()
                    this_round.append(time.perf_counter() - start)
            times[variant].append(this_round)
            # torch's Join leaves DDP's join config enabled after the context (rallypoint's
            # restores it): reset it so that the next variant starts from a plain DDP
            model._join_config = _JoinConfig.construct_disabled_join_config()
    return times


def _paired_ratios(times: Times, variant: str) -> list[float]:
    return [
        statistics.median(mine) / statistics.median(base)
        for mine, base in zip(times[variant], times["no Join"], strict=True)
    ]


def _interval(ratios: list[float], draws: int = 2000) -> tuple[float, float]:
    """Bootstrap 95% interval of the median ratio."""
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(draws))
    return medians[int(0.025 * draws)], medians[int(0.975 * draws) - 1]


def _table(times: Times, world: int, design: str) -> str:
    flat = {v: [t for round_ in times[v] for t in round_] for v in VARIANTS}
    lines = [
        f"Join overhead, DDP on CPU/gloo, {world} ranks, {design} "
        f"({datetime.date.today()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"{platform.python_implementation()} {platform.python_version()})",
        "",
        "| variant | median ms/iter | vs no Join (paired median) | 95% interval | vs torch Join |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    torch_ratio = statistics.median(_paired_ratios(times, "torch Join"))
    for variant in VARIANTS:
        ratios = _paired_ratios(times, variant)
        ratio = statistics.median(ratios)
        low, high = _interval(ratios)
        lines.append(
            f"| {variant} | {statistics.median(flat[variant]) * 1e3:.3f} | {ratio:.3f} | "
            f"{low:.3f} to {high:.3f} | {ratio / torch_ratio:.3f} |"
        )
    return "\n".join(lines)


def _plot(times: Times, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.8))
    ax.boxplot([_paired_ratios(times, v) for v in VARIANTS], showfliers=False)
    ax.axhline(1.03, color="grey", linestyle=":", linewidth=1)
    labels = [v.replace(" Join", "\nJoin").replace(", ", ",\n") for v in VARIANTS]
    ax.set_xticks(range(1, len(VARIANTS) + 1), labels, fontsize=8)
    ax.set_ylabel("step time / no Join (paired)")
    ax.set_title("DDP step time inside a Join context (CPU, gloo)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument(
        "--interleave",
        choices=("steps", "rounds"),
        default="steps",
        help="steps: one model per variant, all contexts open, one step each per cycle; "
        "rounds: one model, each variant's context in turn for --iters steps",
    )
    parser.add_argument("--cycles", type=int, default=400, help="cycles (--interleave steps)")
    parser.add_argument("--iters", type=int, default=10, help="iterations per round")
    parser.add_argument("--rounds", type=int, default=60, help="rounds (--interleave rounds)")
    parser.add_argument("--width", type=int, default=512, help="hidden width of the MLP")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--plot", metavar="FILE", help="write a box plot (needs matplotlib)")
    args = parser.parse_args(argv)
    worker: Callable[..., Times]
    sizes: tuple[int, ...]
    if args.interleave == "steps":
        worker, sizes = _worker_steps, (args.cycles,)
        design = f"{args.cycles} cycles of one step per variant, all contexts open"
    else:
        worker, sizes = _worker, (args.iters, args.rounds)
        design = f"{args.rounds} rounds x {args.iters} iterations, one context at a time"
    results = run_workers(
        _in_group, args.world_size, worker, *sizes, args.width, args.batch, timeout=3600
    )
    times = results[0]
    print(_table(times, args.world_size, design))
    if args.plot:
        _plot(times, args.plot)
        print(f"\nplot written to {args.plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
