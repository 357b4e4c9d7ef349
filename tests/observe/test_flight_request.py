"""The agent's request for its workers' Flight Recorder traces, against real worker
processes running the dumper thread (``install_flight_dumper``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rallypoint._core import envvars
from rallypoint._watch._flight import _recorder as _flight
from rallypoint._watch._flight._recorder import FlightRequest
from rallypoint._watch._flight._records import RankTrace
from rallypoint._watch._stacks import THREAD_WAIT, collect_stacks

WORKER = """
import sys, time
from rallypoint._watch._flight._recorder import install_flight_dumper
install_flight_dumper()
print("ready", flush=True)
time.sleep(float(sys.argv[1]))
"""


def _worker(directory: Path, rank: int, lives: float) -> subprocess.Popen[str]:
    env = {**os.environ, envvars.STACKS_DIR: str(directory), "RANK": str(rank)}
    proc = subprocess.Popen(
        [sys.executable, "-c", WORKER, str(lives)], env=env, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    return proc


def _wait_stopped(pid: int) -> None:
    """Until every thread of ``pid`` is stopped (``T`` in ``/proc``): kill() returns before
    a sleeping thread that another event wakes has seen the stop."""
    while True:
        states = set()
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as fh:
                stat = fh.read()
            states.add(stat[stat.rfind(b")") + 2 :][:1])
        if states == {b"T"}:
            return
        time.sleep(0.01)


@pytest.mark.timeout(30)
def test_answers_come_without_waiting_and_an_exited_worker_is_not_waited_for(
    tmp_path: Path,
) -> None:
    alive, dying = _worker(tmp_path, 0, 60), _worker(tmp_path, 1, 60)
    try:
        os.kill(dying.pid, signal.SIGSTOP)  # asked while it lives, it never answers
        _wait_stopped(dying.pid)  # the stop takes effect when its threads next run
        request = FlightRequest({0: alive.pid, 1: dying.pid}, tmp_path, arrivals=True)
        time.sleep(0.3)
        assert not request.ready()  # rank 1 still may answer
        traces = request.results(0.0)  # what came so far, without waiting
        assert traces[0].error == "torch.distributed is not in use"  # (no torch in it)
        assert "no Flight Recorder dump within 0 s" in str(traces[1].error)
        dying.kill()
        dying.wait(5)
        assert request.ready()
        started = time.monotonic()
        traces = request.results(60.0)
        assert time.monotonic() - started < 20.0  # not the full timeout for the dead one
        assert traces[1].error == "it exited before answering"
        # a worker gone before the request: nobody reads its FIFO
        gone = FlightRequest({1: dying.pid}, tmp_path)
        assert gone.ready() and "no Flight Recorder dumper" in str(gone.results(10.0)[1].error)
    finally:
        alive.kill()
        alive.wait()
        dying.kill()
        dying.wait()


def test_the_frameless_answer_is_made_before_the_one_with_frames(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    made: list[bool] = []

    windows: list[int | None] = []

    def dump(rank: int, frames: bool, keep: int = 0, window_ns: int | None = None) -> RankTrace:
        made.append(frames)
        windows.append(window_ns)
        return RankTrace(rank=rank)

    monkeypatch.setattr(_flight, "_dump_this_worker", dump)
    answers = _flight.answers("token", 3)
    assert next(answers) == (False, RankTrace(rank=3)) and made == [False]  # frames not yet
    assert next(answers) == (True, RankTrace(rank=3)) and made == [False, True]
    assert list(_flight.answers("token arrivals", 3)) == [(True, RankTrace(rank=3))]
    assert list(_flight.answers("token arrivals 2.5", 3)) == [(True, RankTrace(rank=3))]
    assert windows[-2:] == [None, 2_500_000_000]  # the straggler window: nothing older


STACKS_WORKER = """
import os, sys, time
from rallypoint._watch._flight._recorder import install_flight_dumper
from rallypoint._watch._fifo import fifo_path
from rallypoint._watch._stacks import dump_stacks_now, install_stack_dumper
install_stack_dumper()
if sys.argv[1] == "thread":
    install_flight_dumper(on_stacks=dump_stacks_now)
else:  # a FIFO whose reader never answers: a thread that cannot get the GIL
    os.mkfifo(fifo_path(os.environ["RALLYPOINT_STACKS_DIR"], os.getpid()), 0o600)
    fd = os.open(fifo_path(os.environ["RALLYPOINT_STACKS_DIR"], os.getpid()), os.O_RDWR)
def waiting_here():
    print("ready", flush=True)  # from inside: the stacks taken after it show this frame
    time.sleep(60)
waiting_here()
"""


@pytest.mark.timeout(30)
@pytest.mark.parametrize("how", ["thread", "deaf"])
def test_stacks_come_from_the_thread_and_by_signal_when_it_does_not_answer(
    tmp_path: Path, how: str
) -> None:
    env = {**os.environ, envvars.STACKS_DIR: str(tmp_path)}
    proc = subprocess.Popen(
        [sys.executable, "-c", STACKS_WORKER, how], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        started = time.monotonic()
        dump = collect_stacks({0: proc.pid}, 10.0, directory=tmp_path)[0]
        took = time.monotonic() - started
        assert dump.error is None and dump.main is not None
        assert dump.main.frames[0].name == "waiting_here", dump.main  # in time.sleep
        current = next(t for t in dump.threads if t.current)
        if how == "thread":  # written from the Flight Recorder thread, with the GIL held
            # (which path answered, not how fast: the thread's own frame says it)
            assert any(f.name == "dump_stacks_now" for f in current.frames), dump
        else:  # its thread never answered: the signal, after THREAD_WAIT
            assert current is dump.main and took >= THREAD_WAIT
    finally:
        proc.kill()
        proc.wait()


def test_an_arrivals_answer_keeps_the_entries_of_the_window_up_to_the_newest() -> None:
    def entry(seq: int, created_s: float) -> dict[str, object]:
        return {
            "pg_id": 0, "process_group": ("0", "default_pg"), "collective_seq_id": seq,
            "profiling_name": "gloo:all_reduce", "time_created_ns": int(created_s * 1e9),
            "input_sizes": [[4]], "input_dtypes": ["Float"], "retired": True, "is_p2p": False,
        }  # fmt: skip

    dump = {
        "pg_status": {"0": {"last_enqueued_collective": 4, "last_completed_collective": 4}},
        "entries": [entry(1, 100.0), entry(2, 150.0), entry(3, 171.0), entry(4, 200.0)],
    }
    groups = {"0": ((0, 1), True)}
    every = _flight.trace_from_dump(0, dump, groups, keep=1 << 30)
    recent = _flight.trace_from_dump(0, dump, groups, keep=1 << 30, window_ns=30_000_000_000)
    assert [e.seq for e in every.groups[0].entries] == [1, 2, 3, 4]
    assert [e.seq for e in recent.groups[0].entries] == [3, 4]  # created from 170 s on
    assert (recent.groups[0].issued, recent.groups[0].completed) == (4, 4)
