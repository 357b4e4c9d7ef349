"""The lighthouse's decisions as a pure state machine, on a clock the test moves."""

from __future__ import annotations

import json

import pytest

from rallypoint.ft._quorum.decider import Decided, Decider, Died, Reply
from rallypoint.ft._quorum.records import Ask, RecordError, Request, Rules, parse_message


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _decider(**rules: int) -> tuple[Decider, Clock, list[str]]:
    clock, lines = Clock(), []
    decider = Decider(Rules(**rules), "gen", clock=clock, say=lines.append)
    return decider, clock, lines


def _ask(member: str, seq: int, step: int = 0, retry_of: int = 0) -> Ask:
    req = Request(member, member.split(":")[0], step, 1)
    return Ask("ask", member, seq, req, retry_of=retry_of)


def _decided(effects: list[object]) -> Decided:
    [done] = [e for e in effects if isinstance(e, Decided)]
    return done


def test_a_round_waits_for_every_live_member_of_the_last_and_answers_only_newcomers() -> None:
    d, clock, _ = _decider(min_replicas=2)
    d.receive(_ask("a:1", 1))
    [told] = d.tick(clock())[1:]  # below min_replicas: a note, and a is told to ask again
    assert isinstance(told, Reply) and told.kind == "retry"
    d.receive(_ask("b:1", 1))
    d.receive(_ask("a:1", 2))
    first = _decided(d.tick(clock()))
    assert first.quorum.ids() == ["a:1", "b:1"] and first.answers == {"a:1": 2, "b:1": 1}
    d.receive(_ask("a:1", 3, step=1))
    assert not [e for e in d.tick(clock()) if isinstance(e, Decided)]  # b has not asked
    d.receive(_ask("c:1", 1))  # a joiner comes in with the next round
    d.receive(_ask("b:1", 2, step=1))
    second = _decided(d.tick(clock()))
    assert second.quorum.ids() == ["a:1", "b:1", "c:1"]
    assert second.quorum.quorum_id == first.quorum.quorum_id + 1
    # a and b were in the last round and wait on this round's record: only c is answered
    assert second.answers == {"c:1": 1}


def test_a_member_that_could_not_read_its_round_is_answered_under_its_own_key() -> None:
    d, clock, _ = _decider()
    for m in ("a:1", "b:1"):
        d.receive(_ask(m, 1))
    _decided(d.tick(clock()))
    d.receive(_ask("a:1", 2, step=1))
    d.receive(_ask("b:1", 3, step=1, retry_of=2))  # its wait on r/1 found a forged record
    done = _decided(d.tick(clock()))
    assert done.answers == {"b:1": 3}
    # and a retry of an ask already answered gets that round again, at once
    d.receive(_ask("a:1", 3, step=1, retry_of=2))
    [again] = [e for e in d.tick(clock()) if isinstance(e, Reply)]
    assert (again.member, again.seq, again.kind, again.why) == ("a:1", 3, "round", "1")


def test_a_notice_about_a_member_that_then_asks_is_not_believed() -> None:
    d, clock, lines = _decider()
    for m in ("a:1", "b:1"):
        d.receive(_ask(m, 1))
    _decided(d.tick(clock()))
    d.receive(Ask("gone", "b:1", why="forged"))
    [died] = [e for e in d.tick(clock()) if isinstance(e, Died)]
    assert died.member == "b:1" and died.why == "forged" and died.round == 0
    d.receive(_ask("b:1", 2, step=1))
    d.receive(_ask("a:1", 2, step=1))
    done = _decided(d.tick(clock()))
    assert done.quorum.ids() == ["a:1", "b:1"]
    assert "b:1 asks again: it is back (it was said to have left: forged)" in lines


def test_a_member_whose_heartbeat_stops_is_left_out_and_said_why() -> None:
    d, clock, _ = _decider(heartbeat_timeout_ms=1000)
    for m in ("a:1", "b:1"):
        d.receive(_ask(m, 1))
    _decided(d.tick(clock()))
    d.receive(_ask("a:1", 2, step=1))
    clock.now += 0.5
    d.beats({"a:1": 5, "b:1": 5})
    assert not [e for e in d.tick(clock()) if isinstance(e, Decided | Died)]
    clock.now += 0.8
    d.beats({"a:1": 6, "b:1": 5})  # b's counter stopped
    clock.now += 0.3
    effects = d.tick(clock())
    [died] = [e for e in effects if isinstance(e, Died)]
    assert died.member == "b:1" and "no heartbeat" in died.why
    done = _decided(effects)
    assert done.quorum.ids() == ["a:1"] and "no heartbeat" in done.quorum.left["b:1"]


