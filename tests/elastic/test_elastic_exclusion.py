"""Exclusion's store logic without processes: the list survives two exclusions at once, a
malformed list names its key, and a round claimed by a node lost before it decided is
decided by another node instead of waiting out the store's read timeout."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import pytest
from torch.distributed import HashStore

from rallypoint._elastic import _round
from rallypoint._elastic._records import Action, Decision, ExclusionRecord
from rallypoint._elastic._round import Round
from rallypoint._elastic._stores import RoundStore, RunStore
from rallypoint._supervise._state import GroupInfo
from rallypoint.launcher import RendezvousFailedError
from rallypoint.rendezvous import RendezvousStateError

pytestmark = pytest.mark.timeout(30)


def _record(node: str) -> ExclusionRecord:
    return ExclusionRecord(node=node, host="vm", reason="why", time=1.5)


def test_two_exclusions_at_once_both_stay() -> None:
    run = RunStore(HashStore(), "rallypoint/job1/job")
    other = RunStore(run.store)
    read = run._excluded_raw
    calls = 0

    def read_then_race() -> bytes:  # another node excludes between this read and the write
        nonlocal calls
        calls += 1
        raw = read()
        if calls == 1:
            other.exclude(_record("b_2_0_bb"))
        return raw

    run._excluded_raw = read_then_race  # type: ignore[method-assign]
    run.exclude(_record("a_1_0_aa"))
    assert [r.node for r in other.exclusions()] == ["b_2_0_bb", "a_1_0_aa"]


def test_a_malformed_exclusion_list_names_its_key() -> None:
    run = RunStore(HashStore(), "rallypoint/job1/job")
    run.store.set("excluded", "not json{")
    key = "'rallypoint/job1/job/excluded'"
    with pytest.raises(RendezvousStateError, match=f"the key {key} holds a malformed exclusion"):
        run.exclusions()
    run.store.set("excluded", '{"node": "a"}')
    with pytest.raises(RendezvousStateError, match="not a list"):
        run.exclusions()


@dataclass
class FakeJob:
    """What a round reads of its job while it waits for a decision."""

    waiting: int = 0
    store_timeout: float = 60.0
    poll_every: float = 0.01
    run: RunStore = field(default_factory=lambda: RunStore(HashStore()))

    def nodes_waiting(self) -> int:
        return self.waiting

    def check_signals(self) -> None:
        pass


def _round_of(job: FakeJob) -> Round:
    group = GroupInfo(
        group_rank=1,
        group_world_size=2,
        world_size=2,
        rank_offset=1,
        master_addr="127.0.0.1",
        master_port=1,
        run_id="job1",
        restart_count=0,
        max_restarts=3,
    )
    fake: Any = job
    return Round(
        number=4, group=group, members=["vm", "vm"], store=RoundStore(HashStore()), job=fake
    )


def test_a_round_claimed_by_a_lost_node_is_decided_by_another(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_round, "TAKEOVER_AFTER", 0.05)
    rnd = _round_of(FakeJob(waiting=1))
    assert rnd.store.claim(), "the node that claims, then is lost before it decides"
    decision = rnd.decision()
    assert decision.action is Action.RESTART and decision.by == 1
    assert decision.reason == "a node was lost before it decided round 4"
    late = Decision(action=Action.FAIL, reason="late", count=1, by=0)
    assert rnd.store.decide(late) == decision, "the claimer's late write loses"


def test_a_claimed_round_without_a_decision_or_a_lost_node_ends_at_the_read_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_round, "TAKEOVER_AFTER", 0.0)
    rnd = _round_of(FakeJob(waiting=0, store_timeout=0.2))
    rnd.store.claim()
    start = time.monotonic()
    with pytest.raises(RendezvousFailedError, match="round 4 was claimed but not decided within"):
        rnd.decision()
    assert time.monotonic() - start < 5
