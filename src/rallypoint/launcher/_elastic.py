"""The multi-node (elastic) agent: rendezvous, one restart budget per job, one failure report.

Every node runs the same command; each agent loops over rounds:

1. ``next_rendezvous()`` on a ``rallypoint.rendezvous`` handler gives the group rank and
   the node count. In the round's own store the agents exchange their ``--nproc-per-node``
   (global ``RANK`` = sum of the local world sizes of lower group ranks + local rank, so
   nodes may differ, as with torchrun) and group rank 0 starts a fresh worker store in
   its warm process (bound on all interfaces) and publishes ``addr:port``.
2. The local workers start from the warm process and are watched as on one node; every
   monitor tick also checks the round's ``restart`` key, ``num_nodes_waiting()``
   (newcomers or members that missed their heartbeats), stack requests, and the hang
   watchdog.
3. A local failure is published as a record in the round store (time, host, ranks, exit
   code or signal, traceback); then the first agent to ``add("claim", 1)`` spends one
   restart of the job's budget (an atomic counter in the run's store, so every node and
   every worker sees the same ``TORCHELASTIC_RESTART_COUNT``) and writes the round's
   decision under ``restart``. Every agent sees the key, stops its workers and either
   re-rendezvouses or, when the budget is spent, prints the same root cause (the earliest
   failure record) and exits 1 after the rendezvous is closed. Membership changes
   (scale-up, node loss) restart without spending budget.
4. When every node's workers succeeded the job's status is written, the rendezvous is
   closed and every agent exits 0.

Keys: the round store ``<round prefix>/`` holds ``node/<g>`` (local world size and host),
``master``, ``failure/<g>``, ``claim``, ``restart``, ``root``, ``done``; the run store
``rallypoint/<run_id>/job/`` holds ``restarts``, ``status``, ``left/<round>``,
``hang/<round>`` and the ``stacks/*`` exchange (so ``rallypoint stacks`` finds it without
knowing the round).
"""

from __future__ import annotations

import contextlib
import json
import signal
import threading
import time
from datetime import timedelta
from typing import Any

from rallypoint.launcher._agent import Agent
from rallypoint.launcher._errors import (
    BadTargetError,
    HangError,
    LaunchError,
    LaunchInterruptedError,
    LaunchTimeoutError,
    RendezvousFailedError,
    WorkerFailedError,
    WorkerState,
)
from rallypoint.launcher._output import write_console
from rallypoint.launcher._stacks import (
    answer_stacks_request,
    format_grouped_stacks,
    latest_stacks_request,
    publish_node_count,
    request_stacks,
)
from rallypoint.launcher._state import GroupInfo
from rallypoint.launcher._state import Outcome as _Outcome
from rallypoint.launcher._state import Worker as _Worker
from rallypoint.launcher._summary import PEER_LOSS as _PEER_LOSS
from rallypoint.launcher._summary import format_summary

__all__ = ["ElasticAgent", "create_rendezvous", "run_store_of"]


POLL_EVERY = 0.1
"""Least seconds between the store checks of the monitor loop (restart key, waiting nodes,
stack requests: about four round trips); ``--monitor-interval`` raises it, which large jobs
on one TCPStore should do."""
AGENT_KEEP_ALIVE_INTERVAL = 3.0
"""Seconds between an agent's heartbeats unless ``--rdzv-conf keep_alive_interval=`` says
otherwise; with the default 3 missed beats a lost node is noticed within 12 s."""
EXIT_BARRIER = 10.0
"""Seconds an agent waits for the others to see the job's end before it exits (the node
hosting the rendezvous store must not take it away while others still read it)."""


def create_rendezvous(
    backend: str, endpoint: str, run_id: str, min_nodes: int, max_nodes: int, conf: dict[str, str]
) -> Any:
    """A ``rallypoint.rendezvous`` handler for the agent (the workers' store is ours)."""
    from rallypoint.rendezvous import RendezvousParameters, rendezvous_handler_registry

    options: dict[str, Any] = dict(conf)
    options.setdefault("use_agent_store", "false")
    # torch's handler default is 5 s x 3 missed beats, and a loss is noticed within one
    # interval more than that (20 s); the agent promises at most 15 s by default: 3 s x 4 = 12 s.
    options.setdefault("keep_alive_interval", str(AGENT_KEEP_ALIVE_INTERVAL))
    params = RendezvousParameters(
        backend=backend,
        endpoint=endpoint,
        run_id=run_id,
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        **options,
    )
    return rendezvous_handler_registry.create_handler(params)


