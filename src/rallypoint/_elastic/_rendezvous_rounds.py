"""How a node of a multi-node job takes part in each round: through the rendezvous.

It connects the node's :mod:`rallypoint.rendezvous` handler (only its public API) and
opens the run store; before each round it joins the rendezvous (group rank, node count;
group rank 0 starts the workers' store), waits as a spare while the job is full, times the
nodes' links when ``--burn-in`` asks, and gives each attempt an :class:`ElasticPolicy`
that follows the round's decisions. The restart loop that uses it is ``_coordinator``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rallypoint._core.blocking import call_in_thread
from rallypoint._core.status import JobStatus
from rallypoint._elastic._errors import RendezvousFailedError
from rallypoint._elastic._health._burn_in import measure, slow_node
from rallypoint._elastic._health._exclusion import say_host_exclusions
from rallypoint._elastic._job import Job, interruptible
from rallypoint._elastic._monitor_tick import ElasticPolicy
from rallypoint._elastic._options import RestartOptions
from rallypoint._elastic._protocols import NodeSupervisor
from rallypoint._elastic._records import NodeRecord
from rallypoint._elastic._round import Round
from rallypoint._elastic._stores import RoundStore, prefixed
from rallypoint._supervise._errors import LaunchInterruptedError
from rallypoint._supervise._output import write_console
from rallypoint._supervise._state import GroupInfo
from rallypoint._supervise._stop_reasons import AttemptPolicy
from rallypoint._watch._observer import Observer
from rallypoint._watch._stacks_exchange import publish_node_count
from rallypoint._watch._stragglers._watch import StragglerWatch

if TYPE_CHECKING:
    from collections.abc import Callable

    from rallypoint._core.store import Store
    from rallypoint.rendezvous import RendezvousHandler, RendezvousInfo

__all__ = ["BURN_IN_TIMEOUT", "RendezvousRounds"]

BURN_IN_TIMEOUT = 120.0
"""Seconds the burn-in's transfers may take before it gives up (a dead link)."""


def _store_of(info: RendezvousInfo) -> Store:
    """The round's store (torch's class, as the handler API types it) as a ``Store``."""
    from rallypoint._core.torch_c import as_torch_store

    return as_torch_store(info.store)


