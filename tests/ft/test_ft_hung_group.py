"""A replica group whose training thread hangs (a deadlock, a stuck data loader) while its
process runs: its heartbeat beats on, so only its silence tells. The lighthouse waits for
it up to ``--join_timeout_ms`` from the round's first ask, then goes on without it (as
torchft's lighthouse does; before, every other group waited for as long as it hung), and
takes it back when it asks again. In a group of two ranks, a hung rank 1 leaves rank 0
running: rank 0 asks only once every rank of its group began the step
(``rallypoint.ft._group.ready``; before, the others stood still with the hung rank). Real
processes: ``rallypoint lighthouse`` and one ``rallypoint run`` a group."""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import pytest
from _groups import (
    finish,
    lighthouse,
    longest_pause,
    never_back,
    same_parameters,
    start_group,
    steps,
    wait_for_step,
)
from torch.distributed import TCPStore

from rallypoint.ft._group.manager_parts import group_store
from rallypoint.ft._group.ready import count_in, until_ready

STEPS = 60
HUNG_AT = 10
HUNG_FOR = 8.0
JOIN_TIMEOUT = 3.0


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("nproc", "hung"), [(1, ""), (2, ":1")], ids=["one_rank", "its_rank_1"])
def test_a_hung_group_is_left_out_after_the_join_timeout_and_taken_back_when_it_runs(
    tmp_path: Path, nproc: int, hung: str
) -> None:
    house = lighthouse("--min_replicas", "1", "--join_timeout_ms", str(int(JOIN_TIMEOUT * 1000)))
    try:
        hang = f"1:{HUNG_AT}:{HUNG_FOR}{hung}"
        groups = [
            start_group(
                tmp_path, g, house.address, STEPS, nproc=nproc, FT_TOGETHER="3", FT_HANG=hang
            )
            for g in range(3)
        ]
        wait_for_step(tmp_path, 1, HUNG_AT)
        hung_at = time.time()
        texts = finish(groups)
    finally:
        screen = house.stop()
    said = "\n".join(texts)
    assert all(p.returncode == 0 for p in groups), said[-6000:]
    assert "goes on without group 1: alive, but it has not asked in" in screen, screen[-3000:]
    assert "(group 1 left: did not ask in time)" in screen, screen[-3000:]
    for g in (0, 2):  # they went on while group 1 stood still
        rows = steps(tmp_path, g)
        worst, median = longest_pause(rows, HUNG_AT - 1)
        assert worst < JOIN_TIMEOUT + 3 * median + 1.5, (g, worst, median, screen[-3000:])
        during = [t for t, _, _ in rows if hung_at + JOIN_TIMEOUT + 1.0 < t < hung_at + HUNG_FOR]
        assert len(during) >= 3, (g, during, screen[-3000:])
    for g in range(3):
        never_back(steps(tmp_path, g))
        assert steps(tmp_path, g)[-1][1] == STEPS, (g, steps(tmp_path, g)[-3:])
    assert any(n == 3 for _, s, n in steps(tmp_path, 0) if s > HUNG_AT + 5)  # taken back
    same_parameters(tmp_path, [0, 1, 2], ranks=nproc)  # rank by rank


@pytest.mark.timeout(60)
def test_rank_0_asks_once_every_rank_began_the_step_and_says_which_count_did_not() -> None:
    """The group's side, on a real TCPStore: each other rank counts itself in; rank 0
    goes on once all did, deletes the step before's count, and gives up after ``wait``
    with one line that says how many began."""
    master = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    group = group_store("127.0.0.1", master.port, timedelta(seconds=10))
    for seq in (0, 1):
        count_in(group, "7:ab", seq, 3)
        count_in(group, "7:ab", seq, 3)
        until_ready(group, "7:ab", seq, 3, 5.0, "7")
    assert not group.check(["ready/7:ab/0"]) and group.check(["ready/7:ab/1/all"])
    count_in(group, "7:ab", 2, 3)  # rank 2 is hung
    began = time.monotonic()
    with pytest.raises(TimeoutError) as caught:
        until_ready(group, "7:ab", 2, 3, 0.3, "7")
    assert time.monotonic() - began < 5.0
    assert "group 7: 1 of its 2 other rank(s) began step 2 within 0.3 s" in str(caught.value)
    count_in(group, "8:cd", 0, 3)  # another life of the group: its own count
    with pytest.raises(TimeoutError, match="1 of its 2 other"):
        until_ready(group, "8:cd", 0, 3, 0.2, "8")
    until_ready(group, "7:ab", 9, 1, 0.0, "7")  # a group of one rank waits for nobody
