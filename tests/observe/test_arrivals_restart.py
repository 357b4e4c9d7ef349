"""Straggler arrivals across an in-process restart, and events that cannot be written.

A worker kept by an in-process restart still holds the previous attempt's collectives in
its Flight Recorder, numbered from 1 as the new attempt's are: judged together, its
replaced peer seemed to arrive seconds late at every collective, with an infinite pace
ratio, and writing that ``straggler`` event ended a healthy job with exit status 2. Each
attempt is judged on its own collectives, a verdict's ratio is finite, and the agent's
events never end a job.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from _support import cli_zygote
from rallypoint._watch._flight._records import FlightEntry, GroupTrace, RankTrace
from rallypoint._watch._observer import Observer
from rallypoint._watch._stragglers._arrival_watch import ArrivalWatch, describe_arrival
from rallypoint._watch._stragglers._arrivals import MAX_RATIO, is_straggler, judge_arrivals
from rallypoint.launcher import LaunchConfig

MS = 1_000_000


def _group(entries: list[FlightEntry]) -> GroupTrace:
    return GroupTrace("0", (0, 1), len(entries), len(entries), tuple(entries), True)


def _steps(start_ns: int, n: int, late_ns: int = 0) -> list[FlightEntry]:
    """``n`` all_reduces 100 ms apart from ``start_ns``, numbered from 1."""
    return [
        FlightEntry(
            seq, "all_reduce", ((4,),), ("Float",), start_ns + seq * 100 * MS + late_ns, True
        )
        for seq in range(1, n + 1)
    ]


class _Answered:
    def __init__(self, traces: Mapping[int, RankTrace]) -> None:
        self.traces = dict(traces)

    def ready(self) -> bool:
        return True

    def results(self, timeout: float) -> dict[int, RankTrace]:
        return self.traces


# ---------------------------------------------------------------------------- the verdict
@pytest.mark.timeout(10)
def test_a_rank_the_others_wait_for_all_the_time_gets_a_finite_ratio() -> None:
    # rank 1 arrives 99 ms after rank 0 at collectives 100 ms apart: the lag intervals
    # cover the whole span, and D / (D - W) had no denominator
    traces = {
        0: RankTrace(0, (_group(_steps(0, 30)),)),
        1: RankTrace(1, (_group(_steps(0, 30, late_ns=100 * MS)),)),
    }
    verdict = judge_arrivals(traces, window_s=30)
    assert verdict is not None and verdict.rank == 1
    assert math.isfinite(verdict.ratio) and verdict.ratio == MAX_RATIO
    assert is_straggler(verdict, 1.5)
    assert "its pace is over 1000x theirs" in describe_arrival(verdict, "h", 1.5)
    json.dumps({"ratio": verdict.ratio}, allow_nan=False)  # an event can hold it
    together = {r: RankTrace(r, (_group(_steps(0, 30)),)) for r in (0, 1)}
    assert judge_arrivals(together, window_s=30).ratio == 1.0  # type: ignore[union-attr]


@pytest.mark.timeout(10)
def test_a_kept_ranks_previous_attempt_is_not_compared_with_the_new_one() -> None:
    """Rank 0 was kept: its recorder holds attempt 0's 30 collectives and attempt 1's 20,
    both numbered from 1; rank 1 was replaced and holds attempt 1's only."""
    restart_ns = time.time_ns() - 3_000 * MS
    old = _steps(restart_ns - 3_100 * MS, 30)
    new = _steps(restart_ns, 20)
    traces = {0: RankTrace(0, (_group(old + new),)), 1: RankTrace(1, (_group(new),))}
    said: list[str] = []
    events: list[tuple[str, dict[str, Any]]] = []

    def watch(since_ns: int | None) -> ArrivalWatch:
        return ArrivalWatch(
            lambda running: _Answered(traces), threshold=1.5, recover_at=1.25, host="h",
            round=1, group_rank=0, nnodes=1, window_s=30, every=1.0, say=said.append,
            emit=lambda kind, **f: events.append((kind, f)), clock=time.monotonic,
            since_ns=since_ns,
        )  # fmt: skip

    blind = watch(None)  # what every attempt's watch did before
    blind.ask({0: 100, 1: 101})
    blind.read({0: 100, 1: 101})
    assert said and "rank 1 on h arrives last at 20 of 20 collectives" in said[0], said
    said.clear()
    events.clear()
    attempt = watch(restart_ns)
    attempt.ask({0: 100, 1: 101})
    attempt.read({0: 100, 1: 101})
    assert said == [], said
    [(kind, lags)] = events
    assert kind == "arrival_lags" and all(abs(v) < 0.001 for v in lags["lag_s"].values()), lags


# ---------------------------------------------------------------------------- the events
@pytest.mark.timeout(30)
def test_an_event_that_cannot_be_written_never_ends_the_job(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "events.jsonl"
    observer = Observer(nproc=1, watch=LaunchConfig(events=str(path)).watch, node="h")
    try:
        observer.emit("straggler", ratio=math.inf, lag_s={"0": math.nan, "1": [1.5, -math.inf]})
        observer.emit("odd", what=object())
        observer.emit("odd", what=object())  # said once per kind
        observer.emit("round", round=1)
    finally:
        observer.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [e["kind"] for e in lines] == ["straggler", "round"]
    assert lines[0]["ratio"] is None and lines[0]["lag_s"] == {"0": None, "1": [1.5, None]}
    err = capfd.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("rallypoint: warning: a 'odd' event was not"), err
    assert "the job goes on" in err[0]


# ---------------------------------------------------------------------------- a real job
TRAIN = """
import os, signal, sys, time
import torch, torch.distributed as dist
import rallypoint

def train():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    t = torch.ones(4)
    for step in range(int(sys.argv[1])):
        time.sleep(0.1)
        dist.all_reduce(t)
        rallypoint.progress()
        if restart == 0 and step == 20 and rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
    dist.destroy_process_group()

rallypoint.restartable(train)()
"""


@pytest.mark.timeout(120)
def test_an_in_process_restart_with_events_ends_well_and_names_no_straggler(
    tmp_path: Path,
) -> None:
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    events = tmp_path / "events.jsonl"
    cmd = [
        sys.executable, "-m", "rallypoint", "run", "--nproc-per-node", "2", "--max-restarts",
        "1", "--straggler-window", "3", "--events", str(events), str(script), "60",
    ]  # fmt: skip
    proc = cli_zygote.run(cmd, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr
    assert "in-process restart 1 of 1: rank 0 kept" in proc.stderr, proc.stderr
    assert "straggler:" not in proc.stderr, proc.stderr
    written = [json.loads(line) for line in events.read_text().splitlines()]
    assert not [e for e in written if e["kind"] == "straggler"], written
    judged = [e for e in written if e["kind"] == "arrival_lags" and e["round"] == 1]
    assert judged, "the restarted attempt's arrivals were judged"
