"""A member's side of the quorum protocol: ask, then wait on the answer's key.

A member posts a message to the lighthouse's inbox (inbox.py: two sends, or two store
operations where the store cannot append) and waits for the one key that answers it
(``a/<member>/<seq>``) with the store's own blocking wait: no polling, and O(1)
operations per round whatever the number of groups.
The answer names the round, whose quorum it reads once (``r/<n>``). A lighthouse that is
restarted costs a reconnect: the member says hello to the new life, with the last quorum
it had, and asks again. Heartbeats are a counter (``hb/<member>``) the member ``add``s to
on a connection of its own; a beat that finds the process was stopped meanwhile posts the
ask in flight again (the lighthouse may have forgotten the member, or deleted the round it
waits on). Nothing here imports torch (an agent posts its notices through :func:`post`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from datetime import timedelta

from rallypoint._core.fatal import FatalError
from rallypoint._core.net import await_listener
from rallypoint.ft._quorum.inbox import post
from rallypoint.ft._quorum.records import (
    Ask,
    Quorum,
    RecordError,
    Request,
    RoundNote,
    Rules,
    parse_answer,
)
from rallypoint.rendezvous import (
    KeyValueStore,
    KVConnectionError,
    KVError,
    KVStateError,
    connect_kv,
    is_etcd_address,
)

__all__ = [
    "STORE_LOST",
    "LighthouseAddressError",
    "LighthouseLink",
    "LighthouseUnreachable",
    "QuorumRefused",
    "connect_lighthouse",
    "post",
]

STORE_LOST = (KVError, RuntimeError, OSError)
"""What a store operation raises when the lighthouse is away (ConnectionError included)."""
_HANDSHAKE = 5.0
"""Seconds a TCPStore's handshake may take once its port accepted a connection."""


class QuorumRefused(RuntimeError, FatalError):
    """The lighthouse will not admit this member (its replica id is taken by a live one):
    the group's job ends, since a restart under the same id would be refused too."""


class LighthouseAddressError(ValueError, FatalError):
    """``TORCHFT_LIGHTHOUSE`` is not a lighthouse's address (no restart can fix that)."""


class LighthouseUnreachable(ConnectionError, FatalError):
    """Nothing answered at the lighthouse's address within the connect timeout."""


def connect_lighthouse(address: str, timeout: float) -> KeyValueStore:
    """The lighthouse's store, or one line: ``ValueError`` for an address that is not one,
    ``ConnectionError`` for one that does not answer within ``timeout``."""
    if not isinstance(address, str) or not address.strip():
        raise LighthouseAddressError(
            "rallypoint.ft needs the lighthouse: set TORCHFT_LIGHTHOUSE (for example "
            "http://host:29510, or etcd://host:2379) or pass lighthouse_addr"
        )
    deadline = time.monotonic() + timeout
    refused = _refused_until(address, deadline)
    if refused:
        raise LighthouseUnreachable(
            f"rallypoint.ft: cannot reach the lighthouse {address} (TORCHFT_LIGHTHOUSE) "
            f"within {timeout:g} s: {refused}"
        )
    try:  # something listens there: its handshake gets a few seconds however little is
        # left (a loaded machine can take more than a second to answer it)
        left = max(_HANDSHAKE, deadline - time.monotonic())
        kv, _ = connect_kv(address, timeout=timedelta(seconds=left))
    except ValueError as exc:
        raise LighthouseAddressError(
            f"TORCHFT_LIGHTHOUSE={address!r} is not a lighthouse address: {exc}"
        ) from None
    except KVConnectionError as exc:
        raise LighthouseUnreachable(
            f"rallypoint.ft: cannot reach the lighthouse {address} (TORCHFT_LIGHTHOUSE) "
            f"within {timeout:g} s: {exc}"
        ) from None
    return kv


