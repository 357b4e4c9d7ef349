"""The cross-group process group's guard: which quorum it is configured for, and a watcher
thread that aborts it the moment that quorum is broken — a member gone (its agent said so,
or its heartbeat stopped) or a participant that voted the step down — so that no
collective waits on a dead group or on a step that cannot commit.

The watcher learns both from the lighthouse's news (``news/<k>``), waiting on the next
one with the store's own wait on a connection of its own: it reads nothing while nothing
happens, whatever the number of groups. An abort never waits for a configuration: the
rendezvous runs on a thread of its own, and the abort ends the wait for it (and for the
collectives of the group it ends: :class:`Ending`).
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from rallypoint.ft._plan import Plan
from rallypoint.ft._quorum.client import STORE_LOST, read_life
from rallypoint.ft._quorum.records import NEWS_KEPT, RecordError, parse_counter
from rallypoint.rendezvous import KeyValueStore

__all__ = ["Ending", "GroupGuard"]

Key = tuple[str, int]
"""A configuration: the lighthouse life and the quorum id."""

_WAIT = timedelta(seconds=20)


class Ending:
    """Set once, when the process group configured with it is aborted; it wakes whoever
    waits on something of that group (its rendezvous, a collective): gloo may never end a
    collective whose peer died, whatever the abort cuts."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._set = False
        self._wakes: set[threading.Event] = set()

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        with self._lock:
            self._set = True
            wakes, self._wakes = self._wakes, set()
        for event in wakes:
            event.set()

    def wait(self, done: threading.Event) -> bool:
        """Wait until ``done`` is set, or this is; whether ``done`` was."""
        with self._lock:
            if not self._set:
                self._wakes.add(done)
        done.wait()
        with self._lock:
            self._wakes.discard(done)
        return not self._set


