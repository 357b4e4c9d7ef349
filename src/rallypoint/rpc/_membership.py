"""Group membership and shutdown barriers of the rallypoint agent.

- ``join_group``: static groups publish a record and wait for every rank; dynamic groups
  take the membership token, register, and notify the current members.
- ``graceful_shutdown``: wait for outstanding work; then a dynamic member leaves under the
  token (rank 0, the store host, leaves last), and a static group meets at a store barrier
  that gives up at the deadline, or at once when a missing worker is known dead.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any

from rallypoint.rpc import _groups
from rallypoint.rpc._errors import RpcError, RpcShutdownError

if TYPE_CHECKING:
    from rallypoint.rpc._agent import RallypointAgent

logger = logging.getLogger("rallypoint.rpc")


def join_group(agent: RallypointAgent, timeout: float) -> None:
    """Enter the group: static (wait for every rank) or dynamic (under the token)."""
    if agent.world_size is not None:
        if not 0 <= agent.info.id < agent.world_size:
            raise ValueError(
                f"rank {agent.info.id} is outside world_size {agent.world_size}; "
                f"use a rank in [0, {agent.world_size - 1}]"
            )
        _groups.publish_static(agent.store, agent.info.id, agent.record())
        try:
            records = _groups.gather_static(agent.store, agent.world_size, timeout)
            agent._set_records(records, static=True)
        except BaseException:
            agent.store.set(f"init_done/{agent.info.id}", "1")
            if agent.hosts_store():
                ranks = [
                    str(r) for r in range(agent.world_size) if agent.store.check([f"worker/{r}"])
                ]
                agent._linger_as_store_host("init_done", ranks, time.monotonic() + 5.0)
            raise
        agent._ready.set()
        for name in agent._records:
            agent._connection(name)
        return
    with _groups.membership_token(agent.store, agent.info.name, timeout):
        members = _groups.read_members(agent.store)
        if agent.info.name in members:
            raise RpcError(
                f"worker name {agent.info.name!r} is already in the group; "
                "every worker needs a unique name"
            )
        records = [_groups.read_record(agent.store, m) for m in members]
        for record in records:
            if int(record["rank"]) == agent.info.id:
                raise RpcError(
                    f"rank {agent.info.id} is already used by {record['name']!r}; "
                    "every worker needs a unique rank"
                )
        mine = agent.record()
        agent._set_records([*records, mine], static=False)
        _groups.write_record(agent.store, agent.info.name, mine)
        _groups.write_members(agent.store, [*members, agent.info.name])
        agent._ready.set()
        try:
            for member in members:
                agent.rpc_async(member, _on_member_joined, (mine,), {}, timeout).wait()
        except BaseException:
            _groups.write_members(agent.store, members)
            _groups.delete_record(agent.store, agent.info.name)
            for member in members:
                with contextlib.suppress(Exception):
                    agent.rpc_async(member, _on_member_left, (agent.info.name,), {}, timeout).wait()
            raise


def graceful_shutdown(
    agent: RallypointAgent, deadline: float, seconds: float
) -> BaseException | None:
    """Wait for outstanding work, then leave (dynamic) or meet everyone (static)."""
    agent._wait_quiet(deadline)
    agent._drain_deletes()
    me = agent.info.name
    if not agent.is_static_group:
        errors: list[str] = []
        if agent.hosts_store():
            # rank 0 hosts the store: stay in the group (reachable) until the others left
            while _groups.read_members(agent.store) != [me] and time.monotonic() < deadline:
                time.sleep(0.01)
        with _groups.membership_token(agent.store, me, max(deadline - time.monotonic(), 0.1)):
            members = [m for m in _groups.read_members(agent.store) if m != me]
            _groups.write_members(agent.store, members)
            _groups.delete_record(agent.store, me)
            for member in members:
                try:
                    agent.rpc_async(
                        member,
                        _on_member_left,
                        (me,),
                        {},
                        max(deadline - time.monotonic(), 0.1),
                    ).wait()
                except Exception as exc:
                    errors.append(member)
                    logger.warning(
                        "rallypoint.rpc: could not tell %s that %s left: %s", member, me, exc
                    )
        agent._wait_quiet(deadline)
        if errors:
            return RpcShutdownError(
                f"{me} left the group but could not notify workers {errors}", missing=errors
            )
        return None
    names = sorted(agent._records)
    agent.store.set(f"shutdown/{me}", "1")
    missing = _groups.wait_for_keys(
        agent.store, [f"shutdown/{n}" for n in names], deadline, dead=agent._known_dead
    )
    error: RpcShutdownError | None = None
    if missing:
        gone = [k.rsplit("/", 1)[1] for k in missing]
        dead = [n for n in gone if n in agent._dead]
        if dead:
            why = "; ".join(f"{n} {agent._dead[n]}" for n in dead)
            detail = f"gave up early: workers {gone} did not reach shutdown ({why})"
        else:
            detail = f"gave up after {seconds:.1f} s: workers {gone} did not reach shutdown"
        error = RpcShutdownError(f"graceful shutdown of {me} {detail}", missing=gone)
    else:
        agent._wait_quiet(deadline)
    agent.store.set(f"exit/{me}", "1")
    agent._linger_as_store_host("exit", names, min(deadline, time.monotonic() + 10.0))
    return error


def _on_member_joined(record: dict[str, Any]) -> None:
    _current().member_joined(record)


def _on_member_left(name: str) -> None:
    _current().member_left(name)


def _current() -> RallypointAgent:
    from rallypoint.rpc._agent import current_rallypoint_agent

    return current_rallypoint_agent()