def run_store_of(handler: Any, run_id: str) -> Any | None:
    """A store for the whole run (not one round), on its own connection; ``None`` for
    handlers without a key-value layer (``static``: the agent uses the rendezvous store).

    The rendezvous part has no public accessor for its key-value store yet, so this reads
    the handler's ``_kv`` (see the agent docs)."""
    kv = getattr(handler, "_kv", None)
    if kv is None:
        return None
    return kv.clone().torch_store(f"rallypoint/{run_id}/job")


def _prefixed(prefix: str, store: Any) -> Any:
    from torch._C._distributed_c10d import PrefixStore

    return PrefixStore(prefix, store)


class ElasticAgent(Agent):
    """One node of a multi-node job (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        cfg = self.config
        self.run_id = cfg.run_id or "none"
        self.restart_count = 0
        self.handler: Any = None
        self.rs: Any = None  # this round's store
        self.run_store: Any = None
        self.run_store2: Any = None  # second connection for a blocking stacks request
        self.answered = 0
        self.nnodes = 0
        self.members: list[str] = []
        self._next_poll = 0.0
        self._poll_every = max(POLL_EVERY, self.config.monitor_interval.total_seconds())
        self._local_round = 0

    # ------------------------------------------------------------------ main loop
    def run(self) -> list[Any]:
        status, code = "failed", 1
        old = self._install_signal_handlers()
        try:
            self._init_warm()
            self._connect()
            try:
                results = self._rounds()
            except (LaunchError, ValueError, TypeError):
                raise
            except Exception as exc:  # the store went away between rounds
                raise RendezvousFailedError(
                    f"lost the rendezvous store ({type(exc).__name__}: {exc}); this node stopped"
                ) from exc
            status, code = "succeeded", 0
            return results
        except LaunchInterruptedError as exc:
            status, code = "interrupted", 128 + exc.signum
            raise
        finally:
            self._restore_signal_handlers(old)
            with contextlib.suppress(Exception):
                self.obs.emit("job_end", status=status, exitcode=code)
            self.obs.close()
            import shutil

            shutil.rmtree(self._tmp, ignore_errors=True)

    def _connect(self) -> None:
        from rallypoint.rendezvous import RendezvousError

        cfg = self.config
        conf = {k: str(v) for k, v in cfg.rdzv_conf.items()}
        if cfg.rdzv_backend == "static" and cfg.node_rank is not None:
            conf.setdefault("rank", str(cfg.node_rank))
        try:
            self.handler = create_rendezvous(
                cfg.rdzv_backend, cfg.rdzv_endpoint, self.run_id, cfg.min_nodes, cfg.max_nodes, conf
            )
            self.run_store = run_store_of(self.handler, self.run_id)
            self.run_store2 = run_store_of(self.handler, self.run_id)
            if self.run_store is not None:
                self.answered = latest_stacks_request(self.run_store)
        except RendezvousError as exc:
            raise RendezvousFailedError(f"rendezvous {cfg.rdzv_endpoint!r}: {exc}") from None
        except RuntimeError as exc:
            raise RendezvousFailedError(f"rendezvous {cfg.rdzv_endpoint!r}: {exc}") from None

    def _rounds(self) -> list[Any]:
        """Rounds until the job ends; returns this node's results of the last round."""
        from rallypoint.rendezvous import (
            RendezvousClosedError,
            RendezvousError,
            RendezvousGracefulExitError,
        )

        while True:
            try:
                info = self._next_rendezvous()
            except (RendezvousClosedError, RendezvousGracefulExitError) as exc:
                self._ended_elsewhere(exc)
                return []
            except RendezvousError as exc:
                raise RendezvousFailedError(f"rendezvous failed: {exc}") from None
            self._setup_round(info)
            outcome = self._attempt(self.round)
            if self._after_round(outcome):
                return [self._result(w) for w in outcome.workers]

    def _next_rendezvous(self) -> Any:
        """``next_rendezvous()`` in a thread, so that SIGINT/SIGTERM still stop this agent
        while it blocks inside the store (a blocked C call does not return for signals)."""
        result: dict[str, Any] = {}

        def join() -> None:
            try:
                result["info"] = self.handler.next_rendezvous()
            except BaseException as exc:
                result["exc"] = exc

        t = threading.Thread(target=join, name="rallypoint-rendezvous", daemon=True)
        t.start()
        while t.is_alive():
            t.join(0.05)
            self._check_signals()
        if "exc" in result:
            raise result["exc"]
        return result["info"]

    def _check_signals(self) -> None:
        if self.signals:
            signum = self.signals.pop(0)
            name = signal.Signals(signum).name
            raise LaunchInterruptedError(
                f"received {name} while waiting for the other nodes; stopped", signum=signum
            )

    def _ended_elsewhere(self, exc: Exception) -> None:
        status = self._status()
        if status == "succeeded":
            write_console(2, b"rallypoint: the job already finished successfully\n")
            return
        raise RendezvousFailedError(
            f"{exc} (job status: {status or 'unknown'}); this node did not run"
        )

    def _status(self) -> str:
        store = self.run_store
        if store is None:
            return ""
        with contextlib.suppress(Exception):
            if store.check(["status"]):
                return bytes(store.get("status")).decode()
        return ""

    def _setup_round(self, info: Any) -> None:
        cfg = self.config
        k = getattr(self.handler, "round", None)
        if k is None:
            k = self._local_round
        self._local_round = k + 1
        self.round = k
        store = info.store
        if self.run_store is None:  # static: the rendezvous store is the run's store
            self.run_store = _prefixed("rallypoint/job", store)
            self.run_store2 = self.run_store
            self.answered = latest_stacks_request(self.run_store)
        rs = self.rs = _prefixed(f"rallypoint/round{k}", store)
        group_rank, nnodes = int(info.rank), int(info.world_size)
        self.nnodes = nnodes
        rs.set(f"node/{group_rank}", f"{cfg.nproc} {self.host}")
        keys = [f"node/{g}" for g in range(nnodes)]
        rs.wait(keys)  # one blocking round trip, then one read of every node's entry
        nodes = [bytes(v).decode().split(" ", 1) for v in rs.multi_get(keys)]
        sizes = [int(n) for n, _ in nodes]
        self.members = [host for _, host in nodes]
        if group_rank == 0:
            addr = info.bootstrap_store_info.master_addr
            self.port, self.store_pid = self.warm.start_store(addr, 0)
            rs.set("master", f"{addr}:{self.port}")
        master = bytes(rs.get("master")).decode()
        addr, _, port = master.rpartition(":")
        self.port = int(port)
        self.restart_count = int(self.run_store.add("restarts", 0))
        publish_node_count(self.run_store, nnodes)
        self.group = GroupInfo(
            group_rank=group_rank,
            group_world_size=nnodes,
            world_size=sum(sizes),
            rank_offset=sum(sizes[:group_rank]),
            master_addr=addr,
            master_port=self.port,
            hosts_store=group_rank == 0,
            run_id=self.run_id,
        )
        self.obs.emit(
            "round",
            round=k,
            world_size=sum(sizes),
            nnodes=nnodes,
            run_id=self.run_id,
            group_rank=group_rank,
        )
        self.obs.emit("members", round=k, members=self.members, group_rank=group_rank)
        self._next_poll = 0.0
        self._claimed = False

    def _worker_env(self, local_rank: int, attempt: int, error_file: Any) -> dict[str, str]:
        env = super()._worker_env(local_rank, attempt, error_file)
        env["TORCHELASTIC_RESTART_COUNT"] = str(self.restart_count)
        env["TORCHELASTIC_RUN_ID"] = self.run_id
        return env

    # ------------------------------------------------------------------ monitoring
    def _poll(self, workers: list[_Worker]) -> _Outcome | None:
        now = time.monotonic()
        if now < self._next_poll:
            return None
        self._next_poll = now + self._poll_every
        try:
            self._answer_stacks(workers)
            if self.rs.check(["restart"]):
                return _Outcome("restart", workers, reason=self._decision()["reason"])
            waiting = int(self.handler.num_nodes_waiting())
            if waiting > 0:
                reason = f"membership changed ({waiting} node(s) waiting to join or lost)"
                self._claim(reason, spend=False)
                return _Outcome("restart", workers, reason=reason)
            if self.obs.hung():
                return _Outcome("hang", workers, reason=self._job_hang(workers))
        except Exception as exc:
            return _Outcome("lost", workers, reason=f"lost the rendezvous store: {exc}")
        return None

    def _answer_stacks(self, workers: list[_Worker]) -> None:
        pids = {w.rank: w.pid for w in workers if w.status is None}
        self.answered = answer_stacks_request(
            self.run_store,
            node_rank=self.group.group_rank,
            answered=self.answered,
            collect=lambda: self.obs.collect(pids),
        )

    def _job_hang(self, workers: list[_Worker]) -> str:
        idle = self.obs.idle_seconds()
        reason = f"no worker on {self.host} reported progress for {idle:.1f} s (--hang-timeout)"
        self.obs.emit("hang", round=self.round, idle_s=round(idle, 3), action=self.config.on_hang)
        if int(self.run_store.add(f"hang/{self.round}", 1)) == 1:
            result: dict[str, Any] = {}

            def ask() -> None:
                with contextlib.suppress(Exception):
                    result["r"] = request_stacks(self.run_store2, timeout=10, nnodes=self.nnodes)

            t = threading.Thread(target=ask, daemon=True)
            t.start()
            while t.is_alive():
                self._answer_stacks(workers)
                t.join(0.05)
            dumps, missing = result.get("r", ({}, {}))
            text = format_grouped_stacks(dumps) if dumps else "(no stacks)"
            for node, why in sorted(missing.items()):
                text += f"\nnode {node}: {why}"
            write_console(2, f"rallypoint: {reason}; stacks of every rank:\n{text}\n".encode())
            self.run_store.set(f"hang/{self.round}/done", "1")
        else:  # another node asks for everyone's stacks: keep answering until it has them
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                self._answer_stacks(workers)
                if self.run_store.check([f"hang/{self.round}/done"]):
                    break
                time.sleep(0.05)
        spend = self.config.on_hang == "restart"
        self._claim(reason, spend=True, force_fail=not spend)
        return reason

    def _claim(self, reason: str, *, spend: bool, force_fail: bool = False) -> None:
        """Decide the round's fate once for the whole job."""
        if int(self.rs.add("claim", 1)) != 1:
            return
        count = int(self.run_store.add("restarts", 1 if spend and not force_fail else 0))
        fail = force_fail or (spend and count > self.config.max_restarts)
        decision = {
            "action": "fail" if fail else "restart",
            "reason": reason,
            "count": min(count, self.config.max_restarts),
            "by": self.group.group_rank,
        }
        self._claimed = True
        self.rs.set("restart", json.dumps(decision))

    def _decision(self) -> dict[str, Any]:
        value: dict[str, Any] = json.loads(bytes(self.rs.get("restart")).decode())
        return value

    # ------------------------------------------------------------------ after a round
    def _after_round(self, outcome: _Outcome) -> bool:
        """Returns True when the job is over for this node (success); raises on failure."""
        if outcome.kind == "signal":
            name = signal.Signals(outcome.signum).name
            raise LaunchInterruptedError(
                f"received {name}: forwarded it to the workers and stopped", signum=outcome.signum
            )
        if outcome.kind == "timeout":
            self._claim("the job ran past --timeout", spend=True, force_fail=True)
            raise LaunchTimeoutError(f"the job did not finish within {self.config.timeout}")
        if outcome.kind == "lost":
            raise RendezvousFailedError(outcome.reason + "; stopped this node's workers")
        if outcome.kind in ("failed", "bad_target"):
            assert outcome.root is not None
            self._publish_failure(outcome.root)
            root = outcome.root.state()
            if not self._peer_loss(outcome.root):  # else: a restart is decided; follow it
                self._claim(
                    f"rank {root.rank} on {self.host} {root.detail}",
                    spend=True,
                    force_fail=outcome.kind == "bad_target",
                )
        elif outcome.kind == "ok" and self._wait_job_done(outcome.workers):
            self._finish("succeeded")
            return True
        decision = self._decision()
        if decision["action"] == "restart":
            count = int(decision["count"])
            write_console(
                2,
                f"rallypoint: {decision['reason']}; restarting the workers on every node "
                f"(restarts used: {count} of {self.config.max_restarts})\n".encode(),
            )
            self.obs.emit(
                "restart", round=self.round + 1, restart_count=count, reason=decision["reason"]
            )
            return False
        self._fail(outcome, decision)
        raise AssertionError("unreachable")

    def _peer_loss(self, w: _Worker) -> bool:
        """A worker that failed in a collective because a peer vanished is not a job failure
        when that peer's node is gone: wait up to the heartbeat window for another node's
        decision or a membership change (which restarts without spending budget)."""
        if self.rs.check(["restart"]):
            return True
        tb, _ = self._error_info(w)
        if not _PEER_LOSS.search(tb):
            return False
        settings = getattr(self.handler, "settings", None)
        if settings is None:
            return False
        window = settings.keep_alive_interval.total_seconds() * (
            settings.keep_alive_max_attempt + 2
        )
        deadline = time.monotonic() + window
        while time.monotonic() < deadline:
            if self.rs.check(["restart"]):
                return True
            waiting = int(self.handler.num_nodes_waiting())
            if waiting > 0:
                reason = f"membership changed ({waiting} node(s) waiting to join or lost)"
                self._claim(reason, spend=False)
                return True
            self._check_signals()
            time.sleep(self._poll_every)
        return False

    def _publish_failure(self, w: _Worker) -> None:
        tb, _ = self._error_info(w)
        state = w.state()
        record = {
            "time": time.time() - (time.monotonic() - w.exited_at),
            "elapsed": w.exited_at - self.started,
            "host": self.host,
            "rank": w.rank,
            "local_rank": w.local_rank,
            "pid": w.pid,
            "exitcode": state.exitcode,
            "detail": state.detail,
            "traceback": tb,
            "group_rank": self.group.group_rank,
        }
        self.rs.set(f"failure/{self.group.group_rank}", json.dumps(record))

    def _wait_job_done(self, workers: list[_Worker]) -> bool:
        """This node succeeded: wait until every node did (True) or a restart was decided."""
        done = int(self.rs.add("done", 1))
        while done < self.nnodes:
            if self.rs.check(["restart"]):
                return False
            if int(self.handler.num_nodes_waiting()) > 0:
                self._claim("membership changed after this node finished", spend=False)
                return False
            self._answer_stacks(workers)
            self._check_signals()
            time.sleep(self._poll_every)
            done = int(self.rs.add("done", 0))
        return True

    def _finish(self, status: str) -> None:
        key = f"left/{self.round}"
        try:
            self.run_store.set("status", status)
            self.handler.set_closed()
            left = int(self.run_store.add(key, 1))
            deadline = time.monotonic() + EXIT_BARRIER
            while left < self.nnodes and time.monotonic() < deadline:
                time.sleep(0.02)
                left = int(self.run_store.add(key, 0))
        except Exception:  # the node hosting the store saw everyone leave and went first
            return

    def _root_record(self) -> dict[str, Any] | None:
        keys = [f"failure/{g}" for g in range(self.nnodes)]
        records = []
        for key in keys:
            if self.rs.check([key]):
                records.append(json.loads(bytes(self.rs.get(key)).decode()))
        return min(records, key=lambda r: r["time"]) if records else None

    def _fail(self, outcome: _Outcome, decision: dict[str, Any]) -> None:
        if self._claimed:
            root = self._root_record()
            self.rs.set("root", json.dumps(root))
        else:
            self.rs.wait(["root"], timedelta(seconds=30))
        root = json.loads(bytes(self.rs.get("root")).decode())
        self.obs.emit(
            "failure",
            round=self.round,
            rank=None if root is None else root["rank"],
            exitcode=None if root is None else root["exitcode"],
            message=decision["reason"],
        )
        self._finish("failed")
        if root is None:
            if outcome.kind == "hang":
                raise HangError(f"{decision['reason']}; stopped the workers on every node")
            raise RendezvousFailedError(f"the job failed: {decision['reason']}")
        state = WorkerState(
            root["rank"],
            root["local_rank"],
            root["pid"],
            "failed",
            root["exitcode"],
            root["detail"],
        )
        others = [w.state() for w in outcome.workers if w.rank != root["rank"]]
        restarts = self.config.max_restarts
        summary = format_summary(
            title=self.title,
            root=state,
            host=root["host"],
            when=root["time"],
            elapsed=root["elapsed"],
            traceback_text=root["traceback"],
            others=others,
            attempts=f"{restarts} restart(s) used of {restarts}" if restarts else "no restarts",
        )
        if outcome.kind == "bad_target":
            raise BadTargetError(root["traceback"] or root["detail"])
        raise WorkerFailedError(
            f"rank {root['rank']} on {root['host']} {root['detail']}",
            rank=root["rank"],
            local_rank=root["local_rank"],
            pid=root["pid"],
            host=root["host"],
            exitcode=root["exitcode"],
            remote_traceback=root["traceback"],
            summary=summary,
            others=tuple(others),
        )

    _claimed = False
