"""The ``--snapshot-dir`` layout (``_snapshot_dir``): namespaces, who may write one, what a restore
lists and what a prune removes. A live job is a real process holding the namespace."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from rallypoint._snapshot._snapshot_dir import (
    FRESH,
    Checkpoint,
    CheckpointDir,
    live_problem,
    namespace,
    step_name,
)

HOLD = r"""
import sys, time
from rallypoint._snapshot._snapshot_dir import CheckpointDir
d = CheckpointDir(sys.argv[1], sys.argv[2], sys.argv[3])
print(d.claim() or "claimed", flush=True)
time.sleep(60)
"""


def _checkpoint(ns: Path, step: int, *, complete: bool = True) -> None:
    path = ns / step_name(step)
    path.mkdir(parents=True)
    (path / "__0_0.distcp").write_bytes(b"x")
    if complete:
        (path / ".metadata").write_bytes(b"m")


@pytest.fixture
def live(tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    """Another process of job ``other`` (token ``t-other``) holding its namespace."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path), "other", "t-other"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "claimed"
    yield proc
    proc.kill()
    proc.wait()


def test_namespaces_are_safe_names() -> None:
    assert namespace("job-1.a_b") == "run-job-1.a_b"
    assert namespace("../x y") == "run-.._x_y"  # no separator: one directory under DIR


@pytest.mark.timeout(60)
def test_a_live_job_with_the_same_run_id_is_refused_and_its_processes_are_not(
    tmp_path: Path, live: subprocess.Popen[str]
) -> None:
    assert "another job with the same run id" in CheckpointDir(tmp_path, "other", "t-b").claim()
    same_job = CheckpointDir(tmp_path, "other", "t-other")
    assert same_job.claim() == ""  # another process of that job
    assert CheckpointDir(tmp_path, "mine", "t-mine").claim() == ""  # another run id
    live.kill()
    live.wait()
    assert "another job" in CheckpointDir(tmp_path, "other", "t-b").claim()  # same_job lives
    same_job.close()
    assert CheckpointDir(tmp_path, "other", "t-b").claim() == ""  # the job ended: taken over


@pytest.mark.timeout(60)
def test_restore_lists_its_own_the_ended_jobs_and_the_flat_layout_never_a_live_job(
    tmp_path: Path, live: subprocess.Popen[str]
) -> None:
    mine = CheckpointDir(tmp_path, "mine", "t-mine")
    assert mine.claim() == ""
    _checkpoint(mine.own, 30)
    _checkpoint(mine.own, 40, complete=False)
    _checkpoint(tmp_path / "run-other", 50)  # a live job's: another training, never read
    _checkpoint(tmp_path / "run-ended", 30)  # an ended job's: a relaunch resumes from it
    _checkpoint(tmp_path, 20)  # the layout before namespaces
    assert mine.complete() == [
        Checkpoint(30, "run-mine/step-000000000030"),  # a tie goes to this job's own
        Checkpoint(30, "run-ended/step-000000000030", "ended"),
        Checkpoint(20, "step-000000000020", str(tmp_path)),
    ]
    live.kill()
    live.wait()  # now it ended
    assert mine.complete()[0] == Checkpoint(50, "run-other/step-000000000050", "other")


@pytest.mark.timeout(60)
def test_an_explicit_choice_lists_that_source_and_what_this_job_wrote(
    tmp_path: Path, live: subprocess.Popen[str]
) -> None:
    mine = CheckpointDir(tmp_path, "mine", "t-mine")
    assert mine.claim() == ""
    _checkpoint(mine.own, 10)  # an earlier job's with the same run id
    _checkpoint(mine.own, 12)
    mine.mark_written(12)  # this job's
    for step in (20, 30):
        _checkpoint(tmp_path / "run-ended", step)
    _checkpoint(tmp_path / "run-newer", 90)
    _checkpoint(tmp_path / "run-other", 40)
    own = Checkpoint(12, "run-mine/step-000000000012")
    assert mine.complete(FRESH) == [own]
    assert mine.complete("ended") == [
        Checkpoint(30, "run-ended/step-000000000030", "ended"),
        Checkpoint(20, "run-ended/step-000000000020", "ended"),
        own,
    ]
    one = tmp_path / "run-ended" / "step-000000000020"
    assert mine.complete(str(one)) == [Checkpoint(20, "run-ended/step-000000000020", "ended"), own]
    assert mine.complete("mine") == [own, Checkpoint(10, "run-mine/step-000000000010")]
    # a live job is refused by name, and a name with nothing is said
    assert mine.complete("other") == [own]
    assert "job 'other' is still running" in mine.refusal("other")
    assert mine.refusal("ended") == ""
    assert mine.complete("nobody") == [own]


