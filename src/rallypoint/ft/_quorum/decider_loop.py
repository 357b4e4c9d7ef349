"""The lighthouse's loop: read the inbox, let the decider decide, write what it decided.

It blocks in the store's own wait on its inbox (inbox.py), so it wakes when a member
writes; a ticker posts a ``tick`` every ``quorum_tick_ms`` for what time alone decides,
and fills the hole of a writer that died between taking a slot and writing it. A wake
takes every message that arrived; heartbeats at most once a tick. It writes ``r/<n>`` (a
round's quorum, once, with its answers in the same write), ``a/<member>/<seq>`` (each answer),
``news/<k>`` (a member died, a commit was voted down: for the members' watchers), ``o/<n>``
(``abort`` for a dead member's round) and ``status`` (why no quorum yet). What nobody
can need again is deleted (inbox slots at once, rounds ``RETAIN`` later, news 8 later,
forgotten members' heartbeats; etcd's history is compacted each minute): the store stays
the same size however long the job runs."""

from __future__ import annotations

import contextlib
import json
import queue
import secrets
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from rallypoint._core.quorum_line import quorum_line
from rallypoint.ft._quorum.client import STORE_LOST
from rallypoint.ft._quorum.decider import Decided, Decider, Died, Note, Reply
from rallypoint.ft._quorum.inbox import Inbox, post
from rallypoint.ft._quorum.records import (
    NEWS_KEPT,
    Ask,
    Quorum,
    RecordError,
    Rules,
    answer,
    changes,
    parse_counter,
    parse_message,
)
from rallypoint.rendezvous import KeyValueStore

__all__ = ["RETAIN", "DeciderLoop"]

RETAIN = 8
"""Rounds whose keys are kept: a member in round n's quorum is needed to decide n + 1, so
no member can still read a round this far back."""
_NEWS_EVERY = 5.0
"""Seconds between news when nothing happens (a watcher's wait that timed out would log a
warning of torch's)."""
_COMPACT_EVERY = 60.0
"""Seconds between compactions of the store's history (etcd's revisions)."""