def test_a_live_member_of_the_last_quorum_that_never_asks_is_left_out_after_the_join_timeout() -> (
    None
):
    """A group whose training thread hangs (a deadlock) keeps beating and never asks: the
    round waits for it up to ``join_timeout_ms`` from its first ask, then goes on without
    it, says so once, and the rounds after do not wait for it (as torchft's lighthouse)."""
    d, clock, lines = _decider(join_timeout_ms=3000, heartbeat_timeout_ms=5000)
    for m in ("a:1", "b:1", "c:1"):
        d.receive(_ask(m, 1))
    _decided(d.tick(clock()))
    d.receive(_ask("a:1", 2, step=1))
    d.receive(_ask("c:1", 2, step=1))
    for beat in range(1, 6):  # b beats on: alive, and silent
        clock.now += 0.5
        d.beats({"a:1": beat, "b:1": beat, "c:1": beat})
        assert not [e for e in d.tick(clock()) if isinstance(e, Decided)], clock.now
    clock.now += 0.6
    done = _decided(d.tick(clock()))
    assert done.quorum.ids() == ["a:1", "c:1"]
    assert done.quorum.left["b:1"] == "did not ask in time"
    [said] = [line for line in lines if "goes on without" in line]
    assert said.startswith("round 1 goes on without group b: alive, but it has not asked in 3.1 s")
    d.receive(_ask("a:1", 3, step=2))
    d.receive(_ask("c:1", 3, step=2))
    assert _decided(d.tick(clock())).quorum.ids() == ["a:1", "c:1"]  # not waited for again
    d.receive(_ask("b:1", 2, step=1))  # it runs again: a later round takes it back
    d.receive(_ask("a:1", 4, step=3))
    d.receive(_ask("c:1", 4, step=3))
    assert _decided(d.tick(clock())).quorum.ids() == ["a:1", "b:1", "c:1"]


def test_a_second_member_under_a_live_members_replica_id_is_held_then_refused() -> None:
    d, clock, _ = _decider(heartbeat_timeout_ms=1000)
    d.receive(_ask("7:a", 1))
    _decided(d.tick(clock()))
    d.receive(_ask("7:b", 1))
    d.receive(_ask("7:a", 2, step=1))
    done = _decided(d.tick(clock()))
    assert done.quorum.ids() == ["7:a"]  # held, not admitted
    for beat in (1, 2):  # both stay alive: b is no restarted a
        clock.now += 0.55
        d.beats({"7:a": beat, "7:b": beat})
    d.receive(_ask("7:a", 3, step=2))
    [refused] = [e for e in d.tick(clock()) if isinstance(e, Reply)]
    assert refused.member == "7:b" and refused.kind == "refused"
    assert "replica id '7' is taken by a live replica group (7:a)" in refused.why


def test_after_a_restart_the_first_quorum_waits_for_the_last_quorum_s_live_members() -> None:
    d, clock, _ = _decider(join_timeout_ms=60000, heartbeat_timeout_ms=5000)
    ask = _ask("a:1", 1, step=9)
    d.receive(Ask("ask", "a:1", 1, ask.request, prev=(4, ("a:1", "b:1"))))
    assert not [e for e in d.tick(clock()) if isinstance(e, Decided)]  # b is reconnecting
    d.receive(_ask("b:1", 1, step=9))
    done = _decided(d.tick(clock()))
    assert done.quorum.ids() == ["a:1", "b:1"] and done.quorum.quorum_id == 5
    # a member of that quorum that never comes back is waited for one heartbeat timeout
    d2, clock2, _ = _decider(join_timeout_ms=60000, heartbeat_timeout_ms=5000)
    d2.receive(Ask("ask", "a:1", 1, ask.request, prev=(4, ("a:1", "b:1"))))
    assert not [e for e in d2.tick(clock2()) if isinstance(e, Decided)]
    clock2.now += 5.1
    d2.receive(_ask("a:1", 1, step=9))  # (its heartbeat would keep it alive meanwhile)
    assert _decided(d2.tick(clock2())).quorum.ids() == ["a:1"]