@pytest.mark.timeout(60)
def test_prune_keeps_two_of_its_own_and_never_touches_another_training(
    tmp_path: Path, live: subprocess.Popen[str]
) -> None:
    mine = CheckpointDir(tmp_path, "mine", "t-mine")
    assert mine.claim() == ""
    for step in (10, 20, 30):
        _checkpoint(mine.own, step)
    _checkpoint(mine.own, 35, complete=False)
    for step in (5, 50):
        _checkpoint(tmp_path / "run-other", step)
    _checkpoint(tmp_path / "run-other", 60, complete=False)  # being written by a live job
    _checkpoint(tmp_path / "run-ended", 5)  # an ended job's this job resumed from: superseded
    mine.record_resume(Checkpoint(5, "run-ended/step-000000000005", "ended"))
    _checkpoint(tmp_path / "run-unrelated", 6)  # an ended job's: another training, kept
    _checkpoint(tmp_path / "run-unrelated", 7, complete=False)  # but not its partial one
    _checkpoint(tmp_path / "run-ended-newer", 25)  # newer than this job's oldest kept one
    mine.record_resume(Checkpoint(25, "run-ended-newer/step-000000000025", "ended-newer"))
    _checkpoint(tmp_path / "run-ended-newer", 26, complete=False)
    _checkpoint(tmp_path, 1)  # flat layout, older, not resumed from
    mine.prune()
    left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("step-*"))
    assert left == [
        "run-ended-newer/step-000000000025",
        "run-mine/step-000000000020",
        "run-mine/step-000000000030",
        "run-other/step-000000000005",
        "run-other/step-000000000050",
        "run-other/step-000000000060",
        "run-unrelated/step-000000000006",
        "step-000000000001",
    ]
    assert not (tmp_path / "run-ended").exists()


def test_a_failed_save_removes_its_partial_directory(tmp_path: Path) -> None:
    mine = CheckpointDir(tmp_path, "mine", "t-mine")
    assert mine.claim() == ""
    _checkpoint(mine.own, 10)
    _checkpoint(mine.own, 20, complete=False)
    _checkpoint(tmp_path / "run-crashed", 15, complete=False)
    mine.remove_partial(20)
    assert sorted(p.name for p in tmp_path.rglob("step-*")) == ["step-000000000010"]


@pytest.mark.timeout(60)
def test_an_explicit_choice_with_nothing_to_offer_fails_the_restore(
    tmp_path: Path, live: subprocess.Popen[str]
) -> None:
    from rallypoint._snapshot._persist import Persister
    from rallypoint._snapshot._report import Reporter
    from rallypoint.snapshot import SnapshotError

    def persister(resume_from: str) -> Persister:
        return Persister(str(tmp_path), 2, rank=0, world=1, run_id="mine", token="t-mine",
                         report=Reporter(), resume_from=resume_from)  # fmt: skip

    _checkpoint(tmp_path / "run-other", 40)
    with pytest.raises(SnapshotError, match=r"no complete checkpoint in .*run-nobody"):
        persister("nobody").complete()
    with pytest.raises(SnapshotError, match="job 'other' is still running"):
        persister("other").complete()
    assert persister(FRESH).complete() == []  # a fresh start
    assert persister("").complete() == []  # a live job's checkpoints are never offered


@pytest.mark.timeout(60)
def test_a_second_job_with_a_live_jobs_run_id_restores_none_of_its_checkpoints(
    tmp_path: Path, live: subprocess.Popen[str]
) -> None:
    """The launcher refuses such a one-node job (``live_problem``); a process that gets
    this far anyway (a node of a multi-node job that is not the live one) is refused as a
    writer and offered only what its own job wrote."""
    _checkpoint(tmp_path / "run-other", 40)  # the live job's
    _checkpoint(tmp_path / "run-ended", 30)
    assert live_problem(tmp_path, "other") == (
        f"--rdzv-id other: a job with this run id is running and writing {tmp_path}/run-other "
        f"(--snapshot-dir {tmp_path}); this one would restore its checkpoints: give it its "
        "own --rdzv-id, or start it once that job ended"
    )
    assert live_problem(tmp_path, "ended") == ""  # no process holds it
    assert live_problem(tmp_path, "new") == ""  # no namespace yet
    second = CheckpointDir(tmp_path, "other", "t-second")
    assert "another job with the same run id" in second.claim()
    ended = Checkpoint(30, "run-ended/step-000000000030", "ended")
    assert second.complete() == [ended]  # never the live job's step 40
    assert second.complete("other") == []
    assert CheckpointDir(tmp_path, "other", "t-other").complete() == [  # the live job's own
        Checkpoint(40, "run-other/step-000000000040"),
        ended,
    ]
    live.kill()
    live.wait()
    assert live_problem(tmp_path, "other") == ""  # it ended: a relaunch resumes from it
