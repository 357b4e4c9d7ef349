"""The lighthouse's decisions: who is alive, and each round's quorum (no I/O here).

It learns from messages (hello, ask, gone) and the heartbeat counters its loop reads each
tick (``_decider_loop`` writes what it decides). A request stays pending until a quorum
holds it. A round is decided once every live member of the previous quorum has asked
(joiners that asked come in; one that only said hello is not waited for, as in torchft's
fast quorum), or ``join_timeout_ms`` after its first ask without a live member that stays
silent (hung: torchft's lighthouse does the same); a job's first quorum waits for every
member known alive, or ``join_timeout_ms``; after a restart, for the previous quorum the
members carry. A member is gone when told or when its counter stops for
``heartbeat_timeout_ms``; a notice about a member that then asks, or whose counter moves
twice more, is not believed (anyone with store access can write one).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from rallypoint.ft._quorum.records import Ask, Quorum, Request, Rules, sort_members

__all__ = ["Decided", "Decider", "Died", "Note", "Reply"]


@dataclass
class _Member:
    replica_id: str
    moved: float
    """When its heartbeat counter last moved (or it asked, or said hello)."""
    first: float = 0.0
    beat: int | None = None
    gone: str | None = None
    gone_beat: int | None = None
    dead_since: float | None = None
    """When the decider last saw it go from alive to dead (its death was announced)."""
    last_round: int | None = None
    revived: tuple[str, float] | None = None
    """The notice it came back from by asking, and when (:meth:`Decider._told_gone`)."""


@dataclass(frozen=True, slots=True)
class Decided:
    quorum: Quorum
    answers: dict[str, int]
    """member -> the ``seq`` of the ask this quorum answers."""


@dataclass(frozen=True, slots=True)
class Died:
    member: str
    why: str
    round: int | None
    """The last round that held it (its commit cannot succeed without it)."""


@dataclass(frozen=True, slots=True)
class Note:
    """Why round ``round`` is not a quorum (written in its place: the members that wait
    on it say so once, then wait for their own answer)."""

    round: int
    text: str


@dataclass(frozen=True, slots=True)
class Reply:
    """An answer that is not a quorum: ``retry`` (ask again, with why) or ``refused``."""

    member: str
    seq: int
    kind: str
    why: str


Effect = Decided | Died | Note | Reply

SAY_WAIT_AFTER = 2.0
"""Seconds a round may wait for members' asks before the lighthouse says whom it waits for."""


