"""A rank other than rank 0 of a replica group is stopped (SIGSTOP): the other groups go on.

Rank 0's stop stops its group's heartbeat and asks with it; another rank's does not. Its
agent marks it stopped in the group's store before it tells the lighthouse, so that rank 0
neither beats nor asks until the rank runs again (``rallypoint.ft._group.stopped``); the
lighthouse would otherwise not believe the notice, take the group back at once, and every
other group would wait in its collectives with the stopped rank until it ran again. Real
processes: ``rallypoint lighthouse``, one ``rallypoint run --nproc-per-node 2`` a group."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import psutil
import pytest
from _groups import (
    finish,
    lighthouse,
    never_back,
    same_parameters,
    start_group,
    steps,
    steps_by_process,
    wait_for_step,
)

STEPS = 60
FAULT = 10
HELD = 3.0


def _rank_process(out: Path, group: int, rank: int) -> int:
    """The pid of ``group``'s worker of ``rank`` (both ranks write the group's steps)."""
    for line in reversed((out / f"steps-{group}").read_text().splitlines()):
        pid = int(line.split()[3])
        if f"rank {rank} " in " ".join(psutil.Process(pid).cmdline()):
            return pid
    raise AssertionError(f"no worker of rank {rank} in group {group}'s steps")


@pytest.mark.timeout(240)
def test_a_stopped_rank_1_leaves_its_group_out_at_once_and_it_comes_back_when_continued(
    tmp_path: Path,
) -> None:
    house = lighthouse("--min_replicas", "1", "--join_timeout_ms", "3000")
    try:
        groups = [
            start_group(tmp_path, g, house.address, STEPS, nproc=2, FT_TOGETHER="3")
            for g in range(3)
        ]
        wait_for_step(tmp_path, 1, FAULT)
        pid = _rank_process(tmp_path, 1, rank=1)
        os.kill(pid, signal.SIGSTOP)
        stopped_at = time.time()
        time.sleep(HELD)
        os.kill(pid, signal.SIGCONT)
        texts = finish(groups)
    finally:
        screen = house.stop()
    said = "\n".join(texts)
    assert all(p.returncode == 0 for p in groups), said[-6000:]
    assert "group 1 left: rank 1 stopped (SIGSTOP)" in screen, screen[-3000:]
    assert "group 1 waits for its rank 1, stopped, to run" in said, said[-3000:]
    for g in (0, 2):  # they stepped while group 1's rank 1 was stopped (before: they waited)
        during = [t for t, _, _ in steps(tmp_path, g) if stopped_at + 1.0 < t < stopped_at + HELD]
        assert len(during) >= 3, (g, during, screen[-3000:])
    for g in range(3):
        never_back(steps(tmp_path, g))
        assert steps(tmp_path, g)[-1][1] == STEPS, (g, steps(tmp_path, g)[-3:])
    assert len(steps_by_process(tmp_path, 1)) == 2  # the same two processes came back
    same_parameters(tmp_path, [0, 1, 2], ranks=2)  # rank by rank
