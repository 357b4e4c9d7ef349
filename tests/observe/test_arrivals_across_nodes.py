"""Arrivals compared across nodes: clock offsets measured through a real store, samples
sent to the judging node, and a slow rank on another node named once."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import pytest

from rallypoint._watch._flight._records import FlightEntry, GroupTrace, RankTrace
from rallypoint._watch._stragglers._arrival_records import (
    NodeArrivals,
    arrivals_record,
    read_arrivals_record,
)
from rallypoint._watch._stragglers._arrival_watch import ArrivalWatch
from rallypoint._watch._stragglers._clock_offset import ClockProbe, ClockResponder, offset_from

MS = 1_000_000
SKEW = 3_000_000_000  # node 1's clock runs 3 s behind the judge's


@pytest.fixture
def stores() -> Any:
    """A TCPStore server and a client factory (each client a connection of its own)."""
    from torch.distributed import TCPStore

    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                      timeout=timedelta(seconds=10))  # fmt: skip

    def client() -> Any:
        return TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=10))

    return client  # the server lives as long as the factory that holds it


def test_ntps_formula() -> None:
    # the node's clock is 100 ahead; 5 each way, 2 to answer
    offset = offset_from(t1=1000, t2=1105, t3=1107, t4=1012)
    assert (offset.offset_ns, offset.delay_ns) == (100, 10)


@pytest.mark.timeout(30)
def test_a_skewed_clock_is_measured_through_a_real_store(stores: Any) -> None:
    from rallypoint._core.cpp_log import _level

    level = _level()
    assert level is not None, "torch's C++ log level is where cpp_warnings_off looks"
    before = level.value
    judge, node = stores(), stores()
    skewed = lambda: time.time_ns() - SKEW  # noqa: E731
    responder = ClockResponder(node, round=0, group_rank=1, clock=skewed)
    offset = ClockProbe(round=0).measure(judge, 1)
    assert offset is not None
    assert 0 <= offset.delay_ns < 2000 * MS, offset  # a round trip (a loaded machine's)
    assert abs(offset.offset_ns + SKEW) <= offset.delay_ns // 2 + MS, offset
    responder.close(judge)
    assert not responder._thread.is_alive(), "a stop ends the thread blocked in get"
    assert level.value == before, "C++ warnings are back once the responder ended"


@pytest.mark.timeout(30)
def test_the_responder_outlives_a_quiet_spell_and_ends_with_its_store(
    stores: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The judge pings a node only now and then: a timeout in ``get`` is no reason to stop
    answering; a store that went away is."""
    from torch.distributed import TCPStore

    from rallypoint._watch._stragglers import _clock_offset

    monkeypatch.setattr(_clock_offset, "RESPONDER_TIMEOUT", timedelta(seconds=0.3))
    judge = stores()
    responder = ClockResponder(stores(), round=0, group_rank=1)
    time.sleep(1.0)  # three timeouts
    assert responder._thread.is_alive()
    assert ClockProbe(round=0).measure(judge, 1) is not None
    responder.close(judge)
    assert not responder._thread.is_alive()
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = TCPStore("127.0.0.1", server.port, is_master=False)
    lonely = ClockResponder(client, round=0, group_rank=1)
    del server
    lonely._thread.join(5)
    assert not lonely._thread.is_alive(), "the store went away: the thread ends"


_AGENT = """
import sys
from datetime import timedelta
from torch.distributed import TCPStore
from rallypoint._watch._stragglers._clock_offset import ClockProbe, ClockResponder

def client():
    return TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False, timeout=timedelta(seconds=10))

judge = client()
responder = ClockResponder(client(), round=0, group_rank=1)
assert ClockProbe(round=0).measure(judge, 1) is not None  # answered: it waits for the next
print("waiting", flush=True)
responder._thread.join(30)
print("alive" if responder._thread.is_alive() else "ended", flush=True)
"""


