"""Joining and leaving the group, and the shutdown barrier of the rallypoint agent.

:meth:`Group.join` and :meth:`Group.leave` for static groups (a record per rank, a store
barrier) and dynamic ones (changes under the membership token). Without a deadline
(torch's default) a leave waits as long as the awaited workers are alive, and gives up at
once, naming them, when every awaited worker is dead or unreachable. The group changes
the ``PeerTable``, opens and drops connections through ``Connections`` and notifies
members through a ``Caller``; members find the receiving worker's group through
:data:`CURRENT_GROUP`.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rallypoint.rpc._agent._connections import Connections
from rallypoint.rpc._agent._liveness import Prober, probe_timeout
from rallypoint.rpc._agent._peers import PeerTable
from rallypoint.rpc._backend import Caller
from rallypoint.rpc._current import Current
from rallypoint.rpc._errors import RpcConnectionError, RpcError, RpcShutdownError
from rallypoint.rpc._group import _groups
from rallypoint.rpc._group._groups import WorkerRecord
from rallypoint.rpc._group._store import wait_for_names
from rallypoint.rpc._transport._spin import WAITS
from rallypoint.rpc._worker_info import WorkerInfo

if TYPE_CHECKING:
    from rallypoint._core.store import Store

logger = logging.getLogger("rallypoint.rpc")

_LINGER_AFTER_FAILED_INIT = 5.0
_LINGER_AFTER_SHUTDOWN = 10.0


@dataclass(kw_only=True, slots=True, eq=False)
class Group:
    """One worker's membership: static (``world_size`` given) or dynamic."""

    store: Store
    me: WorkerInfo
    world_size: int | None
    hosts_store: bool  # rank 0 hosts the TCPStore: it must leave last
    peers: PeerTable
    connections: Connections
    caller: Caller
    rpc_timeout: float

    # ---- joining -----------------------------------------------------------------------
    def join(self, record: WorkerRecord, timeout: float) -> None:
        """Enter the group: static (wait for every rank) or dynamic (under the token)."""
        _groups.claim_kind(self.store, static=self.world_size is not None)
        if self.world_size is None:
            self._join_dynamic(record, timeout)
        else:
            self._join_static(record, self.world_size, timeout)

    def _join_static(self, record: WorkerRecord, world_size: int, timeout: float) -> None:
        store, rank = self.store, self.me.id
        if not 0 <= rank < world_size:
            raise ValueError(
                f"rank {rank} is outside world_size {world_size}; "
                f"use a rank in [0, {world_size - 1}]"
            )
        _groups.publish_static(store, record)
        try:
            self.peers.set(_groups.gather_static(store, world_size, timeout), static=True)
        except BaseException:  # Ctrl-C too: peers are told this rank is done
            store.set(f"init_done/{rank}", "1")
            if self.hosts_store:
                ranks = [str(r) for r in _groups.published_ranks(store, world_size)]
                self._linger_as_store_host("init_done", ranks, _LINGER_AFTER_FAILED_INIT)
            raise
        self.connections.accept_calls()
        for info in self.peers.infos():
            try:
                self.connections.get(info.name)  # warm up
            except RpcConnectionError as exc:
                closed = isinstance(exc.__cause__, ConnectionResetError | BrokenPipeError)
                if not closed and self.peers.dead_reason(info.name) is None:
                    raise
                # it already left (shutdown(graceful=False) right after its init_rpc):
                # torch's init_rpc succeeds then too; a call to it names it as gone

    def _join_dynamic(self, record: WorkerRecord, timeout: float) -> None:
        store, me = self.store, self.me
        with _groups.membership_token(store, me.name, timeout):
            members = _groups.read_members(store)
            if me.name in members:
                raise RpcError(
                    f"worker name {me.name!r} is already in the group; "
                    "every worker needs a unique name"
                )
            records = [_groups.read_record(store, m) for m in members]
            for other in records:
                if other.rank == me.id:
                    raise RpcError(
                        f"rank {me.id} is already used by {other.name!r}; "
                        "every worker needs a unique rank"
                    )
            self.peers.set([*records, record], static=False)
            _groups.write_record(store, record)
            _groups.write_members(store, [*members, me.name])
            self.connections.accept_calls()
            try:
                gone = self._notify_joined(members, record, timeout)
            except BaseException:  # Ctrl-C too: the group forgets this worker
                _groups.write_members(store, members)
                _groups.delete_record(store, me.name)
                self._tell_left(members, me.name, timeout)
                raise
            if gone:
                self._remove_gone(gone, [m for m in members if m not in gone], timeout)

    def _notify_joined(self, members: list[str], record: WorkerRecord, timeout: float) -> list[str]:
        """Tell each member that we joined; the members that are gone (refuse connections)."""
        gone: list[str] = []
        for member in members:
            try:
                self.caller.rpc_async(member, _on_member_joined, (record,), {}, timeout).wait()
            except RpcConnectionError:
                if not self.peers.is_dead(member):
                    raise
                gone.append(member)
        return gone

    def _remove_gone(self, gone: list[str], alive: list[str], timeout: float) -> None:
        """Remove members that left without leaving (under the token), and tell the rest."""
        logger.warning(
            "rallypoint.rpc: %s removed workers %s from the group: they refuse connections "
            "(left with shutdown(graceful=False), or died)",
            self.me.name,
            gone,
        )
        _groups.write_members(self.store, [*alive, self.me.name])
        for name in gone:
            _groups.delete_record(self.store, name)
            self.peers.remove(name)
            self._tell_left(alive, name, timeout)

    def _tell_left(self, members: list[str], name: str, timeout: float) -> None:
        """Tell each member that ``name`` left (best effort: go on past failures)."""
        for member in members:
            try:
                self.caller.rpc_async(member, _on_member_left, (name,), {}, timeout).wait()
            except Exception as exc:
                logger.warning(
                    "rallypoint.rpc: could not tell %s that %s left: %s", member, name, exc
                )

    # ---- notices from other members ----------------------------------------------------
    def member_joined(self, record: WorkerRecord) -> None:
        self.peers.add(record)

    def member_left(self, name: str) -> None:
        self.peers.remove(name)
        self.connections.drop(name)

    # ---- leaving -----------------------------------------------------------------------
    def leave(
        self, deadline: float, seconds: float, wait_quiet: Callable[[float], None]
    ) -> RpcShutdownError | None:
        """Leave (dynamic) or meet everyone at the shutdown barrier (static).

        ``deadline`` is ``math.inf`` when no timeout was given (``seconds`` is then 0);
        ``wait_quiet(deadline)`` waits for this worker's outstanding work.
        """
        prober = Prober(self.caller, self.peers, probe_timeout(self.rpc_timeout))
        if self.world_size is None:
            return self._leave_dynamic(deadline, prober, wait_quiet)
        return self._shutdown_barrier(deadline, seconds, prober, wait_quiet)

    def _bounded(self, deadline: float) -> float:
        """Seconds left for one step (a store token, a notice) that needs a finite bound."""
        if math.isinf(deadline):
            return probe_timeout(self.rpc_timeout)
        return max(deadline - time.monotonic(), 0.1)

    def _leave_dynamic(
        self, deadline: float, prober: Prober, wait_quiet: Callable[[float], None]
    ) -> RpcShutdownError | None:
        store, me = self.store, self.me.name
        errors: list[str] = []
        if self.hosts_store:
            # rank 0 hosts the store: stay in the group (reachable) until the others left
            delay = 0.001
            while time.monotonic() < deadline:
                others = [m for m in _groups.read_members(store) if m != me]
                if not others or prober.all_dead(others):
                    break
                WAITS.sleep(delay)
                delay = min(delay * 2, 0.02)
        with _groups.membership_token(store, me, self._bounded(deadline)):
            members = [m for m in _groups.read_members(store) if m != me]
            _groups.write_members(store, members)
            _groups.delete_record(store, me)
            for member in members:
                if self.peers.is_dead(member):
                    errors.append(member)
                    continue
                try:
                    timeout = self._bounded(deadline)
                    self.caller.rpc_async(member, _on_member_left, (me,), {}, timeout).wait()
                except Exception as exc:
                    errors.append(member)
                    logger.warning(
                        "rallypoint.rpc: could not tell %s that %s left: %s", member, me, exc
                    )
        wait_quiet(deadline)
        if errors:
            return RpcShutdownError(
                f"{me} left the group but could not notify workers {errors}", missing=errors
            )
        return None

    def _shutdown_barrier(
        self,
        deadline: float,
        seconds: float,
        prober: Prober,
        wait_quiet: Callable[[float], None],
    ) -> RpcShutdownError | None:
        store, me, peers = self.store, self.me.name, self.peers
        names = peers.names()
        store.set(f"shutdown/{me}", "1")
        gone = wait_for_names(store, "shutdown", names, deadline, all_dead=prober.all_dead)
        error: RpcShutdownError | None = None
        if gone:
            dead = [n for n in gone if peers.is_dead(n)]
            if dead:
                why = "; ".join(f"{n} {peers.dead_reason(n)}" for n in dead)
                detail = f"gave up early: workers {gone} did not reach shutdown ({why})"
            else:
                detail = f"gave up after {seconds:.1f} s: workers {gone} did not reach shutdown"
            error = RpcShutdownError(f"graceful shutdown of {me} {detail}", missing=gone)
        else:
            wait_quiet(deadline)
        store.set(f"exit/{me}", "1")
        linger = min(deadline - time.monotonic(), _LINGER_AFTER_SHUTDOWN)
        self._linger_as_store_host("exit", names, linger)
        return error

    def _linger_as_store_host(self, prefix: str, names: list[str], seconds: float) -> None:
        """Rank 0 hosts the TCPStore: keep it up until the live workers are done with it."""
        if self.hosts_store:
            alive = [n for n in names if not self.peers.is_dead(n)]
            deadline = time.monotonic() + seconds
            wait_for_names(
                self.store,
                prefix,
                alive,
                deadline,
                all_dead=lambda names: all(self.peers.is_dead(n) for n in names),
            )

    def close(self) -> None:
        self.store = None  # type: ignore[assignment]  # drops the connection; never used again


CURRENT_GROUP: Current[Group] = Current()


def _on_member_joined(record: WorkerRecord) -> None:
    CURRENT_GROUP.get().member_joined(record)


def _on_member_left(name: str) -> None:
    CURRENT_GROUP.get().member_left(name)
