"""The elastic coordinator with thread-simulated nodes: a real dynamic rendezvous on
``MemoryKV`` and a fake supervisor per node (no processes), as rendezvous is tested.

Each node is a thread running :meth:`Coordinator.run` through the rendezvous; its fake
supervisor plays a script per attempt: finish, fail, run until the policy stops it, or hang.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from rallypoint._elastic._coordinator import Coordinator
from rallypoint._elastic._monitor_tick import ElasticPolicy
from rallypoint._elastic._protocols import NodeSupervisor
from rallypoint._elastic._rendezvous import run_store_namespace
from rallypoint._elastic._rendezvous_rounds import RendezvousRounds
from rallypoint._elastic._stores import RunStore
from rallypoint._supervise._peer_loss import LOCAL_CAUSE_WAIT, CauseWait
from rallypoint._supervise._state import Failure, GroupInfo, Outcome, OutcomeKind
from rallypoint._supervise._stop_reasons import AttemptPolicy
from rallypoint._watch._idle import Idle
from rallypoint._watch._observer import Observer
from rallypoint.launcher import (
    HangError,
    LaunchConfig,
    RendezvousFailedError,
    WorkerFailedError,
    WorkerStatus,
    WorkerSummary,
)
from rallypoint.observe import read_events
from rallypoint.rendezvous import DynamicRendezvousConfig, DynamicRendezvousHandler, MemoryKV

RUN_ID = "job"
FAST = {
    "last_call_timeout": timedelta(seconds=0.3),
    "keep_alive_interval": timedelta(seconds=0.2),
    "keep_alive_max_attempt": 3,
    "join_timeout": timedelta(seconds=30),
    "local_addr": "127.0.0.1",
    "use_agent_store": False,
}
PEER_LOST = "RuntimeError: [gloo/transport] Connection closed by peer"


# ---------------------------------------------------------------------------- the fake
@dataclass(frozen=True)
class Finish:
    """Every local worker exits 0."""


@dataclass(frozen=True)
class Fail:
    """Local rank 0 fails; ``at`` is its (unix) exit time, reported after ``delay`` s."""

    at: float
    traceback: str = "ValueError: boom"
    delay: float = 0.0


@dataclass(frozen=True)
class Run:
    """Keep running until the policy stops the workers (another node's decision...)."""


@dataclass(frozen=True)
class Hang:
    """The hang watchdog fires at once."""


Script = Callable[[int, GroupInfo], Finish | Fail | Run | Hang]


@dataclass
class FakeSupervisor:
    """A node's supervisor without processes: each attempt follows ``script``."""

    host: str
    script: Script
    nproc: int = 2
    started: float = field(default_factory=time.monotonic)
    groups: list[GroupInfo] = field(default_factory=list)
    in_attempt: threading.Event = field(default_factory=threading.Event)

    def init_warm(self) -> None:
        pass

    def start_store(self, host: str, port: int) -> int:
        return 29500

    def reset_store(self) -> None:
        raise AssertionError("an elastic round starts a new store, it never resets one")

    def next_signal(self) -> int | None:
        return None

    def signal_pending(self) -> bool:
        return False

    def start_standby(self, group: GroupInfo) -> None:
        pass

    def stop_kept(self) -> None:
        pass

    def run_attempt(
        self,
        group: GroupInfo,
        number: int,
        policy: AttemptPolicy,
        *,
        restart_in_process: bool = False,
        cause_wait: float | None = None,
    ) -> Outcome:
        self.groups.append(group)
        self.in_attempt.set()
        running = {group.rank_offset + lr: 10_000_000 + lr for lr in range(self.nproc)}
        match self.script(number, group):
            case Finish():
                return Outcome(OutcomeKind.OK, self._states(group, WorkerStatus.SUCCEEDED, 0))
            case Fail(at=at, traceback=tb, delay=delay):
                time.sleep(delay)
                states = self._states(group, WorkerStatus.TERMINATED, -15)
                states[0] = WorkerSummary(
                    group.rank_offset, 0, 10_000_000, WorkerStatus.FAILED, 1, "exited with 1"
                )
                causes = CauseWait(LOCAL_CAUSE_WAIT if cause_wait is None else cause_wait)
                loss = causes.failure(tb, time.monotonic())  # none of its wait spent here
                failure = Failure(states[0], tb, None, time=at, elapsed=1.0, peer_loss=loss)
                return Outcome(OutcomeKind.FAILED, states, failure=failure)
            case Run():
                return self._until_stopped(group, policy, running)
            case Hang():
                stop = policy.on_hang(running, Idle(5.0))
                return Outcome(
                    stop.kind, self._states(group, WorkerStatus.TERMINATED, -15), reason=stop.reason
                )
        raise AssertionError("unknown script step")

    def _until_stopped(
        self, group: GroupInfo, policy: AttemptPolicy, running: Mapping[int, int]
    ) -> Outcome:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            stop = policy.poll(running)
            if stop is not None:
                states = self._states(group, WorkerStatus.TERMINATED, -15)
                return Outcome(stop.kind, states, reason=stop.reason)
            time.sleep(0.01)
        raise AssertionError(f"{self.host}: the policy never stopped the workers")

    def _states(self, group: GroupInfo, state: WorkerStatus, code: int) -> list[WorkerSummary]:
        return [
            WorkerSummary(group.rank_offset + lr, lr, 10_000_000 + lr, state, code, state)
            for lr in range(self.nproc)
        ]

    def results(self, outcome: Outcome) -> list[Any]:
        return [f"{self.host}/{w.rank}" for w in outcome.workers]


# ---------------------------------------------------------------------------- the cluster
class Cluster:
    """Nodes (threads) of one job over one MemoryKV."""

    def __init__(
        self, tmp: Path, *, min_nodes: int, max_nodes: int, keep_alive_s: float = 0.2
    ) -> None:
        self.kv = MemoryKV()
        self.keep_alive = timedelta(seconds=keep_alive_s)  # the liveness window: 5 of them
        self.tmp = tmp
        self.min_nodes, self.max_nodes = min_nodes, max_nodes
        self.pool = ThreadPoolExecutor(max_workers=8)
        self.handlers: list[DynamicRendezvousHandler] = []
        self.observers: list[Observer] = []

    def handler(self) -> DynamicRendezvousHandler:
        config = DynamicRendezvousConfig(
            run_id=RUN_ID,
            min_nodes=self.min_nodes,
            max_nodes=self.max_nodes,
            **{**FAST, "keep_alive_interval": self.keep_alive},
        )
        handler = DynamicRendezvousHandler(self.kv, config)
        self.handlers.append(handler)
        return handler

    def start(
        self, supervisor: NodeSupervisor, *, max_restarts: int = 0, on_hang: str = "restart"
    ) -> Future[list[Any]]:
        observer = Observer(
            nproc=supervisor.nproc,
            watch=LaunchConfig(events=str(self.tmp / f"{supervisor.host}.jsonl")).watch,
            node=supervisor.host,
        )
        self.observers.append(observer)
        handler = self.handler()
        restarts = LaunchConfig(max_restarts=max_restarts, on_hang=on_hang).restarts  # type: ignore[arg-type]
        rounds = RendezvousRounds(
            supervisor,
            lambda: handler,
            observer,
            restarts=restarts,
            run_id=RUN_ID,
            endpoint="memory",
        )
        coordinator = Coordinator(
            supervisor,
            rounds,
            observer,
            restarts=restarts,
            title="test job",
            monitor_interval=0.05,
        )
        return self.pool.submit(coordinator.run)

    def restarts_spent(self) -> int:
        store = self.handlers[0].open_run_store(run_store_namespace(RUN_ID))
        return RunStore(store).restarts()

    def events(self, host: str, kind: str) -> list[Any]:
        return [e for e in read_events(self.tmp / f"{host}.jsonl") if e.kind == kind]

    def close(self) -> None:
        for handler in self.handlers:
            handler.shutdown()
        for observer in self.observers:
            observer.close()
        self.pool.shutdown(wait=False, cancel_futures=True)


@pytest.fixture
def make_cluster(tmp_path: Path) -> Iterator[Callable[..., Cluster]]:
    clusters: list[Cluster] = []

    def make(**kw: Any) -> Cluster:
        clusters.append(Cluster(tmp_path, **kw))
        return clusters[-1]

    yield make
    for cluster in clusters:
        cluster.close()


def _result(future: Future[list[Any]]) -> list[Any]:
    return future.result(timeout=60)


def _error(future: Future[list[Any]]) -> BaseException:
    exc = future.exception(timeout=60)
    assert exc is not None, "expected this node to fail"
    return exc


# ---------------------------------------------------------------------------- tests
@pytest.mark.timeout(90)
def test_one_failure_spends_one_restart_and_every_node_restarts(
    make_cluster: Callable[..., Cluster],
) -> None:
    cluster = make_cluster(min_nodes=3, max_nodes=3)

    def script(number: int, group: GroupInfo) -> Finish | Fail | Run | Hang:
        if number == 0:
            return Fail(at=time.time()) if group.group_rank == 1 else Run()
        return Finish()

    nodes = [FakeSupervisor(f"node{i}", script) for i in range(3)]
    futures = [cluster.start(node, max_restarts=2) for node in nodes]
    for node, future in zip(nodes, futures, strict=True):
        results = _result(future)
        offset = node.groups[-1].rank_offset
        assert results == [f"{node.host}/{offset}", f"{node.host}/{offset + 1}"]
    assert cluster.restarts_spent() == 1  # one node claimed the round for the whole job
    for node in nodes:
        assert len(node.groups) == 2  # every node restarted its workers
        assert [g.restart_count for g in node.groups] == [0, 1]
        assert node.groups[-1].world_size == 6 and node.groups[-1].max_restarts == 2
        (restart,) = cluster.events(node.host, "restart")
        assert restart.get("restart_count") == 1
        assert restart.get("reason").startswith("rank ")
    offsets = sorted(node.groups[-1].rank_offset for node in nodes)
    assert offsets == [0, 2, 4]


@pytest.mark.timeout(90)
def test_spent_budget_gives_every_node_the_earliest_failure(
    make_cluster: Callable[..., Cluster],
) -> None:
    """Group rank 1 reports first, but only as a consequence (a peer vanished), an hour
    later by its clock; group rank 2 reports later with the earlier failure: every node,
    the two that failed and the one that did not, raises group rank 2's failure. Rank 2
    must report within rank 1's wait for a peer's loss (the liveness window): 5 s here."""
    cluster = make_cluster(min_nodes=3, max_nodes=3, keep_alive_s=1.0)
    now = time.time()

    def script(number: int, group: GroupInfo) -> Finish | Fail | Run | Hang:
        if group.group_rank == 1:
            return Fail(at=now + 3600, traceback=PEER_LOST)
        if group.group_rank == 2:
            return Fail(at=now, delay=0.2)
        return Run()

    nodes = [FakeSupervisor(f"node{i}", script) for i in range(3)]
    futures = [cluster.start(node, max_restarts=0) for node in nodes]
    errors = [_error(f) for f in futures]
    root = next(node for node in nodes if node.groups[0].group_rank == 2)
    for exc in errors:
        assert isinstance(exc, WorkerFailedError), exc
        assert (exc.host, exc.rank) == (root.host, root.groups[0].rank_offset)
        assert exc.remote_traceback == "ValueError: boom"
        assert "FAILED (no restarts)" in exc.summary
    assert cluster.restarts_spent() == 1  # the budget (0) was spent by that failure
    for node in nodes:
        assert len(node.groups) == 1  # nobody restarted
        (failure,) = cluster.events(node.host, "failure")
        assert failure.rank == root.groups[0].rank_offset


@pytest.mark.timeout(90)
def test_a_node_joining_restarts_without_spending_budget(
    make_cluster: Callable[..., Cluster],
) -> None:
    cluster = make_cluster(min_nodes=2, max_nodes=3)

    def script(number: int, group: GroupInfo) -> Finish | Fail | Run | Hang:
        return Run() if group.group_world_size == 2 else Finish()

    first = [FakeSupervisor(f"node{i}", script) for i in range(2)]
    futures = [cluster.start(node) for node in first]
    for node in first:
        assert node.in_attempt.wait(30), "the first round never started"
    late = FakeSupervisor("node2", script)
    futures.append(cluster.start(late))
    for future in futures:
        assert len(_result(future)) == 2
    assert cluster.restarts_spent() == 0
    for node in first:
        assert [g.group_world_size for g in node.groups] == [2, 3]
        assert [g.restart_count for g in node.groups] == [0, 0]
        (restart,) = cluster.events(node.host, "restart")
        assert "membership changed" in restart.get("reason")
    assert [g.group_world_size for g in late.groups] == [3]


@pytest.mark.timeout(90)
def test_hang_with_on_hang_fail_stops_every_node(
    make_cluster: Callable[..., Cluster], capfd: pytest.CaptureFixture[str]
) -> None:
    cluster = make_cluster(min_nodes=3, max_nodes=3)

    def script(number: int, group: GroupInfo) -> Finish | Fail | Run | Hang:
        return Hang() if group.group_rank == 0 else Run()

    nodes = [FakeSupervisor(f"node{i}", script) for i in range(3)]
    futures = [cluster.start(node, max_restarts=3, on_hang="fail") for node in nodes]
    errors = [_error(f) for f in futures]
    hung = next(i for i, node in enumerate(nodes) if node.groups[0].group_rank == 0)
    for i, exc in enumerate(errors):
        reason = f"no worker on {nodes[hung].host} reported progress for 5.0 s"
        if i == hung:
            assert isinstance(exc, HangError), exc
        else:
            assert isinstance(exc, RendezvousFailedError), exc
            assert "the job failed" in str(exc)
        assert reason in str(exc)
    assert cluster.restarts_spent() == 0  # on_hang="fail" fails at once, whatever the budget
    assert "stacks of every rank" in capfd.readouterr().err
    (hang,) = cluster.events(nodes[hung].host, "hang")
    assert hang.get("action") == "fail"


def test_policy_is_rate_limited_and_loses_the_store_cleanly() -> None:
    """A store error during a tick is a LOST outcome, never an exception in the loop."""

    class Broken:
        def answer_stacks(self, running: Mapping[int, int], node_rank: int) -> None:
            raise ConnectionError("store is gone")

        poll_every = 0.5

    class Rnd:
        job = Broken()
        group_rank = 0

    policy = ElasticPolicy(Rnd(), host="h")  # type: ignore[arg-type]
    stop = policy.poll({0: 1})
    assert stop is not None and stop.kind is OutcomeKind.LOST
    assert "store is gone" in stop.reason
    assert policy.poll({0: 1}) is None  # the next tick comes after poll_every
