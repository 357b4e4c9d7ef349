"""Burn-in (``--burn-in``): after a round forms, find a node whose link or GPU is much slower.

The agents of the round time two point-to-point rings over a gloo group of their own (in
an all-reduce every rank waits for the slowest, so all would look equally slow; rings
tell them apart). Taking the faster of each node's two sends and two receives removes a
slow neighbour from the picture, so only a node whose own link is slow scores high both
ways. On GPU nodes each agent also times a GEMM per GPU in a child process. Every node
reaches the same verdict from the gathered times (at least three nodes are needed), and
the slow node is excluded like one that keeps failing.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from rallypoint._elastic._health._check_run import run_command

if TYPE_CHECKING:
    from rallypoint._core.store import Store

__all__ = [
    "GEMM_FACTOR",
    "PAYLOAD",
    "SLOW_FACTOR",
    "SLOW_SECONDS",
    "LinkTimes",
    "gemm_seconds",
    "measure",
    "slow_node",
]

PAYLOAD = 4 << 20
"""Bytes each node sends in each ring."""
SLOW_FACTOR = 4.0
SLOW_SECONDS = 0.2
"""A node is slow only above this many seconds as well: tiny times vary by large factors."""
GEMM_FACTOR = 1.5
"""A GPU GEMM this many times slower than the median is a slow device (GEMM times of
healthy GPUs of one model differ by a few percent)."""
_REPEATS = 2


@dataclass(frozen=True, slots=True)
class LinkTimes:
    """Each node's receive times (seconds) in the two rings, by group rank, and the time
    of its slowest GPU's GEMM (0.0: no GPU)."""

    forward: list[float]
    """Node g received from g-1."""
    backward: list[float]
    """Node g received from g+1."""
    gemm: list[float] = field(default_factory=list)

    def scores(self) -> list[float]:
        """Each node's worse direction, ``max(out, in)``: ``out`` is the faster of its two
        sends (timed by the receivers), ``in`` the faster of its two receives."""
        n = len(self.forward)
        out = [min(self.forward[(g + 1) % n], self.backward[(g - 1) % n]) for g in range(n)]
        inn = [min(self.forward[g], self.backward[g]) for g in range(n)]
        return [max(o, i) for o, i in zip(out, inn, strict=True)]


def slow_node(times: LinkTimes) -> tuple[int, str] | None:
    """``(group rank, why)`` of a node whose link or GPU is much slower than the
    others', or ``None``."""
    scores = times.scores()
    if len(scores) < 3:
        return None
    median = statistics.median(scores)
    worst = max(range(len(scores)), key=scores.__getitem__)
    if scores[worst] > max(SLOW_FACTOR * median, SLOW_SECONDS):
        ratio = scores[worst] / median if median > 0 else float("inf")
        return worst, f"its link took {scores[worst]:.2f} s in the burn-in, {ratio:.0f}x the median"
    gemm = times.gemm
    if len(gemm) == len(scores) and all(t > 0 for t in gemm):
        median = statistics.median(gemm)
        worst = max(range(len(gemm)), key=gemm.__getitem__)
        if gemm[worst] > GEMM_FACTOR * median:
            return worst, (
                f"its slowest GPU took {gemm[worst] * 1000:.1f} ms for a GEMM in the burn-in, "
                f"{gemm[worst] / median:.1f}x the median"
            )
    return None


def gemm_seconds(timeout: float = 60.0) -> float:
    """This node's slowest GPU GEMM time (``_gpu_probe --gemm``, in a child process); 0.0
    without a GPU or if it fails (a GPU that fails is the health check's business, not the
    burn-in's). A CPU-only build of torch has no GPU to time: no child then."""
    import torch

    if torch.version.cuda is None and torch.version.hip is None:
        return 0.0
    argv = [sys.executable, "-m", "rallypoint._elastic._health._gpu_probe", "--gemm"]
    result = run_command("burn-in GEMM", timeout, argv=argv)
    try:
        return float(result.output.split()[-1]) if result.ok else 0.0
    except (ValueError, IndexError):
        return 0.0


def measure(store: Store, group_rank: int, nnodes: int, addr: str, timeout: float) -> LinkTimes:
    """Run the two rings among the round's agents (all of them call it) and gather every
    node's times. ``store``: a prefix of the round's store for this alone; ``addr``: where
    the others reach this node."""
    import torch
    from torch.distributed import ProcessGroupGloo

    gloo: Any = ProcessGroupGloo  # its collectives are bound at run time (no stubs)
    options = gloo._Options()
    options._timeout = timedelta(seconds=timeout)
    options._devices = [gloo.create_device(hostname=addr)]
    group = gloo(store, group_rank, nnodes, options)
    try:
        payload = torch.ones(PAYLOAD // 4, dtype=torch.float32)
        inbox = torch.empty_like(payload)
        best = [float("inf"), float("inf")]
        tag = 0
        for _ in range(_REPEATS):
            for direction, step in enumerate((1, -1)):
                group.barrier().wait()
                tag += 1
                start = time.perf_counter()
                send = group.send([payload], (group_rank + step) % nnodes, tag)
                recv = group.recv([inbox], (group_rank - step) % nnodes, tag)
                recv.wait()
                best[direction] = min(best[direction], time.perf_counter() - start)
                send.wait()
        mine = torch.tensor([*best, gemm_seconds()], dtype=torch.float64)
        everyone = [torch.empty_like(mine) for _ in range(nnodes)]
        group.allgather([everyone], [mine]).wait()
        return LinkTimes(
            forward=[float(t[0]) for t in everyone],
            backward=[float(t[1]) for t in everyone],
            gemm=[float(t[2]) for t in everyone],
        )
    finally:
        group.barrier().wait()