@dataclass
class Decider:
    rules: Rules
    gen: str
    next_round: int = 0
    say: Callable[[str], None] = lambda line: None
    clock: Callable[[], float] = time.monotonic
    members: dict[str, _Member] = field(default_factory=dict)
    pending: dict[str, tuple[Request, int]] = field(default_factory=dict)
    previous: Quorum | None = None
    carried: tuple[int, tuple[str, ...]] | None = None
    """The newest previous quorum members carried into this life: ``(id, members)``."""
    first_ask: float | None = None
    said_below: int | None = None
    held: dict[str, float] = field(default_factory=dict)
    """Members waiting because another live member has their replica id: since when."""
    started: float = field(default=0.0)
    answered: dict[str, tuple[int, int]] = field(default_factory=dict)
    """member -> (seq, round) of its last answered ask."""
    again: list[Reply] = field(default_factory=list)
    retrying: set[str] = field(default_factory=set)
    """Members whose pending ask repeats one whose round they could not read."""
    departed: dict[str, str] = field(default_factory=dict)
    """The last 64 members that left a quorum, and why."""
    told_below: set[str] = field(default_factory=set)
    below_text: str = ""
    note_round: int = 0
    said_wait: tuple[int, tuple[str, ...]] | None = None

    def __post_init__(self) -> None:
        self.started = self.clock()

    # ------------------------------------------------------------------ what it learns
    def receive(self, msg: Ask) -> None:
        """Take one message in (the loop calls :meth:`tick` after each batch)."""
        now = self.clock()
        if msg.kind in ("tick", "hole", "abort"):
            return  # a tick only wakes the loop; an abort the loop relays as news
        if msg.kind == "gone":
            self._told_gone(msg.member, msg.why or "left")
            return
        req = msg.request
        rid = req.replica_id if req is not None else msg.replica_id or msg.member.split(":")[0]
        seen = self._see(msg.member, rid, now)
        if msg.prev is not None and (self.carried is None or msg.prev[0] > self.carried[0]):
            self.carried = msg.prev
        if msg.kind == "ask" and req is not None:
            self._revive(msg.member, seen, "")
            answered = self.answered.get(msg.member)
            if msg.retry_of and answered is not None and answered[0] == msg.retry_of:
                # its answer was unreadable (overwritten by someone): the same round again
                self.again.append(Reply(msg.member, msg.seq, "round", str(answered[1])))
                return
            pending = self.pending.get(msg.member)
            if msg.again and (
                (answered is not None and answered[0] >= msg.seq)
                or (pending is not None and pending[1] > msg.seq)
            ):
                return  # posted again after a stop, and answered or overtaken meanwhile
            if msg.retry_of:  # it could not read the round it waited on: answer its key
                self.retrying.add(msg.member)
            self.pending[msg.member] = (req, msg.seq)
            if self.first_ask is None:
                self.first_ask = now

    def beats(self, values: dict[str, int | None]) -> None:
        """The heartbeat counters just read (``None``: missing or unreadable)."""
        now = self.clock()
        for member, value in values.items():
            seen = self.members.get(member)
            if seen is None or value is None:
                continue
            if seen.beat != value:
                seen.beat, seen.moved = value, now
            if seen.gone is not None and seen.gone_beat is None:
                seen.gone_beat = value  # the first count read after the notice
            elif seen.gone is not None and value >= (seen.gone_beat or 0) + 2:
                self._revive(member, seen, "its heartbeat still moves")

    def _revive(self, member: str, seen: _Member, why: str) -> None:
        """A member said to have left shows it has not (anyone who can write the store can
        write a notice): the notice is not believed."""
        if seen.gone is not None and why:
            self.say(f"a notice that {member} left ({seen.gone}) is not believed: {why}")
        elif seen.gone is not None:
            self.say(f"{member} asks again: it is back (it was said to have left: {seen.gone})")
            seen.revived = (seen.gone, self.clock())
        seen.gone, seen.gone_beat, seen.dead_since = None, None, None

    def watched(self) -> list[str]:
        """The members whose heartbeat counters the loop reads each tick."""
        return list(self.members)

    def gone_beat(self, member: str, value: int | None) -> None:
        """The counter of ``member`` at the moment a notice about it arrived."""
        seen = self.members.get(member)
        if seen is not None and seen.gone is not None:
            seen.gone_beat = value if value is not None else seen.beat

    def _see(self, member: str, replica_id: str, now: float) -> _Member:
        seen = self.members.get(member)
        if seen is None:
            seen = self.members[member] = _Member(replica_id, now, now)
        seen.moved = now
        return seen

    def _told_gone(self, member: str, why: str) -> None:
        """A notice. One that follows, within the heartbeat timeout, a notice the member
        came back from by asking names both, the first first: a group across nodes whose
        rank died asks once more from its rank 0 (its agent has not heard yet), then that
        rank fails of the death, and the first notice is the cause."""
        now = self.clock()
        seen = self.members.get(member)
        if seen is None:
            seen = self.members[member] = _Member(member.split(":")[0], now, now)
        if seen.gone is None:
            first, seen.revived = seen.revived, None
            if first is not None and now - first[1] < self.rules.heartbeat_timeout_ms / 1000:
                why = f"{first[0]}, then {why}"
            seen.gone = why

    # ------------------------------------------------------------------ liveness
    def alive(self, member: str, now: float | None = None) -> bool:
        seen = self.members.get(member)
        if seen is None:
            return False
        now = self.clock() if now is None else now
        return seen.gone is None and (now - seen.moved) * 1000 < self.rules.heartbeat_timeout_ms

    def why_gone(self, member: str) -> str:
        seen = self.members.get(member)
        if seen is None:
            return "unknown to this lighthouse"
        if seen.gone is not None:
            return seen.gone
        return f"no heartbeat for {self.rules.heartbeat_timeout_ms / 1000:g} s"

    # ------------------------------------------------------------------ deciding
    def tick(self, now: float) -> list[Effect]:
        effects: list[Effect] = [*self.again, *self._deaths(now)]
        self.again.clear()
        effects += self._duplicates(now)
        effects += self._decide(now)
        self._forget(now)
        return effects

    def _deaths(self, now: float) -> list[Died]:
        out = []
        for member, seen in self.members.items():
            if seen.dead_since is None and not self.alive(member, now):
                seen.dead_since = now
                out.append(Died(member, self.why_gone(member), seen.last_round))
            elif seen.dead_since is not None and self.alive(member, now):
                seen.dead_since = None
        return out

    def _duplicates(self, now: float) -> list[Reply]:
        """A member asking under the replica id of an older live member is held; still
        held after the heartbeat timeout (the older one is not a dead predecessor), it is
        refused."""
        oldest: dict[str, tuple[float, str]] = {}
        for member, seen in self.members.items():
            if self.alive(member, now):
                best = oldest.get(seen.replica_id)
                if best is None or (seen.first, member) < best:
                    oldest[seen.replica_id] = (seen.first, member)
        holding: dict[str, float] = {}
        out = []
        for member in list(self.pending):
            seen = self.members[member]
            first = oldest.get(seen.replica_id)
            if first is None or first[1] == member or not self.alive(member, now):
                continue
            since = holding[member] = self.held.get(member, now)
            if (now - since) * 1000 >= self.rules.heartbeat_timeout_ms:
                _, seq = self.pending.pop(member)
                del holding[member]
                why = (
                    f"replica id {seen.replica_id!r} is taken by a live replica group "
                    f"({first[1]}): give each group its own REPLICA_GROUP_ID"
                )
                self.say(f"refused {member}: {why}")
                out.append(Reply(member, seq, "refused", why))
        self.held = holding
        return out

    def _decide(self, now: float) -> list[Effect]:
        below = self._below(now)
        if below:
            return below
        decided = self._choose(now)
        return [decided] if decided is not None else []

    def _below(self, now: float) -> list[Effect]:
        """Fewer live groups than ``min_replicas``: said once per count, on the lighthouse
        and to each waiting group (in the round it waits on, or in its own answer)."""
        live = [m for m in self.pending if self.alive(m, now) and m not in self.held]
        groups = [m for m in self.members if self.alive(m, now) and m not in self.held]
        if not live or len(groups) >= self.rules.min_replicas:
            return []  # (fewer ask, but the others are alive: they are coming)
        out: list[Effect] = []
        self.below_text = (
            f"waiting: {len(groups)} replica group(s) alive, the lighthouse's "
            f"--min_replicas is {self.rules.min_replicas}"
        )
        if self.said_below is None:  # once until a quorum forms (not once per count: 64
            # groups starting one by one would each be told 63 times)
            self.said_below, self.told_below = len(groups), set()
            self.say(self.below_text)
            out.append(Note(self.next_round, self.below_text))
            self.note_round = self.next_round
            self.next_round += 1  # that round is the note: the next decision is the one after
        for member in live:
            if member in self.told_below:
                continue
            self.told_below.add(member)
            last = self.answered.get(member)
            if last is None or last[1] != self.note_round - 1:  # it waits on its answer
                _, seq = self.pending.pop(member)  # it asks again: this ask is over (a
                out.append(Reply(member, seq, "retry", self.below_text))  # quorum holding
                # it would answer a key it no longer waits on)
        return out

    def _choose(self, now: float) -> Decided | None:
        live = {
            m: req
            for m, (req, _) in self.pending.items()
            if self.alive(m, now) and m not in self.held
        }
        if not live:
            return None
        if len(live) < self.rules.min_replicas:
            return None
        waited = now - (self.first_ask or now)
        if self.previous is not None:
            expected = [m for m in self.previous.ids() if self.alive(m, now)]
            missing = [m for m in expected if m not in live]
            if missing and waited * 1000 < self.rules.join_timeout_ms:
                self._waits(missing, waited)
                return None
            if missing:  # alive and silent that long: hung (a deadlock, say), as torchft
                self._goes_on_without(missing, waited)  # leaves out such a straggler
            if any(r.shrink_only for r in live.values()):
                live = {m: r for m, r in live.items() if m in expected}
        else:
            expected = self._first_expected(now)
            if not all(m in live for m in expected) and waited * 1000 < self.rules.join_timeout_ms:
                self._waits([m for m in expected if m not in live], waited)
                return None
        return self._make(list(live.values()), now)

    def _waits(self, missing: list[str], waited: float) -> None:
        """A round held ``waited`` s (since its first ask) for members that have not asked:
        after ``SAY_WAIT_AFTER`` s, said once per round and set of members (a long pause,
        explained on the lighthouse)."""
        said = (self.next_round, tuple(missing))
        if waited < SAY_WAIT_AFTER or self.said_wait == said:
            return
        self.said_wait = said
        why = [
            f"group {self._replica_id(m)} "
            + ("(alive, has not asked)" if m in self.members else "(not back since the restart)")
            for m in missing
        ]
        self.say(f"round {self.next_round} has waited {waited:.1f} s for " + ", ".join(why))

    def _goes_on_without(self, missing: list[str], waited: float) -> None:
        groups = ", ".join(f"group {self._replica_id(m)}" for m in missing)
        self.say(
            f"round {self.next_round} goes on without {groups}: alive, but it has not asked "
            f"in {waited:.1f} s (--join_timeout_ms {self.rules.join_timeout_ms}): hung, say; "
            "a later round takes it back when it asks"
        )

    def _replica_id(self, member: str) -> str:
        return self.members[member].replica_id if member in self.members else member.split(":")[0]

    def _first_expected(self, now: float) -> list[str]:
        """Whom a life's first quorum waits for (up to ``join_timeout_ms``). At a job's
        start, every member known alive, as torchft's lighthouse waits for every replica
        that beats. After a restart, the live members of the last quorum the members
        carried, and those of it that have not reached this life yet while their
        heartbeat would still hold (they are reconnecting); not a group that beats and has
        not asked, which may be setting up for minutes (it joins a later round, as in any
        round after the first)."""
        if self.carried is None:
            return [m for m in self.members if self.alive(m, now)]
        within = (now - self.started) * 1000 < self.rules.heartbeat_timeout_ms
        return [
            m for m in self.carried[1] if self.alive(m, now) or (m not in self.members and within)
        ]

    def _make(self, chosen: list[Request], now: float) -> Decided:
        previous = self.previous
        ids = sorted(r.member for r in chosen)
        failed = any(r.commit_failures > 0 for r in chosen)
        if previous is not None:
            same = sorted(previous.ids()) == ids
            quorum_id = previous.quorum_id if same and not failed else previous.quorum_id + 1
        else:
            quorum_id = (self.carried[0] if self.carried is not None else 0) + 1
        before = (
            previous.ids()
            if previous is not None
            else list(self.carried[1] if self.carried else ())
        )
        for m in before:
            if m not in ids:
                self.departed[m] = (
                    self.why_gone(m) if not self.alive(m, now) else "did not ask in time"
                )
        while len(self.departed) > 64:
            del self.departed[next(iter(self.departed))]
        # every recent departure with its reason: a group whose own last quorum is older
        # than the lighthouse's still finds why each member it knew left
        left = {m: why for m, why in self.departed.items() if m not in ids}
        quorum = Quorum(
            quorum_id, self.gen, sort_members(chosen), self.next_round, left, time.time()
        )
        answers = {}
        for req in chosen:
            _, seq = self.pending.pop(req.member)
            last = self.answered.get(req.member)
            if last is None or last[1] != self.next_round - 1 or req.member in self.retrying:
                answers[req.member] = seq  # a member of the last round waits on this one
            self.retrying.discard(req.member)
            self.answered[req.member] = (seq, self.next_round)
            self.members[req.member].last_round = self.next_round
        self.next_round += 1
        self.previous, self.first_ask, self.said_below = quorum, None, None
        if self.pending:
            self.first_ask = now
        return Decided(quorum, answers)

    def _forget(self, now: float) -> None:
        """Members dead for twice the heartbeat timeout and in no quorum are dropped."""
        keep = set(self.previous.ids()) if self.previous is not None else set()
        limit = 2 * self.rules.heartbeat_timeout_ms / 1000
        for member in [
            m
            for m, s in self.members.items()
            if m not in keep and s.dead_since is not None and now - s.dead_since > limit
        ]:
            del self.members[member]
            self.pending.pop(member, None)
            self.answered.pop(member, None)

    def forgotten(self, known: list[str]) -> list[str]:
        """Of ``known``, the members this decider no longer tracks."""
        return [m for m in known if m not in self.members]
