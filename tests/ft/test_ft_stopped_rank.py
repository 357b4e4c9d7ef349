"""A rank other than rank 0 of a replica group is stopped (SIGSTOP): the other groups go on.

Rank 0's stop stops its group's heartbeat and asks with it; another rank's does not. Its
agent marks it stopped in the group's store before it tells the lighthouse, so that rank 0
neither beats nor asks until the rank runs again (``rallypoint.ft._group.stopped``); the
lighthouse would otherwise not believe the notice, take the group back at once, and every
other group would wait in its collectives with the stopped rank until it ran again. Real
processes: ``rallypoint lighthouse``, one ``rallypoint run --nproc-per-node 2`` a group, or
a group across two nodes (the agent that sees the stop is not rank 0's)."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from datetime import timedelta
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
from torch.distributed import TCPStore

from rallypoint.ft._group.manager_parts import group_store, heal_addresses
from rallypoint.ft._group.stopped import mark, runs_check

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


def _stop_rank(
    tmp_path: Path,
    start: Callable[[int, str], list[subprocess.Popen[str]]] | None = None,
    rank: int = 1,
    ranks: int = 2,
) -> None:
    """Groups 0-2 of ``ranks`` ranks each, started by ``start`` (by default one launcher a
    group); group 1's ``rank`` is stopped for HELD s at step FAULT: the others step on
    meanwhile, and it comes back the same."""
    if start is None:

        def start(group: int, address: str) -> list[subprocess.Popen[str]]:
            return [start_group(tmp_path, group, address, STEPS, nproc=ranks, FT_TOGETHER="3")]

    house = lighthouse("--min_replicas", "1", "--join_timeout_ms", "3000")
    try:
        launchers = [start(g, house.address) for g in range(3)]
        wait_for_step(tmp_path, 1, FAULT)
        pid = _rank_process(tmp_path, 1, rank)
        os.kill(pid, signal.SIGSTOP)
        stopped_at = time.time()
        time.sleep(HELD)
        os.kill(pid, signal.SIGCONT)
        done = iter(finish([p for group in launchers for p in group]))
    finally:
        screen = house.stop()
    said = "\n".join(next(done) for group in launchers for _ in group)
    assert all(p.returncode == 0 for group in launchers for p in group), said[-6000:]
    assert f"group 1 left: rank {rank} stopped (SIGSTOP)" in screen, screen[-3000:]
    # (rank 0 says it waits only when it looks before it asks: one that asked just before
    # the mark is left out by the notice all the same; the line is checked below)
    for g in (0, 2):  # they stepped while group 1's rank 1 was stopped (before: they waited)
        during = [t for t, _, _ in steps(tmp_path, g) if stopped_at + 1.0 < t < stopped_at + HELD]
        assert len(during) >= 3, (g, during, screen[-3000:])
    for g in range(3):
        never_back(steps(tmp_path, g))
        assert steps(tmp_path, g)[-1][1] == STEPS, (g, steps(tmp_path, g)[-3:])
    assert len(steps_by_process(tmp_path, 1)) == ranks  # the same processes came back
    same_parameters(tmp_path, [0, 1, 2], ranks=ranks)  # rank by rank


@pytest.mark.timeout(240)
def test_a_stopped_rank_1_leaves_its_group_out_at_once_and_it_comes_back_when_continued(
    tmp_path: Path,
) -> None:
    _stop_rank(tmp_path)


@pytest.mark.timeout(300)
def test_a_stopped_middle_rank_of_a_group_of_four_leaves_its_group_out_at_once(
    tmp_path: Path,
) -> None:
    """Rank 2 of 4: neither rank 0, whose group store it is, nor the last rank."""
    _stop_rank(tmp_path, rank=2, ranks=4)


@pytest.mark.timeout(300)
def test_a_stopped_rank_on_another_node_than_rank_0_leaves_its_group_out_at_once(
    tmp_path: Path, endpoint: str
) -> None:
    """Group 1 spans two nodes (two launchers of one rank each): the agent that sees its
    rank 1 stop runs on the second node, and marks it in the group's store on the first."""

    def start(group: int, address: str) -> list[subprocess.Popen[str]]:
        if group != 1:
            return [start_group(tmp_path, group, address, STEPS, nproc=2, FT_TOGETHER="3")]
        nodes = ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
                 "--rdzv-conf", "is_host=false", "--rdzv-id", "stopped-1"]  # fmt: skip
        return [start_group(tmp_path, 1, address, STEPS, *nodes, FT_TOGETHER="3") for _ in (0, 1)]

    _stop_rank(tmp_path, start)


@pytest.mark.timeout(60)
def test_rank_0_neither_asks_nor_beats_while_another_rank_is_marked_and_says_so_once(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """The group's side of the marks, on a real TCPStore: rank 0 waits before it asks
    (``heal_addresses``) and skips its beats (``runs_check``) while a rank is marked
    stopped, says so once, goes on once it is marked running, and gives up after ``wait``."""
    master = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    group = group_store("127.0.0.1", master.port, timedelta(seconds=10))
    for rank in range(3):
        mark(group, rank, stopped=False)
        group.set(f"heal/{rank}", f"addr{rank}")
    beats = runs_check(group, 3, 0)
    assert beats is not None and beats()
    mark(group, 2, stopped=True)
    assert not beats()
    got: list[tuple[str, ...]] = []
    asker = threading.Thread(
        target=lambda: got.append(
            heal_addresses(group.clone(), 3, 0, "addr0", timedelta(seconds=10), 20.0, "7")
        )
    )
    asker.start()
    time.sleep(0.6)
    assert not got and asker.is_alive()  # it waits
    mark(group, 2, stopped=False)
    asker.join(10)
    assert got == [("addr0", "addr1", "addr2")] and beats()
    said = capfd.readouterr()
    assert (said.out + said.err).count("group 7 waits for its rank 2, stopped, to run") == 1
    mark(group, 1, stopped=True)
    with pytest.raises(TimeoutError, match="rank 1 of this group stays stopped"):
        heal_addresses(group, 3, 0, "addr0", timedelta(seconds=10), 0.3, "7")
