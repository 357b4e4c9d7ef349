"""Deferred join mode: DDP runs as outside a Join until some rank actually runs out.

In torch's join mode, ``DistributedDataParallel`` issues two 1-element all-reduces per
forward so that a joined rank can shadow it, on every step of every rank, although they
are needed only once a rank has joined. Here the joinables stay out of join mode and the
switch is agreed through the process group's store, off the critical path: every rank
agrees on the same forward from which join mode starts, and a joined rank first shadows
the forwards it missed before it, so every collective is matched in order and the result
equals torch's join mode. The protocol, and when it applies: :class:`DeferredJoinMode`.
"""

from __future__ import annotations

import enum
import re
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from rallypoint.join._errors import JoinError, RankFailedError
from rallypoint.join._failure import FailureChannel

__all__ = ["DeferredJoinMode", "deferred_join_mode_blocker"]

_RUN = re.compile(r"([SGN])(\d+)")


class _Record(enum.Enum):
    """Why a rank publishes its forward count (the value's first field in the store)."""

    PROPOSAL = "p"
    """Another rank joined: this one says how far it got."""
    JOINED = "j"
    """This rank ran out of inputs."""


def deferred_join_mode_blocker(joinables: Sequence[Any], others_ok: type | tuple[type, ...]) -> str:
    """Why deferred join mode cannot be used for ``joinables`` ("" when it can).

    ``others_ok`` are the joinable types (besides ZeRO) allowed after the first DDP.
    Call after every ``join_hook(**kwargs)`` ran (DDP's sets its divisor mode).
    """
    first = joinables[0]
    if not isinstance(first, DistributedDataParallel):
        return "the first joinable is not a DistributedDataParallel"
    if not getattr(first, "_divide_by_initial_world_size", True):
        return "divide_by_initial_world_size=False needs the per-step count of working ranks"
    if first._use_python_reducer or first._delay_all_reduce_all_params or first.static_graph:
        return "DDP runs with the Python reducer, delayed all-reduce or a static graph"
    if first.forward_sync_buffers and any(True for _ in first.module.buffers()):
        return "DDP broadcasts buffers in every forward"
    for joinable in joinables[1:]:
        if not isinstance(joinable, (ZeroRedundancyOptimizer, *_as_tuple(others_ok))):
            return f"joinable {type(joinable).__name__} may depend on join mode"
    return ""


def _as_tuple(kinds: type | tuple[type, ...]) -> tuple[type, ...]:
    return kinds if isinstance(kinds, tuple) else (kinds,)


def _decode_runs(text: str) -> list[str]:
    return [flag for flag, count in _RUN.findall(text) for _ in range(int(count))]


class _Runs:
    """The per-forward flags of one rank, run-length encoded as they are appended."""

    __slots__ = ("_runs",)

    def __init__(self) -> None:
        self._runs: list[list[Any]] = []

    def append(self, flag: str) -> None:
        if self._runs and self._runs[-1][0] == flag:
            self._runs[-1][1] += 1
        else:
            self._runs.append([flag, 1])

    def encode(self) -> str:
        return "".join(f"{flag}{count}" for flag, count in self._runs)