class DeciderLoop:
    """One lighthouse life over ``kv`` (the loop's own connection)."""

    def __init__(self, kv: KeyValueStore, rules: Rules, say: Callable[[str], None]) -> None:
        self.kv = kv
        self.rules = rules
        self._say = say
        self.gen = secrets.token_hex(8)
        first_round = parse_counter(kv.get("round"), "round") + 1 if kv.get("round") else 0
        self.decider = Decider(rules, self.gen, first_round, say=say)
        self.inbox = Inbox(kv)
        self._news = parse_counter(kv.get("news/last"), "news/last")
        self._garbage: dict[int, list[str]] = {}
        self._last_beats = 0.0
        self._last_compact = time.monotonic()
        self._last_news = time.monotonic()
        self._last_status = ""
        self._status_at = 0.0
        self._shown: Quorum | None = None
        self._said: set[str] = set()
        self._beating: set[str] = set()
        """Members whose heartbeat counter was there at the last read."""
        self._ticks = 0
        self._stop = threading.Event()
        self._trash: queue.SimpleQueue[list[str] | None] = queue.SimpleQueue()
        """Keys to delete, off the path that answers asks (the janitor deletes them)."""
        kv.multi_set([("config", rules.to_bytes()), ("gen", self.gen.encode())])
        self.rounds = 0
        """Rounds decided in this life."""

    # ------------------------------------------------------------------ running
    def start(self, ticker_kv: KeyValueStore) -> list[threading.Thread]:
        janitor_kv = self.kv.clone()
        threads = [
            threading.Thread(
                target=self._janitor,
                args=(janitor_kv,),
                name="rallypoint-lighthouse-janitor",
                daemon=True,
            ),
            threading.Thread(target=self.run, name="rallypoint-lighthouse", daemon=True),
            threading.Thread(
                target=self._tick_loop,
                args=(ticker_kv,),
                name="rallypoint-lighthouse-tick",
                daemon=True,
            ),
        ]
        for thread in threads:
            thread.start()
        return threads

    def stop(self) -> None:
        self._stop.set()
        self._trash.put(None)

    def _janitor(self, kv: KeyValueStore) -> None:
        while (keys := self._trash.get()) is not None:
            with contextlib.suppress(*STORE_LOST):
                kv.delete_many(keys)

    def run(self) -> None:
        while not self._stop.is_set():
            try:
                self._once()
            except STORE_LOST as exc:  # the store is going away with its host: say it once
                if self._stop.is_set():
                    return
                self._say_once("lost", f"the store failed ({type(exc).__name__}: {exc}); going on")
                time.sleep(0.1)
            except Exception as exc:  # a defect here must not stop every group's training
                self._say(f"error in the decider, going on: {type(exc).__name__}: {exc}")
                time.sleep(0.1)

    def _once(self) -> None:
        self.inbox.wait(timedelta(hours=1))  # (an early wake takes none)
        taken = self.inbox.take()
        for key, raw in taken:
            try:
                msg = parse_message(raw, key)
            except RecordError as exc:
                self._say(f"ignoring a message: {exc}")  # consumed: said once
                continue
            self._take(msg)
        now = time.monotonic()
        if (now - self._last_beats) * 1000 >= self.rules.quorum_tick_ms:
            self._read_beats()
            self._last_beats = now
        known = self.decider.watched()
        for effect in self.decider.tick(now):
            self._write(effect)
        gone = self.decider.forgotten(known)
        if gone:
            self._trash.put([f"hb/{m}" for m in gone])
            self._beating.difference_update(gone)
        consumed = self.inbox.consumed(taken)
        if consumed:
            self._trash.put(consumed)
        self._write_status(now)
        if now - self._last_news > _NEWS_EVERY:
            self._publish({"tick": True})  # the watchers' waits end before they time out
        if now - self._last_compact > _COMPACT_EVERY:
            self._last_compact = now
            self.kv.compact()

    def _take(self, msg: Ask) -> None:
        if msg.kind == "gone":
            self.decider.receive(msg)
            with contextlib.suppress(RecordError):
                self.decider.gone_beat(
                    msg.member, parse_counter(self.kv.get(f"hb/{msg.member}"), "hb")
                )
        elif msg.kind == "abort":
            self._publish({"abort": msg.round, "member": msg.member})
        else:
            self.decider.receive(msg)
            if msg.after is not None:
                self._deleted_round(msg.after + 1)

    def _deleted_round(self, n: int) -> None:
        """A member of round ``n - 1`` asks and waits on round ``n``'s record, which was
        decided and deleted while it was stopped (past twice the heartbeat timeout, it was
        forgotten): a note there sends it to the answer under its own key."""
        key = f"r/{n}"
        if n >= self.decider.next_round or any(key in keys for keys in self._garbage.values()):
            return  # not decided yet, or its record is still there
        text = f"round {n} was deleted while this group waited (it was stopped, say)"
        self.kv.set(key, json.dumps({"note": text}).encode())
        self._garbage.setdefault(self.decider.next_round - 1, []).append(key)

    def _read_beats(self) -> None:
        """The watched members' counters: in one read for those seen beating; those not
        (yet: a coordination client may never beat) are looked for every tenth tick, since
        a missing key costs a round trip of its own."""
        watched = self.decider.watched()
        self._ticks += 1
        members = [m for m in watched if m in self._beating or self._ticks % 10 == 0]
        if not members:
            return
        values: dict[str, int | None] = {}
        for member, raw in zip(
            members, self.kv.multi_get([f"hb/{m}" for m in members]), strict=True
        ):
            if raw is None:
                self._beating.discard(member)
            else:
                self._beating.add(member)
            try:
                values[member] = parse_counter(raw, f"hb/{member}") if raw is not None else None
            except RecordError as exc:
                self._say_once(f"hb/{member}", f"ignoring a heartbeat: {exc}")
                values[member] = None
        self.decider.beats(values)

    def _say_once(self, key: str, line: str) -> None:
        if key not in self._said:
            if len(self._said) > 10_000:
                self._said.clear()
            self._said.add(key)
            self._say(line)

    # ------------------------------------------------------------------ writing
    def _write(self, effect: Decided | Died | Note | Reply) -> None:
        if isinstance(effect, Decided):
            self._decided(effect)
        elif isinstance(effect, Note):
            self.kv.set(f"r/{effect.round}", json.dumps({"note": effect.text}).encode())
            self._garbage.setdefault(effect.round, []).append(f"r/{effect.round}")
        elif isinstance(effect, Died):
            if effect.round is not None and effect.round in self._garbage:
                self.kv.set_if_absent(f"o/{effect.round}", b"abort")
            self._publish({"member": effect.member, "why": effect.why, "round": effect.round})
        else:
            key = f"a/{effect.member}/{effect.seq}"
            value = int(effect.why) if effect.kind == "round" else effect.why
            self.kv.set(key, answer(effect.kind, value))
            self._garbage.setdefault(self.decider.next_round - 1, []).append(key)

    def _decided(self, done: Decided) -> None:
        quorum = done.quorum
        n = quorum.round
        answers = [(f"a/{m}/{seq}", answer("round", n)) for m, seq in done.answers.items()]
        # one write, the round's record first: an answer names a round already there
        self.kv.multi_set([(f"r/{n}", quorum.to_bytes()), *answers, ("round", str(n).encode())])
        self._garbage.setdefault(n, []).extend(
            [f"r/{n}", f"c/{n}", f"o/{n}", *(k for k, _ in answers)]
        )
        self.rounds += 1
        # a member left out of the round after its last one may still wait on that round's
        # record (it was stopped, say): the record stays until it has moved on (or is
        # forgotten: then its ask brings a note back, _deleted_round)
        waited_on = {f"r/{last + 1}" for _, last in self.decider.answered.values()}
        for r in [r for r in self._garbage if r <= n - RETAIN]:
            keys = self._garbage.pop(r)
            kept = [k for k in keys if k in waited_on]
            if kept:
                self._garbage.setdefault(n, []).extend(kept)
            self._trash.put([k for k in keys if k not in waited_on])
        if self._shown is None or self._shown.quorum_id != quorum.quorum_id:
            self._say(describe(quorum, self._shown))
        self._shown = quorum

    def _publish(self, news: dict[str, Any]) -> None:
        self._last_news = time.monotonic()
        self._news += 1
        self.kv.multi_set(
            [
                (f"news/{self._news}", json.dumps(news).encode()),
                ("news/last", str(self._news).encode()),
            ]
        )
        if self._news > NEWS_KEPT:
            self._trash.put([f"news/{self._news - NEWS_KEPT}"])

    def _write_status(self, now: float) -> None:
        """Why no quorum yet, for a member's timeout line: once a tick at most (each wake
        of a round that waits for G members would write it)."""
        d = self.decider
        if d.pending and (now - self._status_at) * 1000 < self.rules.quorum_tick_ms:
            return
        self._status_at = now
        if not d.pending:
            line = ""
        elif len(d.pending) < self.rules.min_replicas:
            line = (
                f"{len(d.pending)} replica group(s) ask; the lighthouse needs --min_replicas "
                f"{self.rules.min_replicas}"
            )
        else:
            missing = [
                m
                for m in (d.previous.ids() if d.previous else [])
                if m not in d.pending and d.alive(m)
            ]
            line = (
                f"waiting for group(s) {', '.join(m.split(':')[0] for m in missing)}"
                if missing
                else ""
            )
        if line != self._last_status:
            self._last_status = line
            self.kv.set("status", line.encode() or b" ")

    # ------------------------------------------------------------------ the clock
    def _tick_loop(self, kv: KeyValueStore) -> None:
        interval = self.rules.quorum_tick_ms / 1000
        stuck_at, since = -1, time.monotonic()
        while not self._stop.wait(interval):
            try:
                post(kv, Ask("tick"))
                waits_on = self.inbox.stuck()
                if waits_on is None:
                    continue
                if waits_on != stuck_at:
                    stuck_at, since = waits_on, time.monotonic()
                elif time.monotonic() - since > max(5.0, 3 * interval):
                    self.inbox.fill(kv, stuck_at)
                    since = time.monotonic()
            except STORE_LOST:
                if self._stop.is_set():
                    return
                time.sleep(interval)


def describe(quorum: Quorum, previous: Quorum | None) -> str:
    """``quorum 7: groups 0, 2 (group 1 left: rank 0 killed by SIGKILL)``."""
    left, joined = changes(quorum, previous)
    return quorum_line(quorum.quorum_id, [m.replica_id for m in quorum.members], left, joined)
