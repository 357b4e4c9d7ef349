"""Options of :class:`~rallypoint.join.Join` that torch's ``Join`` does not have."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from rallypoint._core.checks import check_int

__all__ = ["JoinOptions"]


@dataclass(kw_only=True, slots=True)
class JoinOptions:
    """Tuning for :class:`~rallypoint.join.Join`, passed as ``Join(..., join_options=...)``.

    Use the same options on every rank: ``summary`` adds a collective and
    ``detect_failures`` numbers the Join instances.

    Attributes:
        detect_failures: publish an exception raised inside the context to the other ranks
            and watch for theirs (see :mod:`rallypoint.join` docs). ``False`` behaves like
            torch: the other ranks wait for the process group's timeout.
        poll_interval: how often a waiting rank checks the store for a failed rank; the
            detection latency is at most about twice this.
        watch_body: while the ``with`` body runs, poll the store from a daemon thread
            every ``2 * poll_interval``: a rank blocked in a collective acknowledges another
            rank's failure through it (so that the failed rank shadows that collective),
            and it logs the failure (ERROR, logger ``rallypoint.join``).
        summary: after the context, all-reduce how many iterations each rank shadowed and
            expose it as ``Join.summary`` (one extra all-reduce of ``world_size`` floats).
        warn_threshold: warn (once per Join) when this rank has shadowed more than this
            many iterations, as torch does at 1,000.
        defer_join_mode: keep DDP out of join mode (no per-step notify all-reduces) until
            a rank actually runs out of inputs, and switch every rank at the same forward
            through the store (see ``docs/join.md``). Applies when the first joinable is a
            ``DistributedDataParallel`` (default divisor, no per-forward buffer broadcast)
            and the others are ZeRO or ``CollectiveJoinable``, on CPU, with
            ``detect_failures=True`` and no ``throw_on_early_termination``; otherwise, or
            with ``False``, join mode is on from the first step, as in torch.
    """

    detect_failures: bool = True
    poll_interval: timedelta = timedelta(milliseconds=100)
    watch_body: bool = True
    summary: bool = True
    warn_threshold: int = 1000
    defer_join_mode: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.poll_interval, timedelta):
            raise TypeError(
                "JoinOptions.poll_interval must be a datetime.timedelta, got "
                f"{type(self.poll_interval).__name__}; e.g. timedelta(milliseconds=100)"
            )
        seconds = self.poll_interval.total_seconds()
        if not 0.001 <= seconds <= 60:
            raise ValueError(
                f"JoinOptions.poll_interval must be between 1 ms and 60 s, got {seconds} s"
            )
        check_int(self.warn_threshold, "JoinOptions.warn_threshold", minimum=0)
        if not isinstance(self.defer_join_mode, bool):
            raise TypeError(
                f"JoinOptions.defer_join_mode must be a bool, got {self.defer_join_mode!r}"
            )