def test_a_member_that_said_hello_and_has_not_asked_holds_only_a_job_s_first_quorum() -> None:
    """A group that made its manager may set up for minutes before it asks (a model built,
    compiled, loaded). It holds the job's first quorum up to the join timeout, as torchft's
    lighthouse does; later rounds (torchft's fast quorum) and the first quorum after a
    restart (the members carry the last one) are not held for it."""
    d, clock, _ = _decider(join_timeout_ms=60000, heartbeat_timeout_ms=5000)
    d.receive(Ask("hello", "b:1", replica_id="b"))  # b is coming: it has not asked yet
    d.receive(_ask("a:1", 1))
    assert not [e for e in d.tick(clock()) if isinstance(e, Decided)]
    clock.now += 60.1
    d.beats({"a:1": 1, "b:1": 1})
    assert _decided(d.tick(clock())).quorum.ids() == ["a:1"]
    d.receive(Ask("hello", "c:1", replica_id="c"))  # another, while a trains
    d.receive(_ask("a:1", 2, step=1))
    assert _decided(d.tick(clock())).quorum.ids() == ["a:1"]  # b and c beat: not waited for
    d.receive(_ask("c:1", 1))
    d.receive(_ask("a:1", 3, step=2))
    assert _decided(d.tick(clock())).quorum.ids() == ["a:1", "c:1"]  # c asked: it is in
    # a restarted lighthouse: a and c carry their quorum, b beats and has not asked
    d2, clock2, _ = _decider(join_timeout_ms=60000, heartbeat_timeout_ms=5000)
    d2.receive(Ask("hello", "b:1", replica_id="b"))
    d2.receive(Ask("ask", "a:1", 4, _ask("a:1", 4, step=3).request, prev=(3, ("a:1", "c:1"))))
    assert not [e for e in d2.tick(clock2()) if isinstance(e, Decided)]  # c: reconnecting
    d2.receive(Ask("ask", "c:1", 2, _ask("c:1", 2, step=3).request, prev=(3, ("a:1", "c:1"))))
    done = _decided(d2.tick(clock2()))
    assert done.quorum.ids() == ["a:1", "c:1"] and done.quorum.quorum_id == 4


def test_an_ask_told_to_ask_again_is_over_and_its_next_one_is_answered() -> None:
    """Below min_replicas a waiting member is told so and asks again: a quorum that then
    forms must answer its new ask, not the one it no longer waits on."""
    d, clock, _ = _decider(min_replicas=2)
    d.receive(Ask("hello", "b:1", replica_id="b"))
    d.receive(_ask("a:1", 1))
    clock.now += 6.0  # b said hello and went quiet: a alone is below min_replicas
    d.beats({"a:1": 1})
    [told] = [e for e in d.tick(clock()) if isinstance(e, Reply)]
    assert (told.member, told.seq, told.kind) == ("a:1", 1, "retry")
    d.receive(_ask("b:1", 1))  # b is back: enough, but a's first ask is over
    assert not [e for e in d.tick(clock()) if isinstance(e, Decided)]
    d.receive(_ask("a:1", 2))
    assert _decided(d.tick(clock())).answers == {"a:1": 2, "b:1": 1}


def test_an_ask_posted_again_after_a_stop_is_taken_once() -> None:
    """A member stopped while it waited posts its ask again (``again``): a lighthouse that
    answered it already ignores the copy, one that forgot it takes it as new."""
    d, clock, _ = _decider(min_replicas=2)
    d.receive(_ask("a:1", 1))
    d.receive(_ask("b:1", 1))
    first = _decided(d.tick(clock()))
    copy = Ask("ask", "a:1", 1, _ask("a:1", 1).request, again=True)
    d.receive(copy)  # answered in round 0: not asked again
    assert "a:1" not in d.pending
    d.receive(_ask("a:1", 2, step=1, retry_of=0))
    d.receive(Ask("ask", "a:1", 2, _ask("a:1", 2, step=1).request, again=True))
    assert d.pending["a:1"][1] == 2  # not answered yet: the same ask, still pending
    d.receive(_ask("b:1", 2, step=1))
    second = _decided(d.tick(clock()))
    assert second.quorum.round == first.quorum.round + 1 and not d.pending
    d.receive(_ask("a:1", 4, step=2))  # a copy of an ask it has since replaced
    d.receive(Ask("ask", "a:1", 3, _ask("a:1", 3, step=2).request, again=True))
    assert d.pending["a:1"][1] == 4
    fresh, clock2, _ = _decider(min_replicas=1)  # a lighthouse that never saw a:1
    fresh.receive(copy)
    assert _decided(fresh.tick(clock2())).answers == {"a:1": 1}


