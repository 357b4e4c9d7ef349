"""Two rallypoint source trees, A and B, on the training step of ``rpc_step.py``, paired.

    python benchmarks/rpc_ab.py TREE_A TREE_B [--epochs 12] [--steps 150] [--hogs N]

A tree is a checkout (a directory with ``src/rallypoint``). Each tree runs a group of
three processes (``rpc_step._member``: a driver and two stages); the groups take turns,
one epoch of steps each, the first of a pair alternating, as ``rpc_step.py`` pairs the
backends. Prints each tree's median step (µs) and the median and range of the per-epoch
ratios A/B (below 1: A is faster).

Why: on the README's 2-vCPU VM one run of the step can be 1.5x slower than the next, so
separate runs of two builds cannot show a 5% effect. Paired epochs can, but not in one
run: two identical trees gave medians from 0.95 to 1.06 in runs of 12 epochs, so repeat a
run a few times before believing an effect that small. The waiting group is not stopped
(``rpc_step.py`` stops TensorPipe's, whose threads busy-poll while they wait): a waiting
rallypoint group blocks.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
from multiprocessing.connection import Connection

from busy import busy_processes
from ports import free_port

BENCHMARKS = os.path.dirname(os.path.abspath(__file__))
WIDTH = 64


def _member(tree: str, rank: int, port: int, pipe: Connection | None) -> None:
    """One process of a tree's group: imports rallypoint from that tree (the parent never
    imported it, so nothing was inherited through the fork)."""
    sys.path[:0] = [os.path.join(tree, "src"), BENCHMARKS]
    import rallypoint

    if not os.path.realpath(rallypoint.__file__).startswith(os.path.realpath(tree) + os.sep):
        raise RuntimeError(f"imported rallypoint from {rallypoint.__file__}, not from {tree}")
    import rpc_step

    rpc_step._member("RALLYPOINT", rank, port, pipe, WIDTH)


def paired(trees: list[str], epochs: int, steps: int) -> list[list[float]]:
    """Per tree, per epoch: the epoch's median step in seconds."""
    ctx = multiprocessing.get_context("fork")
    procs: list[multiprocessing.process.BaseProcess] = []
    pipes: list[Connection] = []
    try:
        for tree in trees:
            port = free_port()
            ours, theirs = ctx.Pipe()
            pipes.append(ours)
            for rank in range(3):
                args = (tree, rank, port, theirs if rank == 0 else None)
                procs.append(ctx.Process(target=_member, args=args))
                procs[-1].start()
        for tree, pipe in zip(trees, pipes, strict=True):
            if not pipe.poll(300) or pipe.recv() != "ready":
                raise RuntimeError(f"the group of {tree} did not start")
        steps_of: list[list[float]] = [[] for _ in trees]
        for epoch in range(epochs):
            order = range(len(trees)) if epoch % 2 == 0 else reversed(range(len(trees)))
            for i in order:
                pipes[i].send(steps)
                if not pipes[i].poll(300):
                    raise RuntimeError(f"the group of {trees[i]} did not finish epoch {epoch}")
                steps_of[i].append(pipes[i].recv()[0])
        for pipe in pipes:
            pipe.send(None)
        for proc in procs:
            proc.join(60)
        return steps_of
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("tree_a")
    parser.add_argument("tree_b")
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument(
        "--hogs", type=int, default=0, help="CPU-bound processes running beside the groups"
    )
    args = parser.parse_args()
    trees = [os.path.abspath(args.tree_a), os.path.abspath(args.tree_b)]
    for tree in trees:
        if not os.path.isfile(os.path.join(tree, "src", "rallypoint", "__init__.py")):
            parser.error(f"{tree} has no src/rallypoint/__init__.py")
    if args.epochs < 1 or args.steps < 1 or args.hogs < 0:
        parser.error("--epochs and --steps must be at least 1, --hogs at least 0")
    with busy_processes(args.hogs):
        a, b = paired(trees, args.epochs, args.steps)
    ratios = sorted(x / y for x, y in zip(a, b, strict=True))
    print(
        f"A {statistics.median(a) * 1e6:.0f} µs, B {statistics.median(b) * 1e6:.0f} µs; "
        f"A/B paired median {statistics.median(ratios):.3f} "
        f"({ratios[0]:.3f}-{ratios[-1]:.3f}); A faster in {sum(r < 1 for r in ratios)} of "
        f"{len(ratios)} epochs"
    )


if __name__ == "__main__":
    main()
