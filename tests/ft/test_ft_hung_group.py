"""A replica group whose training thread hangs (a deadlock, a stuck data loader) while its
process runs: its heartbeat beats on, so only its silence tells. The lighthouse waits for
it up to ``--join_timeout_ms`` from the round's first ask, then goes on without it (as
torchft's lighthouse does; before, every other group waited for as long as it hung), and
takes it back when it asks again. Real processes: ``rallypoint lighthouse`` and one
``rallypoint run`` a group."""

from __future__ import annotations

import time
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

STEPS = 60
HUNG_AT = 10
HUNG_FOR = 8.0
JOIN_TIMEOUT = 3.0


@pytest.mark.timeout(240)
def test_a_hung_group_is_left_out_after_the_join_timeout_and_taken_back_when_it_runs(
    tmp_path: Path,
) -> None:
    house = lighthouse("--min_replicas", "1", "--join_timeout_ms", str(int(JOIN_TIMEOUT * 1000)))
    try:
        hang = f"1:{HUNG_AT}:{HUNG_FOR}"
        groups = [
            start_group(tmp_path, g, house.address, STEPS, FT_TOGETHER="3", FT_HANG=hang)
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
    same_parameters(tmp_path, [0, 1, 2])
