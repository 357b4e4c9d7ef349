"""The records agents exchange through the store: typed, JSON both ways, clear when bad."""

from __future__ import annotations

import pytest

from rallypoint._elastic._records import Action, Decision, FailureRecord, NodeRecord, RootRecord
from rallypoint.rendezvous import RendezvousStateError

FAILURE = FailureRecord(
    time=1.5e9,
    elapsed=2.5,
    host="h1",
    group_rank=1,
    rank=3,
    local_rank=1,
    pid=42,
    exitcode=-9,
    detail="killed by SIGKILL",
    traceback="Traceback ...\nValueError: x",
)


@pytest.mark.parametrize(
    "record",
    [
        NodeRecord(nproc=4, host="node with spaces"),
        FAILURE,
        Decision(action=Action.FAIL, reason="rank 3 on h1 exited with 1", count=2, by=0),
        RootRecord(FAILURE),
        RootRecord(None),
    ],
)
def test_round_trip(record: NodeRecord | FailureRecord | Decision | RootRecord) -> None:
    text = record.to_json()
    assert type(record).from_json(text) == record
    assert type(record).from_json(text.encode()) == record


def test_failure_record_as_worker_state() -> None:
    state = FAILURE.worker_state()
    assert (state.rank, state.local_rank, state.pid, state.exitcode) == (3, 1, 42, -9)
    assert state.state == "failed" and state.detail == "killed by SIGKILL"


@pytest.mark.parametrize(
    ("cls", "data", "match"),
    [
        (NodeRecord, b"4 host", "malformed node"),
        (NodeRecord, b'{"nproc": 4}', "malformed node"),
        (FailureRecord, b"[]", "malformed failure"),
        (Decision, b'{"action": "explode", "reason": "", "count": 0, "by": 0}', "unknown action"),
        (RootRecord, b"{", "malformed root"),
    ],
)
def test_malformed_records_are_state_errors(cls: type, data: bytes, match: str) -> None:
    with pytest.raises(RendezvousStateError, match=match):
        cls.from_json(data)


def test_exclusion_and_streak_keys_in_the_run_store() -> None:
    from torch.distributed import HashStore

    from rallypoint._elastic._records import ExclusionRecord
    from rallypoint._elastic._stores import RunStore

    run = RunStore(HashStore())
    assert [run.node_failed(n) for n in ("c", "c", "b", "c", "c", "c")] == [1, 2, 1, 1, 2, 3]
    assert run.node_failed("") == 0 and run.node_failed("c") == 1, "a hang breaks every run"
    assert [run.same_failure(s) for s in ("x", "x", "", "x")] == [1, 2, 0, 1]
    assert run.exclusions() == []
    first = ExclusionRecord(node="127.0.0.4", host="h", reason="why", time=1.5)
    second = ExclusionRecord(node="n2", host="h2", reason="again", time=2.5)
    run.exclude(first)
    run.exclude(second)
    assert run.exclusions() == [first, second]


def test_decisions_from_before_notes_and_exclusions_still_read() -> None:
    old = b'{"action": "restart", "reason": "r", "count": 1, "by": 0}'
    decision = Decision.from_json(old)
    assert (decision.note, decision.excluded) == ("", "")
    new = Decision(action=Action.RESTART, reason="r", count=1, by=0, note="n", excluded="x")
    assert Decision.from_json(new.to_json()) == new