@pytest.mark.timeout(60)
def test_a_store_lost_while_the_responder_waits_prints_nothing() -> None:
    """c10d logs the failed ``get`` with its C++ backtrace (16 lines on stderr) before the
    responder ends on it; an agent whose store went away says so once, elsewhere."""
    from torch.distributed import TCPStore

    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = {k: v for k, v in os.environ.items() if k != "TORCH_CPP_LOG_LEVEL"}  # c10's default
    agent = subprocess.Popen(
        [sys.executable, "-c", _AGENT, str(server.port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert agent.stdout is not None
        assert agent.stdout.readline() == "waiting\n"
        del server  # the store goes away
        out, err = agent.communicate(timeout=40)
    finally:
        agent.kill()
    assert out == "ended\n"
    assert len(err.splitlines()) <= 1, err


@pytest.mark.timeout(30)
def test_a_node_that_does_not_answer_is_skipped_for_a_while(stores: Any) -> None:
    judge = stores()
    probe = ClockProbe(round=0)
    started = time.monotonic()
    assert probe.refresh(judge, [1]) == {}  # one ping, one second without an answer
    assert 0.9 < time.monotonic() - started < 20  # its second, and no hang
    started = time.monotonic()
    assert probe.refresh(judge, [1]) == {}
    # not asked again at once: a ping would wait its second again (the widest bound below)
    assert time.monotonic() - started < 0.9, "not asked again at once"


def _traces(ranks: Mapping[int, int], *, shift: int = 0, n: int = 30) -> dict[int, RankTrace]:
    """Ranks of a 2-rank world doing ``n`` all_reduces 100 ms apart; rank r arrives
    ``ranks[r]`` ns late; the node's clock reads ``shift`` ns off the judge's."""
    base = time.time_ns() - n * 100 * MS
    traces = {}
    for rank, late in ranks.items():
        entries = tuple(
            FlightEntry(seq, "all_reduce", ((4,),), ("Float",),
                        base + seq * 100 * MS + late + shift + (seq % 3) * MS // 2, True)
            for seq in range(1, n + 1)
        )  # fmt: skip
        traces[rank] = RankTrace(rank, (GroupTrace("0", (0, 1), n, n, entries, True),))
    return traces


def test_a_record_round_trips_with_what_the_judge_compares() -> None:
    traces = _traces({0: 0, 1: 60 * MS})
    timed = FlightEntry(31, "all_reduce", (), (), 5, True, duration_ns=2_500_000)
    traces[3] = RankTrace(3, (GroupTrace("0", (0, 1), 31, 31, (timed,), True),))
    traces[2] = RankTrace(2, error="recording off")
    sample = read_arrivals_record(arrivals_record(NodeArrivals(7, "b", traces)).encode())
    assert (sample.seq, sample.host, sorted(sample.traces)) == (7, "b", [0, 1, 3])
    assert sample.traces[3].groups[0].entries[0].duration_ns == 2_500_000  # NCCL's GPU time
    group = sample.traces[1].groups[0]
    assert (group.name, group.ranks, group.world) == ("0", (0, 1), True)
    assert [e.created_ns for e in group.entries] == [
        e.created_ns for e in traces[1].groups[0].entries
    ]
    with pytest.raises(ValueError, match="malformed arrivals record"):
        read_arrivals_record(b'{"seq": 1}')


class _Answered:
    def __init__(self, traces: dict[int, RankTrace]) -> None:
        self.traces = traces

    def ready(self) -> bool:
        return True

    def results(self, timeout: float) -> dict[int, RankTrace]:
        return self.traces


@pytest.mark.timeout(60)
def test_the_judge_names_a_slow_rank_on_another_node_with_a_skewed_clock(stores: Any) -> None:
    """Rank 1 runs on node 1, whose clock reads 3 s behind: uncorrected, it would seem to
    arrive first and rank 0 would be named."""
    said: list[str] = []
    events: list[tuple[str, dict[str, Any]]] = []
    now = [0.0]

    def watch(group_rank: int, traces: dict[int, RankTrace], wall: Any) -> ArrivalWatch:
        return ArrivalWatch(
            lambda running: _Answered(traces), threshold=1.2, recover_at=1.1,
            host="ab"[group_rank], round=0, group_rank=group_rank, nnodes=2, window_s=30,
            every=1.0, emit=lambda kind, **f: events.append((kind, f)), say=said.append,
            clock=lambda: now[0], clock_store=stores, wall_clock=wall,
        )  # fmt: skip

    judge = watch(0, _traces({0: 0}), time.time_ns)
    node = watch(1, _traces({1: 60 * MS}, shift=-SKEW), lambda: time.time_ns() - SKEW)
    judge_store, node_store = stores(), stores()
    try:
        for _ in range(2):  # the first period asks, the second reads, sends and judges
            node.ask({1: 101}, node_store)
            judge.ask({0: 100}, judge_store)
            now[0] += 1.5
    finally:
        node.close()
    assert len(said) == 1 and said[0].startswith("rallypoint: straggler: rank 1 on b "), said
    slow = [f for kind, f in events if kind == "straggler"]
    assert slow and (slow[0]["rank"], slow[0]["host"], slow[0]["group_rank"]) == (1, "b", 1)
    # the clocks' offset is known to within half a store round trip (11 ms seen on a
    # loaded machine); uncorrected, the lag would be about -2.94 s
    assert 0.03 < slow[0]["lag_s"] < 0.09, slow
    lags = [f["lag_s"] for kind, f in events if kind == "arrival_lags"]
    assert lags and set(lags[-1]) == {"0", "1"}


@pytest.mark.timeout(30)
def test_without_a_second_connection_a_node_judges_its_own_ranks(stores: Any) -> None:
    said: list[str] = []

    def refuse() -> Any:
        raise RuntimeError("no clone")

    traces = {  # ranks 0-2 of a 4-rank world, rank 3 elsewhere
        rank: RankTrace(rank, (GroupTrace("0", (0, 1, 2, 3), 30, 30, t.groups[0].entries, True),))
        for rank, t in _traces({0: 0, 1: 0, 2: 60 * MS}).items()
    }
    node = ArrivalWatch(
        lambda running: _Answered(traces), threshold=1.2, recover_at=1.1, host="b", round=0,
        group_rank=1, nnodes=2, window_s=30, every=1.0, emit=lambda kind, **f: None,
        say=said.append, clock=time.monotonic, clock_store=refuse,
    )  # fmt: skip
    store = stores()
    node.ask({0: 1, 1: 2, 2: 3}, store)
    node.read({0: 1, 1: 2, 2: 3}, store)
    assert said[0].startswith("rallypoint: straggler arrivals judged on this node only: no clone")
    assert said[1].startswith("rallypoint: straggler: rank 2 on b "), said
    assert not store.check(["arrivals/0/1"]), "nothing sent to a judge that cannot compare it"