class DeferredJoinMode:
    """One Join context's deferred join mode on one rank.

    1. every rank counts its DDP forwards (a forward pre-hook) and records per forward what
       DDP will all-reduce in its backward (``S``: gradients, ``G``: nothing but bucket
       rebuild, ``N``: no grad) in a run-length string;
    2. a rank that runs out of inputs publishes a record ``j:<forwards>`` and sets the
       ``joined`` key; every other rank has a daemon thread that polls ``joined`` every
       ``poll_interval`` and then publishes ``p:<forwards started so far>`` (under a lock
       shared with the pre-hook, so no forward starts in between). A rank whose record is
       published blocks before its next forward until every rank has one;
    3. every rank computes the same switch point ``S = max(records)``: forwards ``< S`` run
       out of join mode, forwards ``>= S`` in torch's join mode. The rank with the largest
       record has run every forward ``< S``, so its run-length string says what each of
       them all-reduces;
    4. a joined rank first shadows its missing forwards ``< S`` the way a non-joined DDP
       issues them (bucket all-reduces only), then enters the usual join loop, whose first
       all-reduce matches the notify of forward ``S``.

    It applies (:func:`deferred_join_mode_blocker` says why not) when the first joinable is
    a ``DistributedDataParallel`` that divides by the initial world size, without
    per-forward buffer broadcasts, static graph or the Python reducer, and the others are
    ``ZeroRedundancyOptimizer`` or :class:`~rallypoint.join.CollectiveJoinable`, on CPU
    (gloo); otherwise :class:`~rallypoint.join.Join` uses join mode from the start.

    Arguments:
        ddp: the first joinable.
        channel: the Join's failure channel (its store and key prefix; waits raise
            :class:`RankFailedError` when another rank publishes a failure).
        prefix: a key prefix unique to this context entry, the same on every rank.
        enter_join_mode: turns every joinable's ``_join_config`` to join mode.
    """

    def __init__(
        self,
        ddp: DistributedDataParallel,
        channel: FailureChannel,
        prefix: str,
        world_size: int,
        enter_join_mode: Callable[[], None],
    ) -> None:
        self._ddp = ddp
        self._channel = channel
        self._store = channel.store
        self._prefix = prefix
        self._world_size = world_size
        self._enter_join_mode = enter_join_mode
        self._lock = threading.Lock()
        self._forwards = 0
        self._runs = _Runs()
        self._recorded = False
        self._in_join_mode = False
        self._switch: int | None = None
        self._longest = 0  # a rank whose record is the switch point
        self._stop = threading.Event()
        self._hook: Any = None
        self._thread = threading.Thread(
            target=self._watch, name="rallypoint-join-defer", daemon=True
        )

    # -- lifetime ----------------------------------------------------------------------

    def start(self) -> None:
        self._hook = self._ddp.register_forward_pre_hook(self._before_forward)
        self._thread.start()

    def stop(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=1.0)  # longer only if the store hangs; a daemon

    # -- the rank that has not joined --------------------------------------------------

    def _before_forward(self, module: Any, args: Any) -> None:
        if self._in_join_mode:
            return
        # a failed rank may have released this rank's last backward (release_others)
        self._channel.raise_if_failed()
        if torch.is_grad_enabled():
            flag = "S" if self._ddp.require_backward_grad_sync else "G"
        else:
            flag = "N"
        with self._lock:
            if not self._recorded:
                self._forwards += 1
                self._runs.append(flag)
                return
        switch = self.switch_point(None)
        if self._forwards < switch:
            self._forwards += 1  # a forward before the switch: out of join mode
            return
        self._in_join_mode = True
        self._enter_join_mode()

    def _watch(self) -> None:
        joined = f"{self._prefix}/joined"
        while not self._stop.wait(self._channel.poll_interval):
            try:
                if not self._store.check([joined]):
                    continue
            except Exception:
                continue  # store unreachable: the collectives' own timeout applies
            self._record(_Record.PROPOSAL)
            return

    def _record(self, kind: _Record) -> None:
        """Publish this rank's record once."""
        with self._lock:
            if self._recorded:
                return
            self._recorded = True
            rank = self._channel.rank
            self._store.set(f"{self._prefix}/runs/{rank}", self._runs.encode())
            self._store.set(f"{self._prefix}/record/{rank}", f"{kind.value}:{self._forwards}")
            if kind is _Record.JOINED:
                self._store.set(f"{self._prefix}/joined", "1")

    # -- the joined rank ---------------------------------------------------------------

    def finish(self, cancel: threading.Event) -> list[str]:
        """Called by a rank that ran out of inputs: publish its record, wait for the switch
        point and return the flags of the forwards it must shadow out of join mode."""
        self.stop()
        if self._in_join_mode:
            return []
        self._record(_Record.JOINED)
        switch = self.switch_point(cancel)
        if self._forwards >= switch:
            return []
        runs = self._store.get(f"{self._prefix}/runs/{self._longest}").decode()
        flags = _decode_runs(runs)
        return flags[self._forwards : switch]

    def shadow(self, flag: str, hooks: Sequence[Any]) -> None:
        """Match one forward that the others ran out of join mode (``hooks[0]`` is DDP's)."""
        ddp: Any = self._ddp  # DDP's join helpers are untyped
        if flag != "N":  # DDP rebuilds its buckets in a forward with grad enabled
            ddp.reducer._rebuild_buckets()
        sync = flag == "S"
        ddp.require_forward_param_sync = sync
        if sync:
            ddp._match_all_reduce_for_bwd_pass()
            if ddp.find_unused_parameters:
                ddp._match_unused_params_allreduce()
            ddp.reducer._push_all_rebuilt_params()
        for hook in hooks[1:]:
            hook.main_hook()

    # -- the rank that failed ----------------------------------------------------------

    @property
    def in_join_mode(self) -> bool:
        """Whether this rank's forwards have reached the switch point."""
        return self._in_join_mode

    def others_switched(self, timeout: float) -> bool:
        """Called on a rank that raised out of join mode: whether the others' next forward
        is in join mode all the same (every rank recorded, and this rank had run every
        forward before the switch point).

        Stops this rank's watcher first, so that it records nothing after its failure:
        without its record the switch never happens. If it had recorded, the others
        record within ``poll_interval``; the switch point is awaited at most ``timeout``.
        """
        self.stop()
        with self._lock:
            recorded = self._recorded
        if not recorded:
            return False
        try:
            switch = self.switch_point(None, timeout=timeout)
        except JoinError:  # a rank never recorded (RankFailedError included)
            return False
        return self._forwards >= switch

    def release_others(self) -> None:
        """Called on a rank that raised inside the context, once every other rank has
        acknowledged its failure: complete the gradient all-reduces the others wait for in
        their backward.

        Out of join mode the others are at most one backward ahead of this rank, blocked
        in DDP's bucket all-reduces, which gloo cannot abort. Once every other rank has
        seen the failure (so its next forward raises), this rank issues one iteration of
        zero buckets, without waiting for them: the others' backward returns, and they
        raise :class:`RankFailedError` before their next forward (or at the end of the
        context). Gradients of that last step are garbage, but the job is failing anyway.
        """
        if self._in_join_mode:
            return
        ddp: Any = self._ddp
        try:
            for bucket in ddp.reducer._get_zeros_like_grad_buckets():
                ddp.reducer._run_comm_hook(bucket)  # not waited for: nobody may answer
            if ddp.find_unused_parameters:
                ddp.process_group.allreduce(ddp.reducer._get_local_used_map())
        except Exception:  # the reducer may be mid-backward; the group's timeout remains
            pass

    # -- agreement ---------------------------------------------------------------------

    def switch_point(self, cancel: threading.Event | None, timeout: float | None = None) -> int:
        """The first forward in join mode, once every rank has published its record (within
        ``timeout`` seconds, by default the store's timeout)."""
        if self._switch is not None:
            return self._switch
        keys = [f"{self._prefix}/record/{r}" for r in range(self._world_size)]
        if timeout is None:
            timeout = self._store.timeout.total_seconds()
        deadline = time.monotonic() + timeout
        pause = 0.0005
        while not self._store.check(keys):
            self._channel.raise_if_failed()
            if cancel is not None and cancel.is_set():
                raise RankFailedError(-1, "join loop cancelled", self._channel.rank)
            if time.monotonic() > deadline:
                missing = [r for r, key in enumerate(keys) if not self._store.check([key])]
                raise JoinError(
                    f"rank(s) {missing} did not report their progress within {timeout:.0f} s "
                    "after a rank ran out of inputs; are they alive?"
                )
            time.sleep(pause)
            pause = min(pause * 2, self._channel.poll_interval / 4)
        records = [raw.decode().partition(":")[2] for raw in self._store.multi_get(keys)]
        counts = [int(value) for value in records]
        self._switch = max(counts)
        self._longest = counts.index(self._switch)
        return self._switch
