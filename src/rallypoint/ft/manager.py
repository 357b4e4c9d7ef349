"""``Manager``: torchft's per-step quorum, heal and commit, on rallypoint's stack.

Every step (``start_quorum``, from ``Optimizer.zero_grad``) the group's rank 0 asks the
lighthouse's store for a quorum (``_quorum``); a new quorum reconfigures the process group
across the groups; a group behind the others fetches their state from a live peer
(``_heal``) and resumes at their step. ``allreduce`` averages over the participants (a
healing group sends zeros). ``should_commit`` is one decision for the whole quorum
(``_commit``): every member steps, or none. A watcher thread aborts the process group the
moment a member of the quorum is gone (its agent said so, or its heartbeat stopped) or
the step cannot commit, so no collective waits on a dead group (``_watch``). Errors of a
step are recorded (``errored()``) and fail its commit; a quorum that cannot be had raises
``TimeoutError``. Usage: docs/ft.md.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import enum
import os
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from rallypoint.ft._group.manager_parts import (
    Background,
    advertised,
    agree_on_member,
    ask,
    check_arguments,
    group_address,
    group_store,
    heal_addresses,
    heal_server,
    retries_of,
    say,
    spares_left_out,
    tell_agent,
    tensor_bytes,
    transport_metadata,
    triton_present,
    with_timeout,
)
from rallypoint.ft._group.ready import count_in, until_ready
from rallypoint.ft._group.stopped import mark, runs_check
from rallypoint.ft._plan import Plan, plan
from rallypoint.ft._quorum.client import LighthouseLink, connect_lighthouse
from rallypoint.ft._quorum.commit import ABORT, COMMIT, SIT, agree
from rallypoint.ft._quorum.records import Quorum, Request
from rallypoint.ft._quorum.watch import GroupGuard
from rallypoint.ft._record import GroupEvents
from rallypoint.ft._state.heal import (
    HealError,
    IncompatibleStateError,
    fetch_state,
    mismatch,
)
from rallypoint.ft._state.rwlock import RWLock
from rallypoint.ft.work import ManagedWork, wrap_future
from rallypoint.ft.work import _DummyWork as DummyWork
from rallypoint.ft.work import _ManagedWork as _ManagedWork  # where torchft's tests look
from rallypoint.rendezvous import KeyValueStore

__all__ = [
    "MANAGER_ADDR_KEY",
    "REPLICA_ID_KEY",
    "ExceptionWithTraceback",
    "Manager",
    "WorldSizeMode",
]

T = TypeVar("T")

MANAGER_ADDR_KEY: str = "manager_addr"
"""torchft's group-store key of its manager server's address; here rank 0 writes its heal
address (what the other groups reach this group at) under it."""
REPLICA_ID_KEY: str = "replica_id"
"""The group-store key (as torchft's) that rank 0 writes this group's member id under."""


class WorldSizeMode(enum.Enum):
    """``DYNAMIC``: every group in the quorum takes part and the average divides by them;
    ``FIXED_WITH_SPARES``: ``min_replica_size`` groups take part, the others are spares
    (they hold the state and step with the others, and send zeros to the average)."""

    DYNAMIC = 0
    FIXED_WITH_SPARES = 1


class ExceptionWithTraceback(Exception):
    """A recorded error of a step (torchft's wrapper: the original is ``.original_exception``)."""

    def __init__(self, e: Exception) -> None:
        super().__init__(str(e))
        self.original_exception = e
        self.stack_trace = "".join(
            __import__("traceback").format_exception(type(e), e, e.__traceback__)
        )


def _env_seconds(name: str, default: timedelta) -> timedelta:
    raw = os.environ.get(name)
    return timedelta(seconds=int(raw)) if raw else default


class Manager:
    """torchft's ``Manager`` (same arguments, same methods; see docs/ft.md)."""

    def __init__(
        self,
        pg: Any,
        load_state_dict: Callable[[Any], None] | None,
        state_dict: Callable[[], Any] | None,
        min_replica_size: int,
        use_async_quorum: bool = True,
        timeout: timedelta = timedelta(seconds=60),
        quorum_timeout: timedelta = timedelta(seconds=60),
        connect_timeout: timedelta = timedelta(seconds=60),
        rank: int | None = None,
        world_size: int | None = None,
        world_size_mode: WorldSizeMode = WorldSizeMode.DYNAMIC,
        store_addr: str | None = None,
        store_port: int | None = None,
        lighthouse_addr: str | None = None,
        replica_id: str | None = None,
        port: int | None = None,
        hostname: str = socket.gethostname(),
        heartbeat_interval: timedelta = timedelta(milliseconds=100),
        checkpoint_transport: Any = None,
        init_sync: bool = True,
        max_retries: int | None = None,
        quorum_retries: int = 0,
    ) -> None:
        if isinstance(min_replica_size, bool) or not isinstance(min_replica_size, int):
            raise TypeError(f"min_replica_size must be an int, got {min_replica_size!r}")
        if min_replica_size < 1:
            raise ValueError(f"min_replica_size must be at least 1, got {min_replica_size}")
        check_arguments(world_size_mode, WorldSizeMode, checkpoint_transport, port)
        self._pg = pg
        self._fns: dict[str, tuple[Callable[[Any], None], Callable[[], Any]]] = {}
        if load_state_dict is not None and state_dict is not None:
            self._fns["default"] = (load_state_dict, state_dict)
        self._min_replica_size = min_replica_size
        self._state_lock = RWLock(timeout=timeout.total_seconds())
        self._reads_allowed = True
        self._use_async_quorum = use_async_quorum
        self._timeout = _env_seconds("TORCHFT_TIMEOUT_SEC", timeout)
        self._quorum_timeout = _env_seconds("TORCHFT_QUORUM_TIMEOUT_SEC", quorum_timeout)
        self._connect_timeout = _env_seconds("TORCHFT_CONNECT_TIMEOUT_SEC", connect_timeout)
        self._world_size_mode = world_size_mode
        self._init_sync = init_sync
        self._max_retries = max_retries
        self._quorum_retries = retries_of(quorum_retries)
        self._rank = rank if rank is not None else int(os.environ.get("RANK", "0"))
        self._world_size = world_size or int(os.environ.get("WORLD_SIZE", "1"))
        self._replica_id = str(replica_id or os.environ.get("REPLICA_GROUP_ID", "") or "0")
        self._lighthouse = lighthouse_addr or os.environ.get("TORCHFT_LIGHTHOUSE", "")
        self._connect_lighthouse().close()  # a bad or unreachable address: one line, now
        self._group_at = group_address(store_addr, store_port)
        self._group = group_store(*self._group_at, self._connect_timeout)
        self._member, self._secret, self._advertised_secret = agree_on_member(
            self._group, self._rank, self._replica_id, self._connect_timeout
        )
        self._heal = heal_server(self._secret, self._timeout, self._rank, port, self._replica_id)
        self._heal.advertised = advertised(hostname)
        self._transport = checkpoint_transport if checkpoint_transport is not None else self._heal
        self._heal_addr = transport_metadata(self._transport)
        mark(self._group, self._rank, stopped=False)  # before heal/<rank>, which rank 0 waits on
        self._group.set(f"heal/{self._rank}", self._heal_addr)
        if self._rank == 0:
            self._group.set(MANAGER_ADDR_KEY, self._heal.metadata())
            self._group.set(REPLICA_ID_KEY, self._member)
        self._client = (
            LighthouseLink(
                self._lighthouse,
                self._member,
                self._replica_id,
                connect_timeout=self._connect_timeout.total_seconds(),
                heartbeat=heartbeat_interval.total_seconds(),
                beats_if=runs_check(self._group, self._world_size, self._rank),
            )
            if self._rank == 0
            else None
        )
        self._events = GroupEvents(self._replica_id, self._rank)
        tell_agent(self._lighthouse, self._member, self._group_at)
        self._start_state()

    def _start_state(self) -> None:
        """A new manager's step state, and the watcher of its quorum's members."""
        self._step = 0
        self._batches_committed = 0
        self._commit_failures = 0
        self._errored: ExceptionWithTraceback | None = None
        self._healing = False
        self._pending: Any = None
        self._quorum_seq = 0
        self._commit_seq = 0
        self._plan: Plan | None = None
        self._said_below: int | None = None
        self._incompatible: IncompatibleStateError | None = None
        self._future: concurrent.futures.Future[None] | None = None
        self._stop = threading.Event()
        self._background = Background()
        self._guard = GroupGuard(
            self._pg,
            self._connect_lighthouse(),
            self._connect_again,
            self.report_error,
            say,
        )
        threading.Thread(
            target=self._guard.watch,
            args=(self._stop, self._member),
            name="rallypoint-ft-watch",
            daemon=True,
        ).start()
        self.last_heal: tuple[str, int, int, float] | None = None
        """``(source replica id, step, bytes, seconds)`` of this group's last heal."""

    # ------------------------------------------------------------------ set-up
    def _connect_lighthouse(self) -> KeyValueStore:
        return connect_lighthouse(self._lighthouse, self._connect_timeout.total_seconds())

    def _connect_again(self) -> KeyValueStore:
        return connect_lighthouse(self._lighthouse, 2.0)

    # ------------------------------------------------------------------ state dicts
    def register_state_dict_fn(
        self, key: str, load_state_dict: Callable[[Any], None], state_dict: Callable[[], Any]
    ) -> None:
        assert key not in self._fns, f"state dict function {key!r} already registered"
        self._fns[key] = (load_state_dict, state_dict)

    def set_state_dict_fns(
        self, load_state_dict: Callable[[Any], None], state_dict: Callable[[], Any]
    ) -> None:
        self.register_state_dict_fn("set_state_dict_fns", load_state_dict, state_dict)

    def _manager_state_dict(self) -> dict[str, Any]:
        """The state a healing group gets (read only while reads are allowed)."""
        with self._state_lock.r_lock():
            return self._own_state()

    def _own_state(self) -> dict[str, Any]:
        return {
            "user": {key: fns[1]() for key, fns in self._fns.items()},
            "torchft": self.state_dict(),
        }

    def state_dict(self) -> dict[str, int]:
        return {"step": self._step, "batches_committed": self._batches_committed}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self._step = int(state_dict["step"])
        self._batches_committed = int(state_dict["batches_committed"])

    def allow_state_dict_read(self) -> None:
        """Let a healing group read this group's state again."""
        if not self._reads_allowed:
            self._reads_allowed = True
            self._state_lock.w_release()

    def disallow_state_dict_read(self) -> None:
        """Keep healing groups from reading the state (it is being changed, as in the
        middle of a local SGD sync); waits for a read under way, up to ``timeout``."""
        if self._reads_allowed:
            self._state_lock.w_acquire()
            self._reads_allowed = False

    # ------------------------------------------------------------------ the quorum
    def start_quorum(
        self, allow_heal: bool = True, shrink_only: bool = False, timeout: timedelta | None = None
    ) -> None:
        """Ask for this step's quorum (in the background unless ``use_async_quorum`` is off)."""
        if self._future is not None:
            self._future.result()
        self._errored = None
        self._healing = False
        seq, self._quorum_seq = self._quorum_seq, self._quorum_seq + 1
        wait = (timeout or self._quorum_timeout).total_seconds()
        self._future = self._background.submit(
            self._async_quorum, seq, allow_heal, shrink_only, wait
        )
        if not self._use_async_quorum:
            self.wait_quorum()
            if self._healing:
                self._apply_pending()

    def wait_quorum(self) -> None:
        assert self._future is not None, "start_quorum() must be called first"
        self._future.result()

    def _async_quorum(self, seq: int, allow_heal: bool, shrink_only: bool, wait: float) -> None:
        if self._client is not None:
            until_ready(self._group, self._member, seq, self._world_size, wait, self._replica_id)
            group = (self._group, self._world_size, self._rank, self._heal_addr)
            addrs = heal_addresses(*group, self._connect_timeout, wait, self._replica_id)
            req = Request(
                self._member,
                self._replica_id,
                self._step,
                self._world_size,
                addrs,
                self._commit_failures,
                shrink_only,
                secret=self._advertised_secret,
            )
            quorum = ask(self._client, req, wait, self._quorum_retries, self._replica_id)
            if self._world_size > 1:  # the group's other ranks read it there
                self._group.set(f"quorum/{seq}", quorum.to_bytes())
                if seq >= 2:  # every rank has read it: the group store stays the same size
                    self._group.delete_key(f"quorum/{seq - 2}")
        else:
            count_in(self._group, self._member, seq, self._world_size)
            self._group.wait([f"quorum/{seq}"], timedelta(seconds=wait))
            quorum = Quorum.from_bytes(bytes(self._group.get(f"quorum/{seq}")), f"quorum/{seq}")
        done = plan(
            quorum,
            self._member,
            self._rank,
            self._init_sync,
            not self._use_async_quorum and allow_heal,
        )
        if self._world_size_mode is WorldSizeMode.FIXED_WITH_SPARES:
            done = spares_left_out(done, self._min_replica_size)
        self._plan = done
        if self._client is not None:
            self._events.quorum(quorum, done.heal)
        try:
            self._configure(quorum, done)
        except Exception as exc:  # the process group could not be made: this step fails
            self.report_error(exc)
            if allow_heal:  # a healer whose own group was made before the abort fetches
                self._serve(done)  # this round's state all the same: it is unchanged
            return
        if allow_heal:
            self._serve_or_heal(done)

    def _configure(self, quorum: Quorum, done: Plan) -> None:
        store = f"{self._lighthouse}#ft/pg/{quorum.gen}/{quorum.quorum_id}/{self._rank}"
        size = len(quorum.members)
        ranks = [i * self._world_size + self._rank for i in range(size)]
        args = (store, self._replica_id, done.replica_rank, size, quorum.quorum_id, self._rank)
        made = self._guard.configure(
            (quorum.gen, quorum.quorum_id),
            done,
            lambda: self._pg.configure(*args, self._world_size, ranks),
        )
        # a member of the last group left after this step began: that group is gone and
        # this step runs on the new one (else it fails for nothing, and its peers wait out
        # the timeout in a collective this member never joins)
        error = self._errored
        if made and error is not None and error.original_exception is self._guard.left:
            self._errored = None

    def _serve(self, done: Plan) -> None:
        """Offer this group's state to the groups that heal from it, over the transport."""
        if not done.serves:
            return
        try:
            if self._transport is self._heal:  # read only when a healer asks for it
                self._heal.allow(done.max_step, self._manager_state_dict)
            else:
                state, to = self._manager_state_dict(), list(done.dst_ranks)
                self._transport.send_checkpoint(to, done.max_step, state, self._timeout)
        except Exception as exc:  # the healer is gone, say: its heal fails, not this step
            say(f"group {self._replica_id} could not send its state ({exc})")

    def _serve_or_heal(self, done: Plan) -> None:
        self._serve(done)
        if not done.heal:
            return
        self._healing = True
        began = time.monotonic()
        try:
            state, size = self._receive(done)
        except Exception as exc:  # the source died while it sent, say: this step fails
            self.report_error(exc)
            if self._rank == 0:
                say(
                    f"group {self._replica_id} could not heal from group "
                    f"{done.source_replica} at step {done.max_step} ({exc}); it asks again"
                )
            return
        problem = mismatch(self._own_state()["user"], state["user"])
        if problem:
            self._incompatible = IncompatibleStateError(
                f"the state of group {done.source_replica} does not fit this group's "
                f"({problem}): every replica group must train the same model"
            )
            self.report_error(self._incompatible)
            return
        self._pending = state
        self.load_state_dict(state["torchft"])
        self.last_heal = (done.source_replica, done.max_step, size, time.monotonic() - began)
        self._events.heal(*self.last_heal)
        if self._rank == 0:
            say(
                f"group {self._replica_id} healed from group {done.source_replica} at step "
                f"{done.max_step} ({size / 1e6:.1f} MB in {time.monotonic() - began:.2f} s)"
            )

    def _receive(self, done: Plan) -> tuple[Any, int]:
        """The source's state and its tensors' bytes, over the transport."""
        timeout = self._timeout
        if self._transport is self._heal:
            key = done.source_secret.encode() if done.source_secret else self._secret
            return fetch_state(done.source_addr, key, done.max_step, timeout.total_seconds())
        assert done.source_rank is not None
        state = self._transport.recv_checkpoint(
            done.source_rank, done.source_addr, done.max_step, timeout
        )
        if not (isinstance(state, dict) and "user" in state and "torchft" in state):
            raise HealError(f"the transport's state from group {done.source_replica} is not a heal")
        return state, tensor_bytes(state)

    def _apply_pending(self) -> None:
        pending, self._pending = self._pending, None
        if pending is None:  # applied already (at the quorum, in sync mode), or it failed
            return
        source = self._plan.source_replica if self._plan is not None else "?"
        for key, (load, _) in self._fns.items():
            try:
                load(pending["user"][key])
            except (RuntimeError, ValueError, KeyError, TypeError) as exc:
                raise HealError(
                    f"the state healed from group {source} does not fit this group's "
                    f"({key!r}: {type(exc).__name__}: {str(exc)[:300]}): every replica group "
                    "must train the same model"
                ) from exc

    # ------------------------------------------------------------------ collectives
    def allreduce(
        self, tensor: torch.Tensor, should_quantize: bool = False, reduce_op: Any = None
    ) -> Any:
        """Sum ``tensor`` over the quorum (in place; AVG divides by the participants)."""
        if should_quantize and triton_present():
            raise ValueError(
                "should_quantize: rallypoint.ft does not quantize its allreduces (torchft "
                "does where triton is present); pass should_quantize=False"
            )
        op = dist.ReduceOp.AVG if reduce_op is None else reduce_op
        self.wait_quorum()
        if self._incompatible is not None:  # before a collective that would not match
            raise self._incompatible
        if self._errored is not None:
            return DummyWork(tensor)
        self.wait_quorum()
        n = self.num_participants()
        if not self.is_participating():
            tensor.zero_()
        if op == dist.ReduceOp.AVG and not tensor.is_floating_point():
            raise ValueError("average reduce op is only supported for floating point tensors")
        try:
            work = self._pg.allreduce(
                [tensor], dist.ReduceOp.SUM if op == dist.ReduceOp.AVG else op
            )
        except Exception as exc:  # the group was aborted, say: this step fails
            self.report_error(exc)
            return DummyWork(tensor)
        divide = n if op == dist.ReduceOp.AVG else None
        return ManagedWork(self, work, tensor, divide, self._guard.ending)

    def wrap_future(self, fut: Any, default: T, timeout: timedelta | None = None) -> Any:
        """``fut``, whose failure (or a wait past ``timeout``, the manager's by default) is
        recorded on this manager and replaced by ``default``."""
        seconds = (timeout or self._timeout).total_seconds()
        return wrap_future(self, with_timeout(fut, seconds), default)

    # ------------------------------------------------------------------ the commit
    def should_commit(self, timeout: timedelta | None = None) -> bool:
        """Whether this step commits: on every member of the quorum, or on none."""
        if self._future is not None:
            with contextlib.suppress(Exception):
                self.wait_quorum()
        error = self._pg.errored() if hasattr(self._pg, "errored") else None
        if error is not None:
            self.report_error(error)
        if self._healing:
            self._apply_pending()
        done = self._plan
        enough = self.num_participants() >= self._min_replica_size
        if not enough and self._rank == 0 and self._said_below != self.num_participants():
            say(
                f"group {self._replica_id}: {self.num_participants()} replica group(s) take "
                f"part, below min_replica_size {self._min_replica_size}: waiting, not "
                "training alone"
            )
        self._said_below = None if enough else self.num_participants()
        ok_here = enough and self._errored is None
        counted = done is not None and self._member in done.participants  # spares too
        vote = COMMIT if ok_here else (ABORT if counted else SIT)
        wait = (timeout or self._timeout).total_seconds()
        decided = self._decide(vote, done, wait)
        self._transport.disallow_checkpoint()
        if self._transport is not self._heal:
            self._heal.disallow()
        if decided:
            self._step += 1
            self._heal.passed(self._step)
            self._batches_committed += self.num_participants()
            self._commit_failures = 0
            return True
        self._commit_failures += 1
        if self._max_retries is not None and self._commit_failures > self._max_retries:
            raise RuntimeError(f"should_commit failed {self._commit_failures} times in a row")
        return False

    def _decide(self, vote: str, done: Plan | None, wait: float) -> bool:
        """This group's votes, then (rank 0) the quorum's: the answer for every rank."""
        seq, self._commit_seq = self._commit_seq, self._commit_seq + 1
        alone = self._world_size == 1  # a group of one rank has nobody to ask
        if not alone:
            self._group.set(f"vote/{seq}/{self._rank}", vote)
        if self._rank != 0:
            self._group.wait([f"commit/{seq}"], timedelta(seconds=wait))
            return bytes(self._group.get(f"commit/{seq}")) == b"1"
        assert self._client is not None
        keys = [f"vote/{seq}/{r}" for r in range(self._world_size)]
        outcome = False
        try:
            if not alone:
                self._group.wait(keys, timedelta(seconds=wait))
            votes = [vote] if alone else [bytes(self._group.get(k)).decode() for k in keys]
            mine = ABORT if ABORT in votes else (SIT if SIT in votes else COMMIT)
            if done is not None:
                outcome = agree(
                    self._client.kv,
                    done.round,
                    self._member,
                    mine,
                    len(done.participants),
                    self._member in done.participants,
                    wait,
                )
        except Exception as exc:  # the lighthouse or the group store away: no commit
            self.report_error(exc)
        if alone:
            return outcome
        self._group.set(f"commit/{seq}", b"1" if outcome else b"0")
        if seq >= 2:  # every rank has read them: the group store stays the same size
            for key in [
                f"commit/{seq - 2}",
                *(f"vote/{seq - 2}/{r}" for r in range(self._world_size)),
            ]:
                self._group.delete_key(key)
        return outcome

    # ------------------------------------------------------------------ errors, state
    def report_error(self, e: Exception) -> None:
        self._errored = ExceptionWithTraceback(e)

    def errored(self) -> ExceptionWithTraceback | None:
        return self._errored

    def current_step(self) -> int:
        return self._step

    def batches_committed(self) -> int:
        return self._batches_committed

    def num_participants(self) -> int:
        if self._future is None:
            return 0
        with contextlib.suppress(Exception):
            self.wait_quorum()
        return self._plan.participating_size if self._plan is not None else 0

    def participating_rank(self) -> int | None:
        if self._future is None:
            return None
        with contextlib.suppress(Exception):
            self.wait_quorum()
        return None if self._plan is None else self._plan.participating_rank

    def is_participating(self) -> bool:
        if self._plan is None or self._plan.participating_rank is None:
            return False
        return not (self._healing and self._use_async_quorum)

    def shutdown(self, wait: bool = True) -> None:
        """Leave: the others are told at once, and nothing of this manager keeps running."""
        self._stop.set()
        if self._client is not None:
            self._client.close("shut down")
        self._heal.close()
        if self._transport is not self._heal:
            self._transport.shutdown(wait=wait)
        if wait and self._future is not None:
            with contextlib.suppress(Exception):
                self._future.result()
        self._background.close()
        self._events.close()