def test_an_asks_after_and_again_are_validated_and_named() -> None:
    ask = Ask("ask", "a:1", 3, _ask("a:1", 3).request, after=7, again=True)
    assert parse_message(ask.to_bytes(), "in/box") == ask
    body = json.loads(ask.to_bytes())
    for field, value in [("after", "7"), ("after", -1), ("after", True), ("again", 1)]:
        raw = json.dumps({**body, field: value}).encode()
        with pytest.raises(RecordError, match=f"in/box: '{field}' is"):
            parse_message(raw, "in/box")


def test_a_notice_soon_after_one_a_member_came_back_from_names_the_first_as_the_cause() -> None:
    """A group across nodes: rank 1's agent posts its death, rank 0 (its agent not told
    yet) asks again, then fails of that death, and its agent posts that."""
    d, clock, _ = _decider(heartbeat_timeout_ms=5000)
    for m in ("a:1", "b:1"):
        d.receive(_ask(m, 1))
    _decided(d.tick(clock()))
    d.receive(Ask("gone", "b:1", why="rank 1 killed by SIGKILL"))
    d.tick(clock())
    d.receive(_ask("b:1", 2, step=1))  # back, by its own ask
    clock.now += 1.0
    d.receive(Ask("gone", "b:1", why="rank 0 exited with 1"))
    [died] = [e for e in d.tick(clock()) if isinstance(e, Died)]
    assert died.why == "rank 1 killed by SIGKILL, then rank 0 exited with 1"
    d.receive(Ask("gone", "b:1", why="forged"))  # a notice come back from long ago
    d.tick(clock())
    d.receive(_ask("b:1", 3, step=1))
    clock.now += 6.0
    d.receive(_ask("a:1", 2, step=1))
    d.beats({"a:1": 1, "b:1": 1})
    d.tick(clock())
    d.receive(Ask("gone", "b:1", why="rank 0 killed by SIGKILL"))
    [died] = [e for e in d.tick(clock()) if isinstance(e, Died)]
    assert died.why == "rank 0 killed by SIGKILL"


def test_every_request_field_is_read_back_as_written_and_a_wrong_one_is_named() -> None:
    """Requests are read by every process hosting members, once per round and member: the
    common case is read on a fast path, which must accept exactly what the full check does."""
    full = Request("a:1", "a", 3, 2, ("h:1", "h:2"), 4, True, "ff" * 16, "x:1", "y:2", {})
    bare = Request("b:1", "b", 0, 1)
    signed = Request("c:1", "c", -5, 0)  # a coordination client's (torchft's are signed)
    for req in (full, bare, signed):
        assert Request.from_json(json.loads(json.dumps(req.to_json())), "r/1") == req
    assert "data" in full.to_json() and "data" not in bare.to_json()  # {} is not None
    body = full.to_json()
    wrong = [
        *[("step", v) for v in (True, "3", -(1 << 62), 1 << 62, 3.0)],
        *[("member", v) for v in (7, "m" * 257)],
        ("world_size", None), ("world_size", -1), ("secret", ["ff"]), ("shrink_only", 1),
        ("commit_failures", False), ("data", [1]), ("address", 1.5),
    ]  # fmt: skip
    for field, value in wrong:
        with pytest.raises(RecordError, match=f"r/1: '{field}' is"):
            Request.from_json({**body, field: value}, "r/1")
    for field in ("member", "replica_id", "step", "world_size"):
        with pytest.raises(RecordError, match=f"r/1: no '{field}'"):
            Request.from_json({k: v for k, v in body.items() if k != field}, "r/1")


def test_a_round_held_for_members_that_have_not_asked_says_whom_it_waits_for_once() -> None:
    d, clock, lines = _decider(heartbeat_timeout_ms=5000)
    for m in ("a:1", "b:1"):
        d.receive(_ask(m, 1))
    _decided(d.tick(clock()))
    d.receive(_ask("a:1", 2, step=1))
    d.tick(clock())
    for beat in (1, 2, 3):  # b is alive and does not ask (it is stuck in its step, say)
        clock.now += 1.0
        d.beats({"a:1": beat, "b:1": beat})
        d.tick(clock())
    assert lines == ["round 1 has waited 2.0 s for group b (alive, has not asked)"], lines
    d.receive(_ask("b:1", 2, step=1))
    assert _decided(d.tick(clock())).quorum.round == 1 and len(lines) == 1