def _refused_until(address: str, deadline: float) -> str:
    """Why nothing accepts a TCP connection at a TCPStore ``address`` until ``deadline``
    (``""``: something does, or it is not such an address)."""
    text = address.strip()
    if is_etcd_address(text):
        return ""
    host, _, port = text.split("://", 1)[-1].rstrip("/").rpartition(":")
    if not port.isdigit() or not host:
        return ""
    return await_listener(host, int(port), deadline)


def read_life(kv: KeyValueStore, timeout: float) -> tuple[Rules, str]:
    """The lighthouse's rules and the token of its life (it may still be starting)."""
    deadline = time.monotonic() + timeout
    while True:
        raw, gen = kv.multi_get(["config", "gen"])
        if raw is not None and gen is not None:
            try:
                return Rules.from_bytes(raw), gen.decode(errors="replace")[:64]
            except RecordError as exc:
                _say(f"ignoring the lighthouse's rules: {exc}")
                return Rules(), gen.decode(errors="replace")[:64]
        if time.monotonic() >= deadline:
            raise LighthouseUnreachable(
                f"rallypoint.ft: {kv.endpoint} holds no lighthouse (no 'config' and 'gen' "
                f"keys after {timeout:g} s): start `rallypoint lighthouse` there"
            )
        time.sleep(0.05)


