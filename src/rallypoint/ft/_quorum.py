"""Per-step quorums of replica groups, agreed through a shared key-value store.

There is no quorum server: each group's rank 0 asks for a quorum every step, and the
members decide among themselves through the store (a TCPStore that ``rallypoint
lighthouse`` hosts, or an etcd cluster), whose set-if-absent makes one decision per round
stick. A round is decided (:func:`decide`) as soon as every live member of the previous
quorum, and every member that asked to join, has asked; the first quorum waits for
``min_replicas`` and for the registered members or ``join_timeout_ms``. A member left out
asks again in the next round. Liveness (:class:`Liveness`) is told (``gone/``: an agent
saw its worker die) or timed out (a heartbeat counter that stopped). The keys: docs/ft.md.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any

from rallypoint.rendezvous import KeyValueStore, KVError

__all__ = [
    "Liveness",
    "Quorum",
    "QuorumClient",
    "Request",
    "Rules",
    "changes",
    "decide",
    "gone_notices",
    "read_rules",
]

_TICK = 0.01
"""Seconds between a waiting member's looks at the round (a store round trip or two)."""


@dataclass(frozen=True, slots=True)
class Rules:
    """The lighthouse's rules, as torchft's flags name them (milliseconds)."""

    min_replicas: int = 1
    join_timeout_ms: int = 60000
    quorum_tick_ms: int = 100
    heartbeat_timeout_ms: int = 5000

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> Rules:
        data = json.loads(raw)
        return cls(**{k: int(v) for k, v in data.items() if k in cls.__dataclass_fields__})


@dataclass(frozen=True, slots=True)
class Request:
    """What a member asks with: who it is and where it stands."""

    member: str
    replica_id: str
    step: int
    world_size: int
    heal: tuple[str, ...] = ()
    """Its ranks' heal servers, by group rank (where a lagging group fetches state)."""
    commit_failures: int = 0
    shrink_only: bool = False

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "heal": list(self.heal)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Request:
        return cls(
            member=str(data["member"]),
            replica_id=str(data["replica_id"]),
            step=int(data["step"]),
            world_size=int(data["world_size"]),
            heal=tuple(str(a) for a in data.get("heal", ())),
            commit_failures=int(data.get("commit_failures", 0)),
            shrink_only=bool(data.get("shrink_only", False)),
        )


@dataclass(frozen=True, slots=True)
class Quorum:
    """A decided quorum: its id (it changes only when its members do, or after a failed
    commit), the store life it belongs to, and its members sorted by replica id."""

    quorum_id: int
    gen: str
    members: tuple[Request, ...]
    round: int = 0

    def ids(self) -> list[str]:
        return [m.member for m in self.members]

    def to_bytes(self) -> bytes:
        body = {
            "quorum_id": self.quorum_id,
            "gen": self.gen,
            "round": self.round,
            "members": [m.to_json() for m in self.members],
        }
        return json.dumps(body).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> Quorum:
        data = json.loads(raw)
        members = tuple(Request.from_json(m) for m in data["members"])
        return cls(int(data["quorum_id"]), str(data["gen"]), members, int(data.get("round", 0)))


def _sorted(requests: Sequence[Request]) -> tuple[Request, ...]:
    return tuple(sorted(requests, key=lambda r: (r.replica_id, r.member)))


def decide(
    requests: Sequence[Request],
    previous: Quorum | None,
    alive: Callable[[str], bool],
    registered: Sequence[str],
    waited: float,
    rules: Rules,
    joiners: Sequence[str] = (),
) -> list[Request] | None:
    """The members of the round's quorum, or ``None`` to wait. ``requests``: the round's so
    far; ``previous``: the quorum before it; ``registered``: every member that ever said it
    exists; ``joiners``: members that asked to join (not in ``previous``); ``waited``:
    seconds since this observer saw the round's first request."""
    live = {r.member: r for r in requests if alive(r.member)}
    if len(live) < max(1, rules.min_replicas):
        return None
    if previous is not None:
        expected = [m.member for m in previous.members if alive(m.member)]
        late = waited * 1000 >= rules.join_timeout_ms
        expected += [j for j in joiners if alive(j) and j not in expected and not late]
        if all(m in live for m in expected):
            shrink = any(r.shrink_only for r in live.values())
            if shrink:
                keep = set(expected)
                return [r for r in live.values() if r.member in keep]
            return list(live.values())
        return None
    everyone = [m for m in registered if alive(m)]
    if all(m in live for m in everyone) or waited * 1000 >= rules.join_timeout_ms:
        return list(live.values())
    return None


def next_quorum_id(previous: Quorum | None, members: Sequence[Request], gen: str) -> int:
    if previous is None or previous.gen != gen:
        return 1 if previous is None else previous.quorum_id + 1
    same = sorted(previous.ids()) == sorted(m.member for m in members)
    failed = any(m.commit_failures > 0 for m in members)
    return previous.quorum_id if same and not failed else previous.quorum_id + 1


