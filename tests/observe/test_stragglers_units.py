"""Straggler detection on synthetic heartbeats: the window, the verdicts, the exchange
between nodes, bad input, and the report's step-time lanes (no processes, no timing)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path

import pytest

from rallypoint._cli._args import config_from_args
from rallypoint._cli._parser import UsageError, build_parser
from rallypoint._cli._report import report_main
from rallypoint._core.torch_c import HashStore
from rallypoint._watch._flight._records import RankTrace
from rallypoint._watch._stragglers._pace import (
    NodePace,
    PaceWindow,
    RankPace,
    StragglerDetector,
    lower_median,
    median,
    parse_threshold,
)
from rallypoint._watch._stragglers._watch import StragglerWatch, describe, pace_key
from rallypoint.launcher import LaunchConfig
from rallypoint.observe._events import EventLog, read_events
from rallypoint.observe._report import render_report
from rallypoint.observe._timeline import build_timeline


def _node(g: int, paces: dict[int, float], *, seq: int = 1, running: int | None = None) -> NodePace:
    ranks = tuple(RankPace(r, s, 10) for r, s in paces.items())
    n = len(paces) if running is None else running
    return NodePace(g, f"host{g}", seq, ranks, n)


# ---------------------------------------------------------------------------- the verdicts
def test_a_slow_rank_is_reported_once_per_episode() -> None:
    det = StragglerDetector(1.5)
    fast = {0: 0.10, 1: 0.11, 3: 0.09}
    first = det.update([_node(0, {**fast, 2: 0.30})])
    assert [(c.scope, c.key, c.slow) for c in first] == [("rank", 2, True)]
    assert first[0].median_s == pytest.approx(0.10) and first[0].ratio == pytest.approx(3.0)
    for _ in range(5):  # still slow: nothing new
        assert det.update([_node(0, {**fast, 2: 0.30})]) == []
    # inside the hysteresis band (1.25 < 1.4 <= 1.5): neither slow again nor recovered
    assert det.update([_node(0, {**fast, 2: 0.14})]) == []
    assert det.is_slow("rank", 2)
    recovered = det.update([_node(0, {**fast, 2: 0.10})])
    assert [(c.key, c.slow) for c in recovered] == [(2, False)]
    again = det.update([_node(0, {**fast, 2: 0.40})])  # a new episode is a new report
    assert [(c.key, c.slow) for c in again] == [(2, True)]


def test_two_ranks_name_the_slow_one_and_equal_ranks_are_never_slow() -> None:
    det = StragglerDetector(1.5)
    changes = det.update([_node(0, {0: 0.1, 1: 0.2})])
    assert [(c.key, c.slow) for c in changes] == [(1, True)]
    det = StragglerDetector(1.5)
    assert det.update([_node(0, {r: 0.25 for r in range(8)})]) == []
    assert det.update([_node(0, {0: 0.5})]) == []  # one rank: nothing to compare with


def test_a_node_whose_ranks_are_all_slow_is_reported_as_one_node() -> None:
    det = StragglerDetector(2.0)
    nodes = [_node(0, {0: 0.1, 1: 0.1}), _node(1, {2: 0.5, 3: 0.45}), _node(2, {4: 0.1, 5: 0.12})]
    changes = det.update(nodes)
    assert [(c.scope, c.key, c.ranks, c.host) for c in changes] == [("node", 1, (2, 3), "host1")]
    assert changes[0].step_s == pytest.approx(0.45)  # the node's lower median
    line = describe(changes[0], 2.0)
    assert (
        line.count("\n") == 1
        and "node 1 (host1, ranks 2,3)" in line
        and "--straggler-threshold 2" in line
    )


def test_one_slow_rank_on_a_node_is_a_rank_straggler_not_a_node() -> None:
    det = StragglerDetector(1.5)
    changes = det.update([_node(0, {0: 0.1, 1: 0.1}), _node(1, {2: 0.1, 3: 0.4})])
    assert [(c.scope, c.key, c.group_rank, c.host) for c in changes] == [("rank", 3, 1, "host1")]


def test_a_node_is_judged_as_a_node_only_once_all_its_ranks_are_measured() -> None:
    det = StragglerDetector(1.5)
    half = [_node(0, {0: 0.1, 1: 0.1}), _node(1, {2: 0.5}, running=2)]
    assert [(c.scope, c.key) for c in det.update(half)] == [("rank", 2)]
    whole = [_node(0, {0: 0.1, 1: 0.1}), _node(1, {2: 0.5, 3: 0.5}, seq=2)]
    assert [(c.scope, c.key, c.slow) for c in det.update(whole)] == [("node", 1, True)]


def test_medians() -> None:
    assert median([3.0, 1.0, 2.0]) == 2.0 and median([4.0, 1.0]) == 2.5
    assert lower_median([4.0, 1.0]) == 1.0 and lower_median([5.0, 1.0, 3.0, 2.0]) == 2.0
    with pytest.raises(ValueError):
        median([])
    with pytest.raises(ValueError):
        lower_median([])


# ---------------------------------------------------------------------------- the window
def test_window_measures_the_mean_step_between_progress_calls() -> None:
    win = PaceWindow(2, window_s=10.0, min_steps=5)
    win.add(1.0, [(1.0, 1), (0.0, 0)])
    assert win.step_time(0, 1.0) is None  # one sample
    win.add(3.0, [(2.9, 20), (0.0, 0)])
    step, steps = win.step_time(0, 3.0)  # type: ignore[misc]
    assert steps == 19 and step == pytest.approx(1.9 / 19)
    assert win.step_time(1, 3.0) is None  # never reported
    win.add(5.0, [(3.0, 21), (0.0, 0)])  # one step in 2 s: the open step counts
    step, _ = win.step_time(0, 5.0)  # type: ignore[misc]
    assert step == pytest.approx((3.0 - 1.0 + 2.0) / 21)
    win.add(6.0, [(0.0, 0), (0.0, 0)])  # board reset (a new attempt): history dropped
    win.add(7.0, [(6.5, 1), (0.0, 0)])
    assert win.step_time(0, 7.0) is None


def test_window_forgets_what_is_older_than_the_window() -> None:
    win = PaceWindow(1, window_s=4.0, min_steps=2)
    for t in range(1, 11):  # 10 steps per second for 10 s, then 1 step per second
        win.add(float(t), [(float(t), 10 * t)])
    for t in range(11, 21):
        win.add(float(t), [(float(t), 100 + t - 10)])
    step, steps = win.step_time(0, 20.0)  # type: ignore[misc]
    assert step == pytest.approx(1.0) and steps <= 5


# ---------------------------------------------------------------------------- the exchange
class _Board:
    def __init__(self, nslots: int) -> None:
        self.nslots = nslots
        self.slots = [(0.0, 0)] * nslots

    def sample(self) -> list[tuple[float, int]]:
        return list(self.slots)


def _watch(
    board: _Board, g: int, clock: list[float], said: list[str], events: list[dict[str, object]]
) -> StragglerWatch:
    return StragglerWatch(
        board,  # type: ignore[arg-type]
        threshold=1.5,
        host=f"host{g}",
        round=3,
        rank_offset=2 * g,
        emit=lambda kind, **kw: events.append({"kind": kind, **kw}),
        say=said.append,
        group_rank=g,
        nnodes=2,
        window_s=5.0,
        clock=lambda: clock[0],
    )


def _step(boards: Sequence[_Board], t: float, per_step: dict[int, float]) -> None:
    for g, board in enumerate(boards):
        board.slots = [(t, int(t / per_step[2 * g + s])) for s in range(board.nslots)]


def test_nodes_exchange_summaries_and_node_zero_reports_once() -> None:
    clock = [0.0]
    store = HashStore()
    boards = [_Board(2), _Board(2)]
    said: list[list[str]] = [[], []]
    events: list[list[dict[str, object]]] = [[], []]
    watches = [_watch(boards[g], g, clock, said[g], events[g]) for g in range(2)]
    per_step = {0: 0.1, 1: 0.1, 2: 0.1, 3: 0.5}
    for tick in range(1, 21):
        clock[0] = tick * 1.0
        _step(boards, clock[0], per_step)
        for w in watches:
            w.exchange(store, running={0, 1, 2, 3})
    assert store.check([pace_key(3, 1)]) and json.loads(store.get(pace_key(3, 1)))["n"] == 2
    assert said[1] == [] and events[1] == []  # only node 0 judges
    assert len(said[0]) == 1 and "rank 3 on host1" in said[0][0]
    slow = [e for e in events[0] if e["kind"] == "straggler"]
    assert len(slow) == 1
    assert slow[0]["rank"] == 3 and slow[0]["group_rank"] == 1 and slow[0]["state"] == "slow"
    assert slow[0]["round"] == 3 and slow[0]["median_s"] == pytest.approx(0.1, rel=0.05)
    times = [e for e in events[0] if e["kind"] == "step_times"]
    assert times and set(times[-1]["step_s"]) == {"0", "1", "2", "3"}  # type: ignore[arg-type]


def test_a_garbled_or_stale_summary_is_left_out() -> None:
    clock = [0.0]
    store = HashStore()
    boards = [_Board(2), _Board(2)]
    said: list[str] = []
    events: list[dict[str, object]] = []
    w0 = _watch(boards[0], 0, clock, said, events)
    per_step = {0: 0.1, 1: 0.1, 2: 0.5, 3: 0.5}
    store.set(pace_key(3, 1), b"{not json")
    for tick in range(1, 11):
        clock[0] = tick * 1.0
        _step(boards, clock[0], per_step)
        w0.exchange(store, running={0, 1})
    assert said == []  # node 1's record is garbled: nothing to judge against
    # a record that never changes (its node stopped publishing) stops counting
    store.set(pace_key(3, 1), _node(1, {2: 0.9, 3: 0.9}, seq=7).to_json())
    for tick in range(11, 31):
        clock[0] = tick * 1.0
        _step(boards, clock[0], per_step)
        w0.exchange(store, running={0, 1})
    assert len(said) == 1 and "node 1" in said[0]  # judged while fresh, once
    assert [e["state"] for e in events if e["kind"] == "straggler"] == ["slow"]


def test_node_pace_round_trip_and_garbage() -> None:
    pace = _node(4, {8: 0.125, 9: 0.25})
    assert NodePace.from_json(pace.to_json()) == pace
    for raw in [b"", b"[]", b'{"g": 1}', b'{"g":1,"host":"h","seq":1,"n":1,"ranks":[[1,"x",2]]}',
                b'{"g":1,"host":"h","seq":1,"n":1,"ranks":[[1,-1.0,2]]}']:  # fmt: skip
        with pytest.raises(ValueError, match="not a node pace summary"):
            NodePace.from_json(raw)


# ---------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("value", [1, 1.0, 0, 0.5, -2, "abc", "", "nan", "inf", math.nan])
def test_threshold_must_be_above_one(value: object) -> None:
    with pytest.raises(ValueError, match="straggler_threshold must be a number greater than 1"):
        LaunchConfig(straggler_threshold=value)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [True, [2.0], b"2"])
def test_threshold_type(value: object) -> None:
    with pytest.raises(TypeError, match="straggler_threshold must be a number greater than 1"):
        LaunchConfig(straggler_threshold=value)  # type: ignore[arg-type]


def test_threshold_and_window_good_values() -> None:
    cfg = LaunchConfig()
    assert cfg.straggler_threshold == 1.5 and cfg.straggler_window == timedelta(seconds=30)
    assert LaunchConfig(straggler_threshold="off").straggler_threshold is None
    assert LaunchConfig(straggler_threshold=None).straggler_threshold is None
    assert LaunchConfig(straggler_threshold="2.5").straggler_threshold == 2.5
    assert LaunchConfig(straggler_window=5).straggler_window == timedelta(seconds=5)
    assert parse_threshold(" OFF ") is None


@pytest.mark.parametrize(
    ("value", "exc", "match"),
    [
        (timedelta(0), ValueError, "straggler_window must be"),
        (-1.0, ValueError, "straggler_window must be"),
        (0.1, ValueError, "straggler_window must be at least 0.5 s"),
        ("10", TypeError, "straggler_window"),
    ],
)
def test_bad_window(value: object, exc: type[Exception], match: str) -> None:
    with pytest.raises(exc, match=match):
        LaunchConfig(straggler_window=value)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--straggler-threshold", "1"], "--straggler-threshold must be a number greater than 1"),
        (["--straggler-threshold", "fast"], "got 'fast'"),
        (["--straggler-window", "0"], "--straggler-window/--straggler_window: must be > 0, got 0"),
        (["--straggler-window", "x"], "invalid float value"),
    ],
)
def test_cli_bad_input(tmp_path: Path, argv: list[str], match: str) -> None:
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    with pytest.raises((UsageError, ValueError, TypeError, SystemExit), match=match):
        config_from_args(build_parser().parse_args([*argv, str(script)]))


def test_cli_options_and_pet_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    argv = ["--straggler_threshold", "3", "--straggler-window", "4", str(script)]
    cfg, _ = config_from_args(build_parser().parse_args(argv))
    assert cfg.straggler_threshold == 3.0 and cfg.straggler_window == timedelta(seconds=4)
    monkeypatch.setenv("PET_STRAGGLER_THRESHOLD", "off")
    cfg, _ = config_from_args(build_parser().parse_args([str(script)]))
    assert cfg.straggler_threshold is None


# ---------------------------------------------------------------------------- the report
def _job_with_a_straggler(path: Path) -> None:
    now = [1_700_000_000.0]
    log = EventLog(path, node="nodeA", clock=lambda: now[0])
    log.emit("round", round=0, world_size=3, run_id="slowjob")
    for rank in range(3):
        log.emit("worker_start", rank=rank, local_rank=rank, round=0, pid=100 + rank)
    for i in range(6):
        now[0] += 2.0
        slow = 0.1 if i < 2 else 0.45
        log.emit("step_times", round=0, step_s={"0": 0.1, "1": slow, "2": 0.11}, median_s=0.11)
        if i == 2:
            log.emit(
                "straggler",
                rank=1,
                round=0,
                scope="rank",
                state="slow",
                host="nodeA",
                group_rank=0,
                ranks=[1],
                step_s=0.45,
                median_s=0.105,
                threshold=1.5,
            )
    now[0] += 1.0
    for rank in range(3):
        log.emit("worker_exit", rank=rank, round=0, exitcode=0)
    log.emit("job_end", status="succeeded", exitcode=0)
    log.close()


def test_report_draws_a_lane_per_rank_with_the_straggler_marked(tmp_path: Path) -> None:
    events_file = tmp_path / "job.jsonl"
    _job_with_a_straggler(events_file)
    lanes = build_timeline(read_events([events_file])).lanes
    assert lanes is not None and lanes.ranks == [0, 1, 2]
    assert [(s.rank, round(s.start, 1), round(s.end, 1)) for s in lanes.slow] == [(1, 6.0, 13.0)]
    out = tmp_path / "job.html"
    assert report_main([str(events_file), "-o", str(out)]) == 0
    html = out.read_text()
    for rank in range(3):
        assert f'<g id="lane-{rank}"><title>rank {rank}: ' in html
    assert '<g id="slow-0"><title>straggler: rank 1 on nodeA: 0.45 s per step, 4.3x' in html
    assert "straggler" in html and "step time / job median" in html
    png = render_report(read_events([events_file]), tmp_path / "job.png")
    assert Path(png).read_bytes()[:4] == b"\x89PNG"


def test_report_draws_each_ranks_arrival_lag_in_its_lane(tmp_path: Path) -> None:
    """Lock-step training: equal step times, and the lag at the collectives drawn."""
    events_file = tmp_path / "lockstep.jsonl"
    now = [1_700_000_000.0]
    log = EventLog(events_file, node="nodeA", clock=lambda: now[0])
    for rank in range(3):
        log.emit("worker_start", rank=rank, local_rank=rank, round=0, pid=100 + rank)
    for i in range(5):
        now[0] += 2.0
        log.emit("step_times", round=0, step_s={"0": 0.2, "1": 0.2, "2": 0.2}, median_s=0.2)
        lag = 0.06 if i >= 2 else 0.001
        log.emit("arrival_lags", round=0, lag_s={"0": -0.002, "1": lag, "2": 0.001})
    log.emit("job_end", status="succeeded", exitcode=0)
    log.close()
    out = tmp_path / "lockstep.html"
    assert report_main([str(events_file), "-o", str(out)]) == 0
    html = out.read_text()
    for rank in range(3):
        assert f'<g id="lag-{rank}">' in html
    assert "black line: arrival lag at the collectives (lane top: 60 ms)" in html, html
    assert "lag 60 ms" in html, "the lane's label gives its last lag"


def test_report_without_step_times_has_no_lanes(tmp_path: Path) -> None:
    events_file = tmp_path / "plain.jsonl"
    log = EventLog(events_file, node="n")
    log.emit("worker_start", rank=0, local_rank=0, round=0, pid=1)
    log.emit("worker_exit", rank=0, round=0, exitcode=0)
    log.close()
    assert build_timeline(read_events([events_file])).lanes is None
    out = render_report(read_events([events_file]), tmp_path / "plain.svg")
    assert "lane-0" not in Path(out).read_text()


class _Request:
    """A Flight Recorder request that every worker answered at once (no traces)."""

    def ready(self) -> bool:
        return True

    def results(self, timeout: float) -> dict[int, RankTrace]:
        return {}


@pytest.mark.parametrize(("window_s", "asked"), [(30.0, 15), (4.0, 75)])
def test_arrivals_are_sampled_about_every_sixth_of_the_window(window_s: float, asked: int) -> None:
    # a sample costs every worker a dump of its Flight Recorder: not every 2 s period
    clock = [0.0]
    requests: list[dict[int, int]] = []

    def ask(running: dict[int, int]) -> _Request:
        requests.append(running)
        return _Request()

    watch = StragglerWatch(
        _Board(2),  # type: ignore[arg-type]
        threshold=1.5, host="h", round=0, rank_offset=0, emit=lambda *a, **k: None,
        say=lambda line: None, window_s=window_s, clock=lambda: clock[0], arrivals=ask,
    )  # fmt: skip
    for tick in range(1, 601):  # 60 s of monitor ticks, 0.1 s apart
        clock[0] = tick * 0.1
        watch.tick({0: 100, 1: 101})
    assert len(requests) == pytest.approx(asked, abs=2), len(requests)
    assert requests[0] == {0: 100, 1: 101}
