"""A training loop that logs the time of every step, for recovery tests and benchmarks.

:data:`STEP_WORKER` is a worker script (run it under ``rallypoint run`` or torchrun with
``OUT_DIR`` as its one argument): gloo all_reduces in a loop, one line ``step unix_time``
per step in ``OUT_DIR/steps-<rank>-<world>-<restart>-<NODE_NAME>``, until ``OUT_DIR/stop``
exists (the ranks agree on it through an all_reduce, so they stop at the same step); then
each rank writes ``<sum of the ranks> <steps>`` to ``OUT_DIR/result-<same tag>``.

:func:`wait_training` answers "is every rank training again after the loss, and since
when": the latest of each rank's first step after a given time.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["STEP_WORKER", "read_results", "step_times", "stop_training", "wait_training"]

STEP_WORKER = """
import os, sys, time
import torch, torch.distributed as dist

out = sys.argv[1]
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
tag = "-".join([str(rank), str(world), os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"),
                os.environ.get("NODE_NAME", os.uname().nodename)])
log = open(os.path.join(out, "steps-" + tag), "a", buffering=1)
step = 0
while True:
    stop = torch.tensor([float(os.path.exists(os.path.join(out, "stop")))])
    dist.all_reduce(stop, op=dist.ReduceOp.MAX)
    if stop.item() > 0:
        break
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == world, (t.item(), world)
    step += 1
    log.write(f"{step} {time.time()!r}\\n")
    time.sleep(0.02)
total = torch.tensor([float(rank)])
dist.all_reduce(total)
with open(os.path.join(out, "result-" + tag), "w") as fp:
    fp.write(f"{total.item()} {step}")
dist.destroy_process_group()
"""


def step_times(out: Path, world: int) -> dict[str, list[float]]:
    """Step times per ``rank-world-restart-node`` tag, for the ranks of ``world``-rank worlds."""
    found: dict[str, list[float]] = {}
    for path in out.glob(f"steps-*-{world}-*-*"):
        lines = path.read_text().splitlines()
        found[path.name.removeprefix("steps-")] = [
            float(line.split()[1]) for line in lines if len(line.split()) == 2
        ]
    return found


def wait_training(
    out: Path,
    world: int,
    since: float,
    timeout: float,
    *,
    diagnose: Callable[[], str] = lambda: "",
) -> float:
    """Wait until every rank of a ``world``-rank world logged a step after ``since`` (unix
    time); return how long after ``since`` the last of them did.

    Raises:
        TimeoutError: not within ``timeout`` seconds (with ``diagnose()`` in the message).
    """
    deadline = time.monotonic() + timeout
    while True:
        firsts: dict[int, float] = {}
        for tag, times in step_times(out, world).items():
            after = [t for t in times if t > since]
            if after:
                rank = int(tag.split("-")[0])
                firsts[rank] = min(firsts.get(rank, after[0]), after[0])
        if len(firsts) == world:
            return max(firsts.values()) - since
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"ranks {sorted(firsts)} of {world} trained after the loss within {timeout} s; "
                f"logs: {sorted(step_times(out, world))}\n{diagnose()}"
            )
        time.sleep(0.05)


def stop_training(out: Path) -> None:
    """Ask every rank to finish (after the step it is in)."""
    (out / "stop").touch()


def read_results(out: Path, world: int) -> list[tuple[float, int]]:
    """``(sum of the ranks, steps)`` of each rank of a ``world``-rank world that finished."""
    results = []
    for path in sorted(out.glob(f"result-*-{world}-*-*")):
        total, steps = path.read_text().split()
        results.append((float(total), int(steps)))
    return results