@dataclass
class Liveness:
    """Who is alive, as one observer sees it: told (``gone/``) or timed out (heartbeats)."""

    timeout: float
    gone: dict[str, str] = field(default_factory=dict)
    seen_gone: int = 0
    beats: dict[str, tuple[int, float]] = field(default_factory=dict)

    def refresh(self, kv: KeyValueStore, members: Sequence[str]) -> None:
        count = int(kv.get("gone/count") or b"0")
        if count > self.seen_gone:
            for member, why in _notices(kv, self.seen_gone + 1, count):
                self.gone.setdefault(member, why)
            self.seen_gone = count
        now = time.monotonic()
        values = kv.multi_get([f"hb/{m}" for m in members]) if members else []
        for member, raw in zip(members, values, strict=True):
            beat = int(raw or b"0")
            last = self.beats.get(member)
            if last is None or last[0] != beat:
                self.beats[member] = (beat, now)

    def alive(self, member: str) -> bool:
        if member in self.gone:
            return False
        last = self.beats.get(member)
        return last is None or time.monotonic() - last[1] < self.timeout


def read_rules(kv: KeyValueStore, timeout: float) -> tuple[Rules, str]:
    """The lighthouse's rules and store life token (waits for a lighthouse that is still
    starting; an etcd store nobody configured gets the defaults, written once)."""
    deadline = time.monotonic() + timeout
    while True:
        raw, gen = kv.multi_get(["config", "gen"])
        if raw is not None and gen is not None:
            return Rules.from_bytes(raw), gen.decode()
        if time.monotonic() >= deadline:
            kv.set_if_absent("config", Rules().to_bytes())
            kv.set_if_absent("gen", secrets.token_hex(8).encode())
        time.sleep(0.05)


class QuorumClient:
    """A member: registers, beats its heart, asks for quorums (one thread at a time)."""

    def __init__(
        self,
        kv: KeyValueStore,
        member: str,
        *,
        heartbeat: timedelta = timedelta(milliseconds=100),
        connect_timeout: float = 60.0,
        beat_kv: KeyValueStore | None = None,
        reconnect: Callable[[], KeyValueStore] | None = None,
    ) -> None:
        self.kv = kv
        self.member = member
        self.rules, self.gen = read_rules(kv, connect_timeout)
        self.live = Liveness(self.rules.heartbeat_timeout_ms / 1000)
        self.previous: Quorum | None = None
        self._announced = False
        self._stop = threading.Event()
        # a connection of its own (a clone may share one per process, which a lighthouse
        # restart leaves dead for every clone after it)
        self._beat_kv = beat_kv if beat_kv is not None else kv.clone()
        self._reconnect = reconnect
        index = kv.add("members/count", 1)
        kv.set(f"members/{index}", member.encode())
        self._beat()
        self._beats = threading.Thread(
            target=self._beat_loop,
            args=(heartbeat.total_seconds(),),
            name="rallypoint-ft-heartbeat",
            daemon=True,
        )
        self._beats.start()

    def _beat(self) -> None:
        self._beat_kv.add(f"hb/{self.member}", 1)

    def _beat_loop(self, interval: float) -> None:
        while not self._stop.wait(interval):
            try:
                self._beat()
            except (KVError, RuntimeError, OSError):  # the store is away (a restarting
                if self._reconnect is not None:  # lighthouse): beat on a new connection
                    with contextlib.suppress(KVError, RuntimeError, OSError):
                        self._beat_kv = self._reconnect()

    def close(self, why: str = "") -> None:
        """Stop beating; with ``why``, tell the others at once that this member left."""
        self._stop.set()
        if why:
            with contextlib.suppress(KVError, RuntimeError, OSError):
                notify_gone(self.kv, self.member, why)

    def registered(self) -> list[str]:
        count = int(self.kv.get("members/count") or b"0")
        raws = self.kv.multi_get([f"members/{i}" for i in range(1, count + 1)])
        return [r.decode() for r in raws if r is not None]

    def request(self, req: Request, timeout: float) -> Quorum:
        """This step's quorum (one that includes this member), or ``TimeoutError``."""
        deadline = time.monotonic() + timeout
        n = int(self.kv.get("round") or b"0")
        while True:
            quorum = self._in_round(n, req, deadline)
            if quorum is not None and self.member in quorum.ids():
                self.previous = quorum
                return quorum
            nxt = str(n + 1).encode()
            self.kv.compare_and_swap("round", str(n).encode() if n else b"", nxt)
            n = max(n + 1, int(self.kv.get("round") or b"0"))

    def _in_round(self, n: int, req: Request, deadline: float) -> Quorum | None:
        """Ask in round ``n``; its quorum once decided (possibly without this member)."""
        index = self.kv.add(f"r/{n}/count", 1)
        self.kv.set(f"r/{n}/req/{index}", json.dumps(req.to_json()).encode())
        first_seen = time.monotonic()
        previous = self._previous(n)
        self._announce(previous)
        while True:
            raw = self.kv.get(f"r/{n}/q")
            if raw is not None:
                return Quorum.from_bytes(raw)
            requests = self._requests(n)
            members = sorted({r.member for r in requests} | set(previous.ids() if previous else []))
            self.live.refresh(self.kv, members)
            chosen = decide(
                requests,
                previous,
                self.live.alive,
                self.registered() if previous is None else [],
                time.monotonic() - first_seen,
                self.rules,
                self._joiners(previous),
            )
            if chosen is not None:
                quorum = Quorum(
                    next_quorum_id(previous, chosen, self.gen), self.gen, _sorted(chosen), n
                )
                stored = self.kv.set_if_absent(f"r/{n}/q", quorum.to_bytes())
                if stored == quorum.to_bytes():
                    self.kv.compare_and_swap(
                        "round", str(n).encode() if n else b"", str(n + 1).encode()
                    )
                continue
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"no quorum within the timeout: round {n} has {len(requests)} request(s); "
                    f"the lighthouse needs {self.rules.min_replicas} replica group(s)"
                    + _waiting_for(previous, requests, self.live)
                )
            time.sleep(_TICK)  # a store wait this short logs a C++ warning each time

    def _announce(self, previous: Quorum | None) -> None:
        """A member outside the last quorum says it wants in: the next decision waits for
        its request (up to ``join_timeout_ms``) instead of racing it."""
        if previous is None or self.member in previous.ids() or self._announced:
            return
        self._announced = True
        index = self.kv.add("joins/count", 1)
        self.kv.set(f"joins/{index}", self.member.encode())

    def _joiners(self, previous: Quorum | None) -> list[str]:
        count = int(self.kv.get("joins/count") or b"0")
        raws = self.kv.multi_get([f"joins/{i}" for i in range(1, count + 1)]) if count else []
        inside = set(previous.ids()) if previous is not None else set()
        return [r.decode() for r in raws if r is not None and r.decode() not in inside]

    def _previous(self, n: int) -> Quorum | None:
        if n == 0:
            return None
        raw = self.kv.get(f"r/{n - 1}/q")
        return Quorum.from_bytes(raw) if raw is not None else self.previous

    def _requests(self, n: int) -> list[Request]:
        count = int(self.kv.get(f"r/{n}/count") or b"0")
        raws = self.kv.multi_get([f"r/{n}/req/{i}" for i in range(1, count + 1)])
        found: dict[str, Request] = {}
        for raw in raws:
            if raw is not None:
                req = Request.from_json(json.loads(raw))
                found[req.member] = req
        return list(found.values())