class LighthouseLink:
    """One member's connection to the lighthouse: hello, ask, heartbeat, leave.

    ``heartbeat``: seconds between beats on a thread of its own (``None``: the caller
    beats, as torchft's ``LighthouseClient.heartbeat``); ``beats_if``: that thread skips
    a beat when it says no (a rank of the member's group is stopped)."""

    def __init__(
        self,
        address: str,
        member: str,
        replica_id: str,
        *,
        connect_timeout: float,
        heartbeat: float | None = 0.1,
        say: Callable[[str], None] | None = None,
        hello: bool = True,
        beats_if: Callable[[], bool] | None = None,
    ) -> None:
        self.address, self.member, self.replica_id = address, member, replica_id
        self._connect_timeout = connect_timeout
        self._say = say or _say
        self.kv = connect_lighthouse(address, connect_timeout)
        self.rules, self.gen = read_life(self.kv, connect_timeout)
        self.previous: Quorum | None = None
        self._seq = 0
        self._retry_of = 0
        self._last_round: int | None = None
        """The round of the last quorum this member got in this lighthouse life."""
        self._asking: Ask | None = None
        """The ask whose answer this member waits for."""
        self._beat_at = time.monotonic()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._said: set[str] = set()
        self._beats_if = beats_if
        if hello:
            post(self.kv, self._hello(self.gen))
        self._beat_kv: KeyValueStore | None = None
        if heartbeat is not None:
            self._beat_kv = self.kv.clone()
            self.beat()
            threading.Thread(
                target=self._beat_loop,
                args=(heartbeat,),
                name="rallypoint-ft-heartbeat",
                daemon=True,
            ).start()

    # ------------------------------------------------------------------ heartbeats
    def beat(self) -> None:
        kv = self._beat_kv or self.kv
        key = f"hb/{self.member}"
        try:
            kv.add(key, 1)
        except KVStateError as exc:  # someone wrote a non-counter there: start it again
            self._once(key, f"{key} held something else ({exc}); it is a counter again")
            kv.set(key, b"1")
        now = time.monotonic()
        gap, self._beat_at = now - self._beat_at, now
        asking = self._asking
        if asking is not None and gap * 1000 > self.rules.heartbeat_timeout_ms:
            # this process was stopped (SIGSTOP, say) past the heartbeat timeout while it
            # waited: the lighthouse may have forgotten it, or deleted the round it waits
            # on; the same ask again brings either back
            post(kv, dataclasses.replace(asking, again=True))

    def _beat_loop(self, interval: float) -> None:
        lost_at: float | None = None
        while not self._stop.wait(interval):
            if lost_at is not None:  # the lighthouse is away (restarting): a new connection,
                if time.monotonic() - lost_at < 1.0:  # at most once a second
                    continue
                try:
                    kv = connect_lighthouse(self.address, 2.0)
                    _, gen = read_life(kv, 2.0)
                    post(kv, self._hello(gen))
                    self._beat_kv, lost_at = kv, None
                except (*STORE_LOST, ValueError, ConnectionError):
                    lost_at = time.monotonic()
                    continue
            if self._beats_if is not None and not self._beats_if():
                continue
            try:
                self.beat()
            except STORE_LOST:  # never again on this connection (each try would log a warning)
                lost_at = time.monotonic() - 1.0

    def _hello(self, gen: str) -> Ask:
        return Ask("hello", self.member, replica_id=self.replica_id, prev=self._prev(gen))

    def _prev(self, gen: str) -> tuple[int, tuple[str, ...]] | None:
        """The last quorum, for a lighthouse life (``gen``) that did not make it."""
        quorum = self.previous
        if quorum is None or quorum.gen == gen:
            return None
        return quorum.quorum_id, tuple(quorum.ids())

    # ------------------------------------------------------------------ quorums
    def quorum(self, req: Request, timeout: float) -> Quorum:
        """This step's quorum (one that holds this member), or ``TimeoutError``."""
        deadline = time.monotonic() + timeout
        self._retry_of = 0
        while True:
            try:
                quorum = self._ask_once(req, deadline)
            except STORE_LOST as exc:
                if isinstance(exc, TimeoutError | QuorumRefused):
                    raise
                self._reconnect(exc, deadline)
                continue
            if quorum is not None:
                self.previous = quorum
                return quorum

    def _ask_once(self, req: Request, deadline: float) -> Quorum | None:
        with self._lock:
            self._seq += 1
            seq = self._seq
        retry_of, self._retry_of = self._retry_of, 0
        following = self._last_round is not None and not retry_of
        ask = Ask(
            "ask",
            self.member,
            seq,
            req,
            prev=self._prev(self.gen),
            retry_of=retry_of,
            after=self._last_round if following else None,
        )
        self._asking = ask
        try:
            return self._answer(ask, following, deadline)
        finally:
            self._asking = None

    def _answer(self, ask: Ask, following: bool, deadline: float) -> Quorum | None:
        seq = ask.seq
        post(self.kv, ask)
        if following:  # in the last round's quorum: the next round cannot be decided
            # without this ask, so it holds this member unless this member is left out
            # (then its own answer comes when a later round holds it)
            rkey = f"r/{self._last_round + 1}"  # type: ignore[operator]
            self._wait(rkey, deadline)
            try:
                quorum = _ROUNDS.read(self.kv, self.gen, rkey, rkey)
            except RoundNote as note:  # not decided (below --min_replicas): its answer comes
                self._once("below", str(note))  # when a round holds it
            except RecordError as exc:
                return self._unreadable(exc, seq)
            else:
                if quorum.holds(self.member):
                    return self._took(quorum)
        key = f"a/{self.member}/{seq}"
        self._wait(key, deadline)
        raw = self.kv.get_woken(key)
        try:
            if raw is None:
                raise RecordError(f"{key}: gone after the wait")
            kind, value = parse_answer(raw, key)
        except RecordError as exc:
            return self._unreadable(exc, seq)
        if kind == "refused":
            raise QuorumRefused(f"rallypoint.ft: the lighthouse refused {self.member}: {value}")
        if kind == "retry":  # below --min_replicas: said once until a quorum holds it
            self._once("below", f"{value}")
            return None
        rkey = f"r/{value}"
        answered = self._read(rkey, key, seq)
        if answered is not None and not answered.holds(self.member):
            self._once(rkey, f"{rkey} does not hold {self.member}; asking again")
            return None
        return self._took(answered)

    def _wait(self, key: str, deadline: float) -> None:
        """Until ``key`` is written (a rare early wake reads it missing: asked again)."""
        left = deadline - time.monotonic()
        if left <= 0 or not self.kv.wait_woken([key], timedelta(seconds=left)):
            raise TimeoutError(self._timeout_line())

    def _read(self, rkey: str, named_by: str, seq: int) -> Quorum | None:
        """The round an answer names (written before it: missing, it was deleted since,
        this member having been stopped, say, and the member asks again)."""
        try:
            return _ROUNDS.read(self.kv, self.gen, rkey, named_by)
        except RecordError as exc:
            return self._unreadable(exc, seq)

    def _unreadable(self, exc: RecordError, seq: int) -> Quorum | None:
        self._once(str(exc), f"ignoring a record in the lighthouse's store: {exc}; asking again")
        self._retry_of = seq  # the lighthouse answers it again, under a key of its own
        self._last_round = None
        return None

    def _took(self, quorum: Quorum | None) -> Quorum | None:
        if quorum is not None:
            self._last_round = quorum.round
            self._said.discard("below")
        return quorum

    def _timeout_line(self) -> str:
        status = ""
        with contextlib.suppress(*STORE_LOST):
            raw = self.kv.get("status")
            if raw:
                status = f": {raw.decode(errors='replace')[:300]}"
        return f"rallypoint.ft: no quorum within the timeout{status}"

    def _reconnect(self, exc: BaseException, deadline: float) -> None:
        self._once(
            "away", f"the lighthouse {self.address} is away ({type(exc).__name__}); retrying"
        )
        while True:
            try:
                kv = connect_lighthouse(
                    self.address, min(2.0, max(0.1, deadline - time.monotonic()))
                )
                self.rules, self.gen = read_life(kv, 2.0)
                self.kv, self._last_round = kv, None
                post(kv, self._hello(self.gen))
                self._said.discard("away")
                return
            except (ConnectionError, *STORE_LOST) as again:
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"rallypoint.ft: the lighthouse {self.address} did not come back: {again}"
                    ) from None
                time.sleep(0.1)

    # ------------------------------------------------------------------ leaving
    def close(self, why: str = "") -> None:
        """Stop beating; with ``why``, tell the lighthouse at once that this member left."""
        self._stop.set()
        if why:
            with contextlib.suppress(*STORE_LOST):
                post(self.kv, Ask("gone", self.member, why=why[:200]))

    def _once(self, key: str, line: str) -> None:
        if key not in self._said:
            self._said.add(key)
            self._say(line)


