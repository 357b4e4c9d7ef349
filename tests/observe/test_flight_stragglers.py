"""Stragglers in lock-step training, named by their arrival at the collectives."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from _support import cli_zygote
from rallypoint._watch._flight._records import FlightEntry, GroupTrace, RankTrace
from rallypoint._watch._stragglers._arrivals import MIN_COLLECTIVES, is_straggler, judge_arrivals
from rallypoint.observe._events import read_events
from rallypoint.observe._step_lanes import build_lanes
from rallypoint.observe._step_lanes_plot import lane_tooltips

MS = 1_000_000


def _traces(late: dict[int, int], *, jitter_ms: float = 1.0, n: int = 30) -> dict[int, RankTrace]:
    """4 ranks, ``n`` all_reduces 100 ms apart; rank r issues each ``late[r]`` ns late."""
    rng = random.Random(7)
    traces = {}
    for rank in range(4):
        entries = tuple(
            FlightEntry(
                seq, "all_reduce", ((4,),), ("Float",),
                seq * 100 * MS + late.get(rank, 0) + int(rng.uniform(0, jitter_ms) * MS), True,
            )
            for seq in range(1, n + 1)
        )  # fmt: skip
        traces[rank] = RankTrace(rank, (GroupTrace("0", (0, 1, 2, 3), n, n, entries, True),))
    return traces


def test_the_rank_the_others_wait_for_is_named_and_nobody_otherwise() -> None:
    verdict = judge_arrivals(_traces({2: 60 * MS}), window_s=30)
    assert verdict is not None and verdict.rank == 2 and verdict.last == verdict.collectives
    assert 55e-3 < verdict.lag_s < 62e-3 and 2.0 < verdict.ratio < 3.0, verdict
    assert is_straggler(verdict, 1.5) and not is_straggler(verdict, 3.0)
    assert verdict.lags_s[2] > 0.05 and abs(verdict.lags_s[0]) < 0.002
    balanced = judge_arrivals(_traces({}, jitter_ms=5.0), window_s=30)
    assert balanced is not None and not is_straggler(balanced, 1.5), balanced
    assert judge_arrivals(_traces({2: 60 * MS}, n=MIN_COLLECTIVES - 1), window_s=30) is None


def test_a_clock_offset_between_nodes_is_subtracted() -> None:
    # rank 3 alone on a node whose clock runs 50 ms ahead: late on paper, not in truth
    skewed = _traces({3: 50 * MS})
    assert is_straggler(judge_arrivals(skewed, window_s=30), 1.5)  # what an offset fakes
    offsets = {3: 50 * MS}
    assert not is_straggler(judge_arrivals(skewed, window_s=30, offsets=offsets), 1.5)
    # a real straggler on the skewed node keeps its true lag
    real = judge_arrivals(_traces({3: 110 * MS}), window_s=30, offsets=offsets)
    assert real is not None and real.rank == 3 and 58e-3 < real.lag_s < 62e-3


def _nccl(durations: dict[int, float | None], n: int = 30) -> dict[int, RankTrace]:
    """4 ranks whose CPUs enqueue each all_reduce together (100 ms apart); rank r's GPU
    spends ``durations[r]`` ms in it (NCCL's timing), ``None``: not measured."""
    rng = random.Random(3)
    traces = {}
    for rank in range(4):
        ms = durations.get(rank, 62.0)
        entries = tuple(
            FlightEntry(seq, "all_reduce", ((4,),), ("Float",),
                        seq * 100 * MS + int(rng.uniform(0, 0.2) * MS), True,
                        duration_ns=None if ms is None else int((ms + rng.uniform(0, 1)) * MS))
            for seq in range(1, n + 1)
        )  # fmt: skip
        traces[rank] = RankTrace(rank, (GroupTrace("0", (0, 1, 2, 3), n, n, entries, True),))
    return traces


def test_on_the_gpu_the_rank_that_spends_least_in_the_collective_arrived_last() -> None:
    """The CPUs enqueue together; rank 2's GPU reaches the all_reduce 60 ms after the
    others', which wait there for it: NCCL's durations name it, enqueue times do not."""
    verdict = judge_arrivals(_nccl({2: 2.0}), window_s=30)
    assert verdict is not None and verdict.rank == 2, verdict
    assert 0.055 < verdict.lag_s < 0.065 and is_straggler(verdict, 1.5), verdict
    assert not is_straggler(judge_arrivals(_nccl({}), window_s=30), 1.5)
    # without a duration from every member, the CPU's enqueue times are all there is
    blind = judge_arrivals(_nccl({2: 2.0, 0: None}), window_s=30)
    assert not is_straggler(blind, 1.5), blind


def test_one_nodes_ranks_are_compared_among_themselves() -> None:
    # ranks 2 and 3 of a 4-rank world, as the agent of their node sees them: one clock
    local = {r: t for r, t in _traces({3: 60 * MS}).items() if r in (2, 3)}
    assert judge_arrivals(local, window_s=30) is None  # no collective with every member
    verdict = judge_arrivals(local, window_s=30, subset=True)
    assert verdict is not None and verdict.rank == 3 and is_straggler(verdict, 1.5)


DDP = """
import glob, sys, time
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
import rallypoint.launcher as rl

dist.init_process_group("gloo")
rank = dist.get_rank()
slow = int(sys.argv[1])
base = float(sys.argv[3]) if len(sys.argv) > 3 else 0.03  # the others' compute per step
model = DDP(torch.nn.Linear(64, 64))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(8, 64)
for _ in range(int(sys.argv[2])):  # a count, not a clock: ranks that stopped apart would
    rl.progress()                   # leave the last one alone in DDP's all_reduce
    time.sleep(3 * base if rank == slow else base)  # the forward pass's compute
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()
if len(sys.argv) > 4:  # how long the kernel kept this process waiting for a CPU, in total
    waited = 0
    for path in glob.glob("/proc/self/task/*/schedstat"):
        with open(path) as fp:
            waited += int(fp.read().split()[1])
    with open(f"{sys.argv[4]}/runq-{rank}", "w") as fp:
        fp.write(str(waited / 1e9))
"""


def _named_only_if_starved(out: Path, named: list[int]) -> None:
    """Without a slow rank, nobody is named unless the machine starved that rank (a loaded
    machine makes a real straggler): the kernel kept it waiting for a CPU 0.1 s or more in
    all (its runqueue time, ``/proc/<pid>/task/*/schedstat``), which the others wait for."""
    for rank in named:
        waited = float((out / f"runq-{rank}").read_text())
        assert waited >= 0.1, f"rank {rank} named, but it waited only {waited:.3f} s for a CPU"


def _threshold(slow: int) -> list[str]:
    """The slow rank's pace is 3x the others'. Without one, a rank starved of the CPU on a
    loaded 2-core machine can reach 1.7x, a real straggler by the default threshold (1.5):
    the runs without a slow rank name nobody under 2.5x."""
    return [] if slow >= 0 else ["--straggler-threshold", "2.5"]


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("slow", [2, -1])
def test_lock_step_ddp_names_the_slow_rank_and_nobody_without(tmp_path: Path, slow: int) -> None:
    script = tmp_path / "ddp.py"
    script.write_text(DDP)
    events = tmp_path / "events.jsonl"
    proc = cli_zygote.run(
        [sys.executable, "-m", "rallypoint", "run", "--nproc-per-node", "4",
         *_threshold(slow), "--straggler-window", "4", "--events", str(events), str(script),
         str(slow), "80", "0.03", str(tmp_path)],
        capture_output=True, text=True, timeout=100,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in events.read_text().splitlines()]
    named = [r for r in records if r["kind"] == "straggler"]
    lags = [r for r in records if r["kind"] == "arrival_lags"]
    assert lags, "the arrivals were sampled"
    if slow < 0:
        _named_only_if_starved(tmp_path, [r["rank"] for r in named])
        return
    lines = [x for x in proc.stderr.splitlines() if "straggler:" in x]
    assert len(lines) == 1 and lines[0].startswith(f"rallypoint: straggler: rank {slow} on "), (
        proc.stderr
    )
    assert "arrives last at" in lines[0] and "ms after the others" in lines[0]
    assert named[0]["scope"] == "arrival" and named[0]["rank"] == slow
    assert named[0]["lag_s"] > 0 and lags[-1]["lag_s"][str(slow)] > 0
    # the report's lanes: each rank's arrival lag, and the span where it was slow
    ordered = read_events(events)
    lanes = build_lanes(ordered, ordered[0].ts, ordered[-1].ts - ordered[0].ts)
    assert lanes is not None
    tips = lane_tooltips(lanes)
    assert "ms after the others (median lag" in tips[f"lane-{slow}"], tips
    spans = [t for k, t in tips.items() if k.startswith("slow-")]
    assert spans and f"rank {slow} on" in spans[0] and "arrives last at the collectives" in spans[0]


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("slow", [1, -1])
def test_across_two_agents_the_judge_names_a_slow_rank_of_the_other_node(
    tmp_path: Path, endpoint: str, slow: int
) -> None:
    """One rank per node: nothing to compare within a node; the node with group rank 0
    compares both, the other node's arrivals corrected by its measured clock offset; and
    names nobody when no rank is slow (see :func:`_threshold`; and without a slow rank the
    steps take 80 ms, not 30, so that a rank starved of the CPU lags less)."""
    base = "0.03" if slow >= 0 else "0.08"
    script = tmp_path / "ddp.py"
    script.write_text(DDP)
    events = [tmp_path / f"events{i}.jsonl" for i in range(2)]
    cmd = [
        sys.executable, "-m", "rallypoint", "run", "--nnodes", "2", "--nproc-per-node", "1",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "job-arrive",
        "--rdzv-conf", "is_host=false,read_timeout=20", "--straggler-window", "4",
        *_threshold(slow),
    ]  # fmt: skip
    procs = [
        cli_zygote.Popen([*cmd, "--events", str(e), str(script), str(slow), "48", base,
                          str(tmp_path)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for e in events
    ]  # fmt: skip
    errs = [p.communicate(timeout=120)[1] for p in procs]
    assert all(p.returncode == 0 for p in procs), errs
    lines = [x for err in errs for x in err.splitlines() if "straggler" in x]
    records = [json.loads(line) for e in events for line in e.read_text().splitlines()]
    named = [r for r in records if r["kind"] == "straggler"]
    lags = [r["lag_s"] for r in records if r["kind"] == "arrival_lags"]
    assert lags and all(set(lag) == {"0", "1"} for lag in lags), "both nodes compared"
    if slow < 0:
        _named_only_if_starved(tmp_path, [r["rank"] for r in named])
        return
    assert len(lines) == 1 and lines[0].startswith("rallypoint: straggler: rank 1 on "), errs
    assert "arrives last at" in lines[0]
    assert named[0]["rank"] == 1 and named[0]["scope"] == "arrival" and named[0]["lag_s"] > 0
