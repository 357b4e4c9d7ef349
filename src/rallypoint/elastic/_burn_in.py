"""Burn-in (``--burn-in``): after a round forms, find a node whose link is much slower.

The agents of the round (one per node, not the workers) open a gloo group of their own in
the round's store and time two rings of :data:`PAYLOAD` bytes: each node sends to the next
node and receives from the previous one, then the other way round. A receive completes
only when every byte came over the sender's link into the receiver, so

- node X's *out* time is the faster of its two sends (timed by the receivers), and
- its *in* time the faster of its two receives;

the faster of two takes a slow neighbour out of the picture, so only a node whose own
link is slow scores high both ways. Every node gathers every node's times and reaches the
same verdict: the slowest node is slow when its score is above :data:`SLOW_FACTOR` times
the median and :data:`SLOW_SECONDS`. It needs three nodes at least (with two, a slow link
has no side). The verdict's node is then excluded like one that keeps failing.

In an all-reduce every rank waits for the slowest, so timing one would show every node
equally slow; point-to-point rings are what tell them apart.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

__all__ = ["PAYLOAD", "SLOW_FACTOR", "SLOW_SECONDS", "LinkTimes", "measure", "slow_node"]

PAYLOAD = 4 << 20
"""Bytes each node sends in each ring."""
SLOW_FACTOR = 4.0
SLOW_SECONDS = 0.2
"""A node is slow only above this many seconds as well: tiny times vary by large factors."""
_REPEATS = 2


@dataclass(frozen=True, slots=True)
class LinkTimes:
    """Each node's receive times (seconds) in the two rings, by group rank."""

    forward: list[float]
    """Node g received from g-1."""
    backward: list[float]
    """Node g received from g+1."""

    def scores(self) -> list[float]:
        """Each node's worse direction: ``max(out, in)`` (see the module docstring)."""
        n = len(self.forward)
        out = [min(self.forward[(g + 1) % n], self.backward[(g - 1) % n]) for g in range(n)]
        inn = [min(self.forward[g], self.backward[g]) for g in range(n)]
        return [max(o, i) for o, i in zip(out, inn, strict=True)]


def slow_node(times: LinkTimes) -> tuple[int, float, float] | None:
    """``(group rank, its score, the median score)`` of a node whose link is slow, or
    ``None``."""
    scores = times.scores()
    if len(scores) < 3:
        return None
    median = statistics.median(scores)
    worst = max(range(len(scores)), key=scores.__getitem__)
    if scores[worst] > max(SLOW_FACTOR * median, SLOW_SECONDS):
        return worst, scores[worst], median
    return None


def measure(store: Any, group_rank: int, nnodes: int, addr: str, timeout: float) -> LinkTimes:
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
        mine = torch.tensor(best, dtype=torch.float64)
        everyone = [torch.empty_like(mine) for _ in range(nnodes)]
        group.allgather([everyone], [mine]).wait()
        return LinkTimes(
            forward=[float(t[0]) for t in everyone], backward=[float(t[1]) for t in everyone]
        )
    finally:
        group.barrier().wait()
