"""rallypoint report: replica groups' participation from rallypoint.ft's quorum events.

Three groups, each writing its own events file as each group's ``rallypoint run --events``
does; group 1 dies, the others go on in a quorum of two, and group 1 comes back healed.
(tests/ft/test_ft_quorum.py checks the same from real groups.)
"""

from __future__ import annotations

from pathlib import Path

import pytest

from rallypoint._cli._report import report_main
from rallypoint.observe._events import EventLog, read_events
from rallypoint.observe._participation import build_participation
from rallypoint.observe._timeline import build_timeline

T0 = 1_700_000_000.0


def _write(directory: Path) -> list[Path]:
    now = [T0]
    paths = [directory / f"group{g}.jsonl" for g in range(3)]
    logs = [EventLog(p, node=f"host{g}", clock=lambda: now[0]) for g, p in enumerate(paths)]

    def quorum(groups: list[str], q: int, step: int, **fields: object) -> None:
        for g in groups:  # every member writes the quorum it is in
            logs[int(g)].emit(
                "quorum", group=g, quorum=q, step=step, groups=groups, healing=False,
                left=fields.get("left", {}), joined=fields.get("joined", {}),
            )  # fmt: skip

    quorum(["0", "1", "2"], 1, 0)
    now[0] += 3.0
    logs[1].emit("worker_exit", rank=0, local_rank=0, pid=7, exitcode=-9, signal="SIGKILL")
    now[0] += 0.05
    quorum(["0", "2"], 2, 20, left={"1": "rank 0 killed by SIGKILL"})
    now[0] += 1.2
    quorum(["0", "1", "2"], 3, 28, joined={"1": 0})
    logs[1].emit("heal", group="1", source="0", step=28, bytes=1_200_000, seconds=0.01)
    now[0] += 2.0
    for log in logs:
        log.emit("job_end", status="SUCCEEDED", exitcode=0)
        log.close()
    return paths


def test_each_quorum_once_each_group_in_and_out_and_its_heal(tmp_path: Path) -> None:
    events = read_events(_write(tmp_path))
    part = build_participation(events, T0, 6.25)
    assert part is not None
    assert part.groups == ["0", "1", "2"]
    assert [c.label for c in part.changes] == [
        "quorum 1: groups 0, 1, 2",
        "quorum 2: groups 0, 2 (group 1 left: rank 0 killed by SIGKILL)",
        "quorum 3: groups 0, 1, 2 (group 1 joined at step 0)",
    ]
    ones = [(s.start, s.end) for s in part.spans if s.group == "1"]
    assert ones == [pytest.approx((0.0, 3.05)), pytest.approx((4.25, 6.25))]  # out 3.05-4.25
    assert [s.group for s in part.spans].count("0") == 3
    (heal,) = part.heals
    assert (heal.group, heal.t) == ("1", pytest.approx(4.25))
    assert heal.label == "group 1 healed from group 0 at step 28 (1.2 MB in 0.01 s)"


def test_the_report_draws_the_groups_with_their_tooltips(tmp_path: Path) -> None:
    paths = _write(tmp_path)
    page = tmp_path / "job.svg"
    assert report_main([*map(str, paths), "-o", str(page)]) == 0
    svg = page.read_text()
    assert svg.count('<g id="quorum-span-') == 8  # 3 + 2 + 3 groups in the three quorums
    assert "group 1 left: rank 0 killed by SIGKILL" in svg
    assert "group 1 healed from group 0 at step 28" in svg
    assert "replica groups in each step&#x27;s quorum" in svg or "each step's quorum" in svg


def test_who_left_is_taken_from_one_quorum_to_the_next_with_any_writers_reason(
    tmp_path: Path,
) -> None:
    """Each group writes a quorum against the last one it was in: the first to write it
    (group 3, which joined after group 1 had left) names nobody as left; another does."""
    path = tmp_path / "ev.jsonl"
    with EventLog(path, node="a") as log:
        log.emit("quorum", group="0", quorum=1, step=0, groups=["0", "1"], left={}, joined={})
        log.emit("quorum", group="3", quorum=2, step=9, groups=["0", "3"], left={}, joined={})
        log.emit("quorum", group="0", quorum=2, step=9, groups=["0", "3"],
                 left={"1": "rank 0 killed by SIGKILL"}, joined={"3": 0})  # fmt: skip
    part = build_participation(read_events(path), 0.0, 1.0)
    assert part is not None
    assert part.changes[1].label == (
        "quorum 2: groups 0, 3 (group 1 left: rank 0 killed by SIGKILL; group 3 joined at step 0)"
    )


def test_a_group_back_before_the_next_quorum_left_and_joined(tmp_path: Path) -> None:
    """Group 1 restarted so fast that it is in the very next quorum: the writers that were in
    the last one say it left (its old incarnation did), so the change says both."""
    path = tmp_path / "ev.jsonl"
    killed = {"1": "rank 0 killed by SIGKILL", "2": "rank 0 killed by SIGKILL"}
    with EventLog(path, node="a") as log:
        log.emit("quorum", group="0", quorum=2, step=1, groups=["0", "1", "2", "3"])
        log.emit("quorum", group="0", quorum=3, step=10, groups=["0", "1", "3"],
                 left=killed, joined={"1": 10})  # fmt: skip
        log.emit("quorum", group="1", quorum=3, step=10, groups=["0", "1", "3"], left={})
    part = build_participation(read_events(path), 0.0, 1.0)
    assert part is not None
    assert part.changes[1].label == (
        "quorum 3: groups 0, 1, 3 (group 1 left: rank 0 killed by SIGKILL; "
        "group 2 left: rank 0 killed by SIGKILL; group 1 joined at step 10)"
    )


def test_a_job_without_quorums_has_no_group_lanes(tmp_path: Path) -> None:
    path = tmp_path / "plain.jsonl"
    with EventLog(path, node="a") as log:
        log.emit("worker_start", rank=0, local_rank=0, pid=1)
        log.emit("worker_exit", rank=0, local_rank=0, pid=1, exitcode=0)
    assert build_timeline(read_events(path)).groups is None


def test_malformed_quorum_events_are_skipped_not_fatal(tmp_path: Path) -> None:
    path = tmp_path / "odd.jsonl"
    with EventLog(path, node="a") as log:
        log.emit("quorum", group="0", quorum=1, groups="not a list")
        log.emit("quorum", group="0", quorum=2, groups=["0"], left=["not", "a", "dict"])
        log.emit("heal", source="0")  # no group: nowhere to draw it
    part = build_participation(read_events(path), 0.0, 1.0)
    assert part is not None and part.groups == ["0"] and part.heals == []
    assert [c.label for c in part.changes] == ["quorum 2: group 0"]
