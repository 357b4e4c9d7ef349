"""A job of one node in the one restart loop (``_coordinator``): each attempt is a round.

Its run store is in this process's memory (``MemoryStore``: no rendezvous, no socket, no
torch in the agent), so the round's claim and decision (``_round``) are its restart policy
too. What differs from a multi-node job is here: who the node is comes from the launch
(``rank_offset``, ``world_size``, ``--master-port``; the launch with ``rank_offset=0``
starts the workers' store once and empties it before each restart); attempts run under a
``LocalPolicy``; workers are kept for an in-process restart while the budget has one left;
nothing is excluded, nobody waits to join, and there is no burn-in.
"""

from __future__ import annotations

from dataclasses import replace

from rallypoint._core.memory_store import MemoryStore
from rallypoint._elastic._job import Job
from rallypoint._elastic._options import RestartOptions
from rallypoint._elastic._protocols import NodeSupervisor
from rallypoint._elastic._round import Round
from rallypoint._elastic._stores import RoundStore, prefixed
from rallypoint._supervise._options import WorldOptions
from rallypoint._supervise._state import GroupInfo
from rallypoint._supervise._stop_reasons import AttemptPolicy, LocalPolicy
from rallypoint._watch._observer import Observer
from rallypoint._watch._stragglers._watch import StragglerWatch

__all__ = ["OneNode"]


class OneNode:
    """The rounds of a job of one node (see the module docstring)."""

    one_node = True
    endpoint = ""
    min_nodes = 1
    store_timeout = 60.0

    def __init__(
        self,
        supervisor: NodeSupervisor,
        observer: Observer,
        *,
        world: WorldOptions,
        restarts: RestartOptions,
        run_id: str,
    ) -> None:
        self.supervisor = supervisor
        self.observer = observer
        self.world = world
        self.restarts = restarts
        self.run_id = run_id
        self.hosts_store = world.rank_offset == 0
        self.store = MemoryStore()
        self._group: GroupInfo | None = None

    def connect(self) -> None:
        """No rendezvous."""
        return None

    def open(self, job: Job) -> None:
        job.adopt_round_store(self.store)  # its rounds' store plays the run store's role

    def close(self, job: Job) -> None:
        """Nothing to close."""

    def join(self, job: Job, number: int) -> Round:
        """Round ``number``: the same group each time; before a restart, the workers'
        store is emptied (it is started before the first)."""
        if self._group is None:
            self._group = self._first_group()
        elif self.hosts_store:
            self.supervisor.reset_store()
        group = replace(self._group, restart_count=job.run.restarts())
        self.observer.emit(
            "round", round=number, world_size=group.world_size, nnodes=1, run_id=self.run_id
        )
        host = self.supervisor.host
        self.observer.emit("members", round=number, members=[host])
        store = RoundStore(prefixed(f"rallypoint/round{number}", self.store))
        return Round(number=number, group=group, members=[host], store=store, job=job)

    def _first_group(self) -> GroupInfo:
        world = self.world
        if self.hosts_store:
            port = self.supervisor.start_store(world.master_addr, world.master_port or 0)
        else:
            self.supervisor.init_warm()
            port = world.master_port or 0
        return GroupInfo(
            group_rank=0,
            group_world_size=1,
            world_size=world.world_size or self.supervisor.nproc,
            rank_offset=world.rank_offset,
            master_addr=world.master_addr,
            master_port=port,
            run_id=self.run_id,
            max_restarts=self.restarts.max_restarts,
        )

    def burn_in(self, rnd: Round) -> bool:
        return False

    def policy(self, rnd: Round) -> tuple[AttemptPolicy, StragglerWatch | None]:
        stragglers = self.observer.straggler_watch(
            round=rnd.number, rank_offset=rnd.group.rank_offset
        )
        policy = LocalPolicy(
            self.observer, attempt=rnd.number, on_hang=self.restarts.on_hang, stragglers=stragglers
        )
        return policy, stragglers

    def restart_in_process(self, rnd: Round) -> bool:
        """While a restart is left: the last attempt's workers are not kept."""
        return rnd.group.restart_count < self.restarts.max_restarts

    def cause_wait(self, job: Job) -> float | None:
        """No other node can be lost."""
        return None
