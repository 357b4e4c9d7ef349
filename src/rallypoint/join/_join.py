"""The generic join context manager: torch's ``Join``/``Joinable``/``JoinHook`` semantics.

Compatible with ``torch.distributed.algorithms.join``: the same names, signatures,
collectives and messages, so torch's joinables (``DistributedDataParallel``,
``ZeroRedundancyOptimizer``, which call torch's static ``Join.notify_join_context``) work
inside this ``Join``. Both sides agree on two things only: the per-joinable
``_join_config`` that this ``Join`` sets on every joinable, and the collectives on the join
device and process group (per iteration, a rank not yet joined all-reduces ``ones(1)``,
which a joined rank's join loop matches with ``zeros(1)``). What this ``Join`` adds, all
of it additive (failure safety, deferred join mode, a skew summary, validation up front):
docs/join.md.
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import _JoinConfig
from torch.futures import Future

from rallypoint.join._collective import CollectiveJoinable
from rallypoint.join._deferred import DeferredJoinMode, deferred_join_mode_blocker
from rallypoint.join._errors import EarlyTerminationError, JoinError, RankFailedError
from rallypoint.join._failure import (
    BodyWatcher,
    FailureChannel,
    is_consequence,
    run_watched,
    wait_work,
)
from rallypoint.join._interface import (
    THROW_MESSAGE,
    SupportsJoin,
    notify_join_context,
    register_channel,
    unregister_channel,
)
from rallypoint.join._options import JoinOptions
from rallypoint.join._shadow import GatedJoinConfig, shadow_iterations
from rallypoint.observe import progress

__all__ = ["Join", "JoinSummary"]

logger = logging.getLogger("rallypoint.join")
_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class JoinSummary:
    """How uneven the inputs were, gathered after a :class:`Join` context.

    ``shadowed[r]`` is the number of iterations rank ``r`` spent shadowing others after
    running out of inputs (0 for the last joiners).
    """

    shadowed: tuple[int, ...]

    @property
    def max_skew(self) -> int:
        """The largest number of iterations any rank shadowed."""
        return max(self.shadowed)

    @property
    def last_joiners(self) -> tuple[int, ...]:
        """The ranks that never shadowed (``post_hook(is_last_joiner=True)``)."""
        return tuple(r for r, n in enumerate(self.shadowed) if n == 0)

    def __str__(self) -> str:
        return f"iterations shadowed per rank: {list(self.shadowed)} (max skew {self.max_skew})"


def _report_progress() -> None:
    """The one place where the join loop reports progress to the launcher.

    Called once per shadowed iteration, so that a rank shadowing a long skew is not
    mistaken for a hung one by ``--hang-timeout``. ``rallypoint.progress()`` is a few
    memory stores and does nothing outside a rallypoint launch.
    """
    progress()


def _check_interface(index: int, joinable: object) -> None:
    kind = type(joinable)
    missing = [
        name
        for name in ("join_hook", "join_device", "join_process_group")
        if not hasattr(kind, name)
    ]
    if missing:
        raise TypeError(
            f"joinables[{index}] ({kind.__name__}) is not a joinable: it lacks "
            f"{', '.join(missing)}; subclass rallypoint.join.Joinable (or torch's Joinable) "
            "and implement join_hook, join_device and join_process_group"
        )
    if not hasattr(joinable, "_join_config"):
        raise TypeError(
            f"Check that the {kind} constructor calls the ``Joinable`` constructor: "
            f"joinables[{index}] has no _join_config; add super().__init__() (or "
            "Joinable.__init__(self)) to its __init__"
        )


class Join:
    """Context manager that lets ranks with fewer inputs shadow the others' collectives.

    Same contract as ``torch.distributed.algorithms.join.Join``: every joinable calls
    :meth:`notify_join_context` before its per-iteration collectives; when a rank runs out
    of inputs, ``__exit__`` runs every joinable's main hook once per iteration of the
    ranks still working, then every post hook with ``is_last_joiner``.

    Arguments:
        joinables: the participating joinables (anything with ``join_hook``,
            ``join_device``, ``join_process_group`` and a ``_join_config`` set by
            ``Joinable.__init__``); hooks run in this order and the first one performs
            the notify collectives. All must use the same process group.
        enable: ``False`` turns the context manager into a no-op (even inputs only).
        throw_on_early_termination: raise on every rank as soon as one runs out.
        join_options: rallypoint's extra settings (:class:`JoinOptions`).
        kwargs: passed to every ``join_hook(**kwargs)``.
    """

    def __init__(
        self,
        joinables: Sequence[SupportsJoin],
        enable: bool = True,
        throw_on_early_termination: bool = False,
        *,
        join_options: JoinOptions | None = None,
        **kwargs: Any,
    ) -> None:
        if isinstance(joinables, (str, bytes)) or not isinstance(joinables, Sequence):
            raise TypeError(
                f"joinables must be a list of joinables, got {type(joinables).__name__}"
            )
        if len(joinables) == 0:
            raise ValueError("The join context manager requires at least one joinable")
        for name, flag in (
            ("enable", enable),
            ("throw_on_early_termination", throw_on_early_termination),
        ):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {flag!r}")
        if join_options is None:
            join_options = JoinOptions()
        elif not isinstance(join_options, JoinOptions):
            raise TypeError(
                f"join_options must be a rallypoint.join.JoinOptions, got "
                f"{type(join_options).__name__}"
            )
        for index, joinable in enumerate(joinables):
            _check_interface(index, joinable)
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "Join needs an initialized process group: call "
                "torch.distributed.init_process_group() first"
            )
        self._joinables: list[SupportsJoin] = list(joinables)
        self._enable = enable
        self._throw_on_early_termination = throw_on_early_termination
        self._options = join_options
        self._extract_dist_info()
        self._join_hooks: list[Any] = []
        for index, joinable in enumerate(self._joinables):
            hook = joinable.join_hook(**kwargs)
            if not (
                callable(getattr(hook, "main_hook", None))
                and callable(getattr(hook, "post_hook", None))
            ):
                raise TypeError(
                    f"joinables[{index}].join_hook() returned {type(hook).__name__}, which "
                    "lacks main_hook()/post_hook(); return a rallypoint.join.JoinHook"
                )
            self._join_hooks.append(hook)
        self._channel: FailureChannel | None = None
        if join_options.detect_failures and self._world_size > 1:
            self._channel = FailureChannel.for_group(
                self._process_group, self._rank, join_options.poll_interval
            )
        self._deferred_blocker = self._why_not_deferred()
        self._entries = 0
        self._deferred: DeferredJoinMode | None = None
        self._saved_configs: list[Any] | None = None
        self._iterate_state: list[int] | None = None  # [common length, yielded]
        self._entered = False
        self._watcher: BodyWatcher | None = None
        self._published = False
        self._warned = False
        self.summary: JoinSummary | None = None
        """Set after a context that ran to its end (``JoinOptions(summary=True)``)."""
        self._set_joinable_configs()

    # -- setup -------------------------------------------------------------------------

    def _extract_dist_info(self) -> None:
        default = dist.distributed_c10d._get_default_group()
        group: dist.ProcessGroup | None = None
        first = 0
        for index, joinable in enumerate(self._joinables):
            this = joinable.join_process_group
            this = default if this is None else this
            if group is None:
                group, first = this, index
            elif this != group:
                name = dist.distributed_c10d._get_process_group_name
                raise ValueError(
                    "Using join context manager with multiple process groups: "
                    f"joinables[{first}] uses {name(group)!r} "
                    f"and joinables[{index}] uses {name(this)!r}; put joinables "
                    "of different groups in separate Join contexts"
                )
        assert group is not None
        self._process_group: dist.ProcessGroup = group
        self._rank = dist.get_rank(group)
        self._world_size = dist.get_world_size(group)
        self._device = torch.device(self._joinables[0].join_device)

    def _why_not_deferred(self) -> str:
        """Why this context cannot defer join mode ("" when it can, see ``_deferred``)."""
        if not self._options.defer_join_mode:
            return "JoinOptions(defer_join_mode=False)"
        if not self._enable or self._throw_on_early_termination:
            return "enable=False or throw_on_early_termination=True"
        if self._channel is None:
            return "no failure channel (detect_failures=False, one rank, or no store)"
        if self._device.type != "cpu":
            return f"join device {self._device} (deferred join mode is validated on CPU/gloo)"
        return deferred_join_mode_blocker(self._joinables, CollectiveJoinable)

    def _set_joinable_configs(self) -> None:
        if self._saved_configs is not None:
            return
        self._saved_configs = [getattr(j, "_join_config") for j in self._joinables]  # noqa: B009
        self._apply_enable(self._enable)
        for joinable in self._joinables:
            if self._channel is not None:
                register_channel(joinable, self._channel)

    def _apply_enable(self, enable: bool) -> None:
        gated = self._channel if self._device.type == "cpu" else None
        throw = self._throw_on_early_termination
        for index, joinable in enumerate(self._joinables):
            first = index == 0
            config = (
                _JoinConfig(enable, throw, first)
                if gated is None
                else GatedJoinConfig.make(gated, enable=enable, throw=throw, first=first)
            )
            joinable._join_config = config  # type: ignore[attr-defined]

    def _in_join_mode(self) -> bool:
        return bool(getattr(self._joinables[0], "_join_config").enable)  # noqa: B009

    def _restore_joinable_configs(self) -> None:
        if self._saved_configs is None:
            return
        for joinable, saved in zip(self._joinables, self._saved_configs, strict=True):
            joinable._join_config = saved  # type: ignore[attr-defined]
            if self._channel is not None:
                unregister_channel(joinable, self._channel)
        self._saved_configs = None

    # -- context -----------------------------------------------------------------------

    def iterate(self, inputs: Iterable[_T]) -> Iterator[_T]:
        """Yield ``inputs``, with join mode on only for the iterations that need it.

        A collective (call it on every rank, inside the context): the ranks agree on the
        smallest ``len(inputs)``, ``m``; for the first ``m`` iterations no rank can have
        joined, so the joinables run as outside a Join (DDP skips its two per-step join
        all-reduces), and join mode is switched on from iteration ``m``. The loop must run
        to the end of ``inputs`` on a rank (or at least ``m`` iterations): leaving it
        earlier raises :class:`JoinError` at the end of the context, because the other
        ranks are not in join mode yet and cannot be shadowed.
        """
        if not self._entered:
            raise RuntimeError("Join.iterate() must be called inside the `with join:` block")
        if self._iterate_state is not None:
            raise RuntimeError("Join.iterate() can be called once per context")
        try:
            own = len(inputs)  # type: ignore[arg-type]
        except TypeError as exc:
            raise TypeError(
                f"Join.iterate() needs inputs with len(), got {type(inputs).__name__}; "
                "iterate them directly instead (join mode is then on from the start)"
            ) from exc
        if not self._enable:
            self._iterate_state = [0, 0]
            return iter(inputs)
        if self._deferred is not None:  # iterate() decides the switch itself
            self._deferred.stop()
            self._deferred = None
        counts = torch.tensor([own], dtype=torch.int64, device=self._device)
        channel = self._channel if self._device.type == "cpu" else None
        work = dist.all_reduce(
            counts, op=dist.ReduceOp.MIN, group=self._process_group, async_op=True
        )
        wait_work(work, channel)
        common = int(counts.item())
        self._iterate_state = [common, 0]
        if common > 0:
            self._apply_enable(False)
        return self._iterate(inputs, common)

    def _iterate(self, inputs: Iterable[_T], common: int) -> Iterator[_T]:
        state = self._iterate_state
        assert state is not None
        try:
            for item in inputs:
                if state[1] == common and common > 0:
                    self._apply_enable(True)
                yield item
                state[1] += 1
        finally:
            if self._entered:
                self._apply_enable(True)

    def __enter__(self) -> Join:
        self._set_joinable_configs()
        self._entered = True
        self._entries += 1
        if self._channel is not None:
            self._channel.begin()
        if not self._deferred_blocker and self._channel is not None:
            self._apply_enable(False)
            self._deferred = DeferredJoinMode(
                self._joinables[0],  # type: ignore[arg-type]
                self._channel,
                f"{self._channel.prefix}/defer/{self._entries}",
                self._world_size,
                lambda: self._apply_enable(True),
            )
            self._deferred.start()
        if self._channel is not None and self._options.watch_body and self._enable:
            self._watcher = BodyWatcher(self._channel)
            self._watcher.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        """Run the main hooks until every rank has joined, then the post hooks.

        Raises:
            EarlyTerminationError: with ``throw_on_early_termination=True``.
            RankFailedError: another rank raised inside its context.
        """
        if self._watcher is not None:
            self._watcher.stop()
            self._watcher = None
        deferred, self._deferred = self._deferred, None
        try:
            if exc is not None:
                self._on_body_error(exc, deferred)
                return
            if not self._enable:
                return
            self._apply_enable(True)
            state, self._iterate_state = self._iterate_state, None
            if state is not None and state[1] < state[0]:
                error = JoinError(
                    f"rank {self._rank} left Join.iterate() after {state[1]} inputs, before "
                    f"the {state[0]} that every rank has; the other ranks are not in join "
                    "mode yet and cannot be shadowed: iterate to the end of the inputs"
                )
                self._on_error(error)
                raise error
            channel = self._channel if self._device.type == "cpu" else None
            cancel = threading.Event()
            try:
                run_watched(lambda: self._join_loop(cancel, deferred), channel, cancel)
            except BaseException as error:  # Ctrl-C too: the other ranks hear of it
                self._on_error(error)
                raise
        finally:
            if deferred is not None:
                deferred.stop()
            self._entered = False
            self._iterate_state = None
            self._restore_joinable_configs()

    def _on_body_error(self, exc: BaseException, deferred: DeferredJoinMode | None) -> None:
        """The body raised: publish it and agree with the other ranks where to stop, then
        shadow their iterations up to there (or, out of join mode, release DDP's backward),
        so that no rank is left blocked in a collective this rank never issues. Raises
        RankFailedError when ``exc`` follows another rank's failure."""
        channel = self._channel
        if deferred is not None:
            deferred.stop()  # this rank records nothing after its failure
        try:
            self._on_error(exc, publish_only=False)
        except RankFailedError:
            # another rank failed first: this rank still shadows up to the stop point
            if channel is not None and self._others_in_join_mode(channel, deferred):
                self._shadow_up_to(channel, channel.stop_point())
            raise
        if channel is None or is_consequence(exc) or not self._published:
            return
        in_join_mode = self._others_in_join_mode(channel, deferred)
        stop = channel.agree_on_stop_point(self._world_size)
        if in_join_mode:
            self._shadow_up_to(channel, stop)
        elif deferred is not None:
            deferred.release_others()
        channel.mark_served()

    def _others_in_join_mode(
        self, channel: FailureChannel, deferred: DeferredJoinMode | None
    ) -> bool:
        """Whether the others' current iteration is in join mode (so the join hooks can
        shadow it); on CPU only, as the failure channel's waits."""
        if self._device.type != "cpu":
            return False
        if deferred is None or deferred.in_join_mode:
            return self._in_join_mode()
        # the others may have switched at the forward this rank did not run
        return deferred.others_switched(channel.agreement_timeout)

    def _shadow_up_to(self, channel: FailureChannel, stop: int) -> None:
        shadow_iterations(
            self._join_hooks,
            self._process_group,
            self._device,
            self._throw_on_early_termination,
            stop - channel.iterations,
            channel.agreement_timeout,
        )

    def _on_error(self, exc: BaseException, *, publish_only: bool = True) -> None:
        """Publish this rank's failure, or raise RankFailedError if ``exc`` follows
        another rank's (a collective that failed because the failed rank exited or timed
        out)."""
        self._published = False
        if type(exc) is RuntimeError and str(exc) == THROW_MESSAGE:
            # torch's notify_join_context (called by DDP/ZeRO) raises a plain RuntimeError
            raise EarlyTerminationError(THROW_MESSAGE) from exc
        if self._channel is None or is_consequence(exc):
            return
        found = self._channel.failure(force=True)
        if found is not None:  # this rank's error follows another rank's failure
            raise self._channel_error(found) from exc
        self._published = self._channel.publish(exc)
        if not self._published:  # another rank's failure was published first
            found = self._channel.failure(force=True)
            if found is not None:
                raise self._channel_error(found) from exc
        if publish_only and self._published:
            # an error outside the body (the join loop, iterate()): nothing to shadow
            self._channel.agree_on_stop_point(self._world_size)
            self._channel.mark_served()

    def _channel_error(self, found: tuple[int, str]) -> JoinError:
        return RankFailedError(found[0], found[1], self._rank)

    # -- the join loop -----------------------------------------------------------------

    def _join_loop(self, cancel: threading.Event, deferred: DeferredJoinMode | None) -> None:
        channel = self._channel if self._device.type == "cpu" else None
        shadowed = 0
        if deferred is not None:  # first the forwards the others ran out of join mode
            for flag in deferred.finish(cancel):
                if cancel.is_set():
                    raise RankFailedError(-1, "join loop cancelled", self._rank)
                deferred.shadow(flag, self._join_hooks)
                shadowed += 1
                self._after_shadowed(shadowed)
        while True:
            # after a failure, keep shadowing up to the agreed stop point (enter_iteration)
            # even though the calling thread has raised already: the others need it
            if cancel.is_set() and (channel is None or channel.failure() is None):
                raise RankFailedError(-1, "join loop cancelled", self._rank)
            if channel is not None:
                channel.enter_iteration()
            if self._get_num_nonjoined_procs(channel) == 0:
                break
            if self._throw_on_early_termination:
                self._notify_procs_to_terminate(channel)
            for hook in self._join_hooks:
                hook.main_hook()
            shadowed += 1
            self._after_shadowed(shadowed)
        if channel is not None:  # the failed rank's shadow ends the loop like a join
            channel.raise_if_failed(force=True)
        is_last_joiner = shadowed == 0
        if self._options.summary:
            counts = torch.zeros(self._world_size, device=self._device)
            counts[self._rank] = shadowed
            wait_work(dist.all_reduce(counts, group=self._process_group, async_op=True), channel)
            self.summary = JoinSummary(shadowed=tuple(int(n) for n in counts.tolist()))
            logger.info("Join finished on rank %d: %s", self._rank, self.summary)
        for hook in self._join_hooks:
            hook.post_hook(is_last_joiner)

    def _after_shadowed(self, shadowed: int) -> None:
        _report_progress()
        if shadowed > self._options.warn_threshold and not self._warned:
            self._warned = True
            threshold = self._options.warn_threshold
            warnings.warn(
                f"Detected uneven input skew of greater than {threshold}. This means "
                f"that rank {self._rank} has at least {threshold} fewer inputs than "
                "other currently-active ranks. This level of skew could lead to "
                "performance degradation during training.",
                stacklevel=3,
            )

    def _get_num_nonjoined_procs(self, channel: FailureChannel | None) -> int:
        zeros = torch.zeros(1, device=self._device)
        work = dist.all_reduce(zeros, group=self._process_group, async_op=True)
        wait_work(work, channel)
        return int(zeros.item())

    def _notify_procs_to_terminate(self, channel: FailureChannel | None) -> None:
        ones = torch.ones(1, device=self._device)
        wait_work(dist.all_reduce(ones, group=self._process_group, async_op=True), channel)
        raise EarlyTerminationError(f"Rank {self._rank} exhausted all inputs.")

    # -- the joinables' side -----------------------------------------------------------

    @staticmethod
    def notify_join_context(joinable: SupportsJoin) -> Future[list[torch.Tensor]] | None:
        """Tell the join context manager that this rank has not joined yet.

        Call it from a joinable before each iteration's collectives. Only the first
        joinable of the context performs the collective (an async all-reduce of
        ``ones(1)``); for the others, or outside a context, it returns ``None``. With
        ``throw_on_early_termination=True`` it also checks whether a rank has joined and
        raises :class:`EarlyTerminationError` if so.

        Returns:
            A ``torch.futures.Future`` whose value is ``[t]`` where ``t`` holds the number
            of ranks that have not joined (torch returns the ``Work`` handle instead;
            ``Future.wait()`` works the same), or ``None``.
        """
        return notify_join_context(joinable)