class RendezvousRounds:
    """This node's rounds of a multi-node job (see the module docstring)."""

    one_node = False

    def __init__(
        self,
        supervisor: NodeSupervisor,
        connect: Callable[[], RendezvousHandler],
        observer: Observer,
        *,
        restarts: RestartOptions,
        run_id: str,
        endpoint: str,
        share_rpc_secret: bool = True,
        store_timeout: float = 60.0,
        node: str = "",
        min_nodes: int = 1,
    ) -> None:
        self.supervisor = supervisor
        self._connect = connect
        self.observer = observer
        self.restarts = restarts
        self.run_id = run_id
        self.endpoint = endpoint
        self.share_rpc_secret = share_rpc_secret
        """Give every node's workers the run store's RPC secret (False: the user set one)."""
        self.store_timeout = store_timeout
        self.addr = node or supervisor.host
        """Where the other agents reach this node for the burn-in (``--local-addr``, else the
        host name); its name in exclusion records is its rendezvous identity (``Job.node``)."""
        self.min_nodes = min_nodes
        self._spare: int | None = None
        """The round this node waited out as a spare (said once), until it is admitted."""
        self._joined = False
        self._round_store: Store | None = None
        """The round's store, held while the round lasts: torch's ``PrefixStore`` over a
        store written in Python (etcd's, memory's) fails once the Python object is gone."""

    # ------------------------------------------------------------------ the job
    def connect(self) -> RendezvousHandler:
        sup = self.supervisor
        sup.init_warm()
        return interruptible(self._connect, sup.next_signal, "the rendezvous store")

    def open(self, job: Job) -> None:
        """Open the run store (the ``static`` backend has none before its round)."""
        interruptible(job.open, self.supervisor.next_signal, "the rendezvous store")

    def close(self, job: Job) -> None:
        """The job ended: close the rendezvous and stop the handler's heartbeats now, while
        the store is surely up (torch's agent calls ``shutdown()`` at the end too); an
        in-process ``launch()`` leaves no thread behind."""
        job.handler.set_closed()
        job.handler.shutdown()

    # ------------------------------------------------------------------ each round
    def join(self, job: Job, number: int) -> Round | None:
        """The next round this node is in; ``None`` when the job ended without it."""
        from rallypoint.rendezvous import (
            RendezvousClosedError,
            RendezvousError,
            RendezvousGracefulExitError,
        )

        if not self._joined:  # before its first round
            self._joined = True
            say_host_exclusions(job, self.supervisor.host)
        try:
            info = self._next_rendezvous(job)
        except (RendezvousClosedError, RendezvousGracefulExitError) as exc:
            job.handler.shutdown()  # stop its heartbeats, as torch's agent does
            self._ended_elsewhere(job, exc)
            return None
        except RendezvousError as exc:
            raise RendezvousFailedError(f"rendezvous failed: {exc}") from None
        return self._setup_round(job, info, number)

    def policy(self, rnd: Round) -> tuple[AttemptPolicy, StragglerWatch | None]:
        stragglers = self.observer.straggler_watch(
            round=rnd.number,
            rank_offset=rnd.group.rank_offset,
            group_rank=rnd.group_rank,
            nnodes=rnd.nnodes,
            clock_store=rnd.job.open_store,
        )
        return ElasticPolicy(rnd, host=self.supervisor.host, stragglers=stragglers), stragglers

    def restart_in_process(self, rnd: Round) -> bool:
        """Always: a membership change restarts without spending budget."""
        return True

    def cause_wait(self, job: Job) -> float | None:
        """How long a worker's peer-loss exception waits for its cause: the liveness window
        of the rendezvous, in which a lost node is noticed."""
        window = job.handler.liveness_window()
        return None if window is None else window.total_seconds()

    def _next_rendezvous(self, job: Job) -> RendezvousInfo:
        """``next_rendezvous()`` in a thread, so that SIGINT/SIGTERM still stop this node
        while it blocks inside the store (a blocked C call does not return for signals);
        a node that waits as a spare says so, once."""

        def poll() -> None:
            job.check_signals()
            self._say_spare(job)

        return call_in_thread(job.handler.next_rendezvous, poll=poll, name="rallypoint-store")

    def _say_spare(self, job: Job) -> None:
        k = job.handler.spare_round
        if k is None or self._spare is not None:
            return
        self._spare = k
        write_console(
            2,
            f"rallypoint: this node is a spare: job {self.run_id!r} is full in round {k}; "
            f"it waits to take the place of a lost node at round {k + 1} or later\n".encode(),
        )
        self.observer.emit("spare", round=k, run_id=self.run_id)
        if self.restarts.hot_spare:
            self.supervisor.start_standby(self._standby_group())

    def _standby_group(self) -> GroupInfo:
        """What a hot spare's workers know before they have ranks."""
        return GroupInfo(
            group_rank=0,
            group_world_size=0,
            world_size=0,
            rank_offset=0,
            master_addr="",
            master_port=0,
            run_id=self.run_id,
            max_restarts=self.restarts.max_restarts,
        )

    def _say_admitted(self, k: int, group_rank: int) -> None:
        if self._spare is None:
            return
        self._spare = None
        write_console(
            2,
            f"rallypoint: the spare joins job {self.run_id!r} in round {k} as node "
            f"{group_rank}\n".encode(),
        )

    def _ended_elsewhere(self, job: Job, exc: Exception) -> None:
        status = ""
        if job.has_run_store:
            try:
                status = job.blocking(job.run.status)
            except LaunchInterruptedError:
                raise
            except Exception:
                status = ""
        if status == JobStatus.SUCCEEDED:
            write_console(2, b"rallypoint: the job already finished successfully\n")
            return
        raise RendezvousFailedError(
            f"{exc} (job status: {status or 'unknown'}); this node did not run"
        )

    def _setup_round(self, job: Job, info: RendezvousInfo, number: int) -> Round:
        """The round's group: its store calls in threads (``Job.blocking``), the warm
        process's (the worker store of group rank 0) on this thread."""
        k = job.handler.round
        if k is None:
            k = number
        round_store = self._round_store = _store_of(info)
        job.blocking(lambda: job.adopt_round_store(round_store))
        store = RoundStore(prefixed(f"rallypoint/round{k}", round_store))
        group_rank, nnodes = int(info.rank), int(info.world_size)
        self._say_admitted(k, group_rank)
        sup = self.supervisor

        def join_round() -> tuple[int, list[NodeRecord]]:
            # read before this node counts as present: no node starts its workers (and so
            # no failure spends budget) until every node is, so all see the same count
            restart_count = job.run.restarts()
            store.publish_node(group_rank, NodeRecord(sup.nproc, sup.host))
            return restart_count, store.nodes(nnodes)

        restart_count, nodes = job.blocking(join_round)
        if group_rank == 0:
            assert info.bootstrap_store_info is not None
            master = info.bootstrap_store_info.master_addr
            port = sup.start_store(master, 0)
            job.blocking(lambda: store.publish_master(master, port))
        addr, port = job.blocking(store.master)
        secret = job.blocking(job.rpc_secret) if self.share_rpc_secret else ""
        sizes = [n.nproc for n in nodes]
        group = GroupInfo(
            group_rank=group_rank,
            group_world_size=nnodes,
            world_size=sum(sizes),
            rank_offset=sum(sizes[:group_rank]),
            master_addr=addr,
            master_port=port,
            run_id=self.run_id,
            restart_count=restart_count,
            max_restarts=self.restarts.max_restarts,
            rpc_secret=secret,
        )
        job.blocking(lambda: publish_node_count(job.run.store, nnodes))
        members = [n.host for n in nodes]
        self.observer.emit(
            "round",
            round=k,
            world_size=group.world_size,
            nnodes=nnodes,
            run_id=self.run_id,
            group_rank=group_rank,
        )
        self.observer.emit("members", round=k, members=members, group_rank=group_rank)
        return Round(number=k, group=group, members=members, store=store, job=job)

    # ------------------------------------------------------------------ burn-in
    def burn_in(self, rnd: Round) -> bool:
        """With ``--burn-in``: time the nodes' links (``_burn_in``); True when a slow node
        is being excluded (the round is decided: every node restarts without it)."""
        if not self.restarts.burn_in:
            return False
        job = rnd.job
        store = rnd.store.store  # the round's keys; the burn-in's go under its own prefix
        times = job.blocking(
            lambda: measure(
                prefixed("burnin", store), rnd.group_rank, rnd.nnodes, self.addr, BURN_IN_TIMEOUT
            )
        )
        self.observer.emit(
            "burn_in",
            round=rnd.number,
            forward=times.forward,
            backward=times.backward,
            gemm=times.gemm,
        )
        slow = slow_node(times)
        if slow is None:
            return False
        g, why = slow
        host = rnd.members[g]
        if rnd.nnodes - 1 < self.min_nodes:
            write_console(
                2,
                f"rallypoint: burn-in: node {host} (group rank {g}): {why}; not excluded, "
                f"fewer than {self.min_nodes} node(s) would be left\n".encode(),
            )
            return False
        if g == rnd.group_rank:
            job.blocking(lambda: rnd.exclude_now(job.node, self.supervisor.host, why))
        return True