class GroupGuard:
    """A configuration and an abort never interleave; an abort names the configuration it
    ended, so an error it reports concerns that group and not a newer one."""

    def __init__(
        self,
        pg: Any,
        kv: KeyValueStore,
        connect: Callable[[], KeyValueStore],
        report: Callable[[Exception], None],
        say: Callable[[str], None],
    ) -> None:
        self._pg, self._connect, self._report, self._say = pg, connect, report, say
        self._lock = threading.Lock()
        self.configured: Key | None = None
        self.left: Exception | None = None
        """The error of the last abort, until a new configuration replaces the group."""
        self.kv = kv
        """The watcher's own connection to the lighthouse (``connect`` makes a new one)."""
        self._life = ""
        """The lighthouse life whose news the watcher reads (its ``gen``)."""
        self._dead: dict[str, tuple[str, int, str]] = {}
        """member -> (why, the last round that held it, the life), as the news told."""
        self._aborted: dict[tuple[str, int], None] = {}
        """(life, round)s the news said a participant voted down (the latest 64): a
        lighthouse started again numbers its rounds anew, so a round is named by both."""
        self._plan: Plan | None = None
        self._fresh = True
        """Whether ``kv`` is the connection it was given (not yet found broken)."""
        self.ending = Ending()
        """The end of the process group configured last (set by its abort)."""

    def configure(self, key: Key, plan: Plan, make: Callable[[], None]) -> bool:
        """Run ``make`` (configure the process group) unless ``key`` is configured already;
        whether it ran. A member the news already reported dead in this round fails the
        step at once: no rendezvous is begun that it cannot finish, and one under way is
        left (on its thread) when the news comes."""
        with self._lock:
            self._plan = plan
            if self.configured == key:
                return False
            dead = self._dead_in(plan, key[0])
            if dead or (key[0], plan.round) in self._aborted:  # a group begun now could not finish
                # its step: its peers that voted it down will not run the step's collectives
                self.left = self._left_error(dead) if dead else _voted_down(plan.round)
                self._report(self.left)
                return False
            self.configured, ending = key, Ending()
            self.ending = ending
        failed: list[BaseException] = []
        done = threading.Event()

        def run() -> None:
            try:
                make()
            except BaseException as exc:  # raised in the quorum's thread, below
                failed.append(exc)
            finally:
                done.set()

        threading.Thread(target=run, name="rallypoint-ft-configure", daemon=True).start()
        if not ending.wait(done):  # aborted meanwhile: the rendezvous is left to its timeout
            raise self.left or RuntimeError("the process group was aborted")
        if failed:
            with self._lock:
                if self.configured == key:
                    self.configured = None
            raise failed[0]
        dead = self._dead_in(plan, key[0])
        if dead:
            self._abort(key, self._left_error(dead))
        return True

    def _dead_in(self, plan: Plan, life: str) -> list[str]:
        dead = self._dead
        return [
            m for m in plan.members if m in dead and dead[m][2] == life and dead[m][1] >= plan.round
        ]

    def watch(self, stop: threading.Event, me: str) -> None:
        """Until ``stop``: wait for each piece of news and act on it."""
        seen, linked = 0, False
        while not stop.is_set():
            if not linked:  # its news from now on, on a new link once the first broke
                try:  # (never again on a broken one: each try logs a warning of torch's)
                    if not self._fresh:
                        self.kv = self._connect()
                    life, last = read_life(self.kv, 2.0)[1], self._last()
                    # the news kept that it has not read (before it first linked, or while
                    # away; of a new life, all of them): none is missed for being early
                    known = seen if life == self._life else 0
                    seen = max(known, last - NEWS_KEPT)
                    self._life, linked = life, True
                except STORE_LOST:
                    self._fresh = False
                    stop.wait(1.0)
                    continue
            key = f"news/{seen + 1}"
            try:
                if not self.kv.wait([key], _WAIT):
                    seen = max(seen, self._last() - 8)  # fell behind the news kept
                    continue
                raw = self.kv.get(key)
            except STORE_LOST:  # the lighthouse is away
                linked = self._fresh = False
                continue
            seen += 1
            if raw is not None:
                self._act(key, raw, me)

    def _last(self) -> int:
        try:
            return parse_counter(self.kv.get("news/last"), "news/last")
        except RecordError as exc:
            self._say(f"ignoring a record in the lighthouse's store: {exc}")
            return 0

    def _act(self, key: str, raw: bytes, me: str) -> None:
        try:
            news = json.loads(raw)
            if not isinstance(news, dict):
                raise ValueError("not an object")
            if "tick" in news:
                return
            if "abort" in news:
                self._aborted_round(self._life, int(news["abort"]))
                return
            member, why, last = str(news["member"]), str(news["why"]), news.get("round")
            last_round = -1 if last is None else int(last)
        except (ValueError, KeyError, TypeError) as exc:
            self._say(f"ignoring a record in the lighthouse's store: {key}: {exc}")
            return
        self._dead[member] = (why[:200], last_round, self._life)
        if len(self._dead) > 4096:
            self._dead.pop(next(iter(self._dead)))
        plan, configured = self._plan, self.configured
        if plan is None or configured is None or member == me or member not in plan.members:
            return
        if configured[0] == self._life and last_round >= plan.round:
            self._abort(configured, self._left_error([member]))

    def _aborted_round(self, life: str, round_: int) -> None:
        with self._lock:  # recorded first: a configuration for it that begins later fails
            self._aborted[(life, round_)] = None
            if len(self._aborted) > 64:
                del self._aborted[next(iter(self._aborted))]
            plan, configured = self._plan, self.configured
        if (
            plan is not None
            and configured is not None
            and configured[0] == life
            and plan.round == round_
        ):
            self._abort(configured, _voted_down(round_))

    def _left_error(self, members: list[str]) -> RuntimeError:
        why = "; ".join(f"group {m.split(':')[0]}: {self._dead[m][0]}" for m in members)
        return RuntimeError(f"replica group(s) left the quorum ({why})")

    def _abort(self, key: Key, error: Exception) -> None:
        with self._lock:
            if self.configured != key:  # a newer group replaced it meanwhile
                return
            self.left = error
            self._report(error)
            self.configured = None  # the next quorum makes a new group, same id or not
            with contextlib.suppress(Exception):
                self._pg.abort()
            self.ending.set()


def _voted_down(round_: int) -> RuntimeError:
    return RuntimeError(
        f"a replica group could not finish this step (round {round_} was voted down)"
    )