def _waiting_for(previous: Quorum | None, requests: Sequence[Request], live: Liveness) -> str:
    if previous is None:
        return ""
    asked = {r.member for r in requests}
    missing = [
        m.replica_id for m in previous.members if m.member not in asked and live.alive(m.member)
    ]
    return f"; waiting for group(s) {', '.join(missing)}" if missing else ""


def _notices(kv: KeyValueStore, first: int, last: int) -> list[tuple[str, str]]:
    """``(member, why)`` of notices ``first`` to ``last`` (as :func:`notify_gone` writes them)."""
    pairs = []
    for raw in kv.multi_get([f"gone/{i}" for i in range(first, last + 1)]):
        if raw is not None:
            member, _, why = raw.decode(errors="replace").partition("\n")
            pairs.append((member, why))
    return pairs


def gone_notices(kv: KeyValueStore) -> dict[str, str]:
    """Every notice so far: member -> why it left (``rank 0 killed by SIGKILL``)."""
    return dict(_notices(kv, 1, int(kv.get("gone/count") or b"0")))


def changes(
    quorum: Quorum, previous: Quorum | None, gone: dict[str, str]
) -> tuple[list[tuple[str, str]], list[tuple[str, int]]]:
    """``(left, joined)`` since ``previous``: ``(replica id, why)`` of each group that left,
    ``(replica id, step)`` of each that joined (none for the first quorum)."""
    if previous is None:
        return [], []
    now = {m.member for m in quorum.members}
    before = {m.member for m in previous.members}
    left = [
        (m.replica_id, gone.get(m.member, "no heartbeat, or it did not ask in time"))
        for m in previous.members
        if m.member not in now
    ]
    joined = [(m.replica_id, m.step) for m in quorum.members if m.member not in before]
    return left, joined


def notify_gone(kv: KeyValueStore, member: str, why: str) -> None:
    """Tell every member that ``member`` left (its agent saw its worker die, or it shut down)."""
    index = kv.add("gone/count", 1)
    kv.set(f"gone/{index}", f"{member}\n{why}".encode())