class _Rounds:
    """The rounds read in this process, each read and parsed once however many members
    the process hosts (a round of G members is O(G) to parse: G members in one process
    would make it O(G²))."""

    def __init__(self, keep: int = 32) -> None:
        self._lock = threading.Lock()
        self._keep = keep
        self._found: dict[tuple[str, str, str], Future[Quorum]] = {}

    def read(self, kv: KeyValueStore, gen: str, rkey: str, named_by: str) -> Quorum:
        where = (kv.endpoint, gen, rkey)
        with self._lock:
            found = self._found.get(where)
            mine = found is None
            if found is None:
                found = self._found[where] = Future()
                while len(self._found) > self._keep:
                    del self._found[next(iter(self._found))]
        if not mine:
            return found.result()
        try:
            record = kv.get_woken(rkey)  # waited on, or named by an answer written after it
            if record is None:
                raise RecordError(f"{rkey}: missing, though {named_by} names it")
            found.set_result(Quorum.from_bytes(record, rkey))
        except BaseException as exc:  # handed to every reader waiting on this round
            with self._lock:  # not kept: the next reader reads it again
                if self._found.get(where) is found:
                    del self._found[where]
            found.set_exception(exc)
        return found.result()


_ROUNDS = _Rounds()


def _say(line: str) -> None:
    with contextlib.suppress(OSError, ValueError):
        sys.stderr.write(f"rallypoint.ft: {line.removeprefix('rallypoint.ft: ')}\n")
