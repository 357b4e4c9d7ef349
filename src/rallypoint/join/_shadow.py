"""After a failure: every rank stops at the same join-mode iteration.

Two pieces of the protocol of :mod:`rallypoint.join._failure`.
:class:`GatedJoinConfig` is the ``_join_config`` that :class:`~rallypoint.join.Join`
gives its joinables: reading its ``is_first_joinable`` is where a rank enters a new
iteration, so the check works for any joinable, torch's included.
:func:`shadow_iterations` runs on a rank that raised inside the body: it issues what a
joined rank issues for the iterations the others entered and this rank never did, so
that their collectives complete.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import _JoinConfig

from rallypoint.join._failure import FailureChannel

__all__ = ["GatedJoinConfig", "shadow_iterations"]

logger = logging.getLogger("rallypoint.join")


class GatedJoinConfig(_JoinConfig):
    """torch's ``_JoinConfig`` whose ``is_first_joinable`` read counts a join-mode iteration
    (see the module docstring); it pickles and copies as a plain ``_JoinConfig``."""

    _channel: FailureChannel

    @classmethod
    def make(
        cls, channel: FailureChannel, *, enable: bool, throw: bool, first: bool
    ) -> GatedJoinConfig:
        config = cls(enable=enable, throw_on_early_termination=throw, is_first_joinable=first)
        config._channel = channel
        return config

    @property  # overrides the NamedTuple field (read-only there too)
    def is_first_joinable(self) -> bool:
        enable: bool = tuple.__getitem__(self, 0)
        first: bool = tuple.__getitem__(self, 2)
        if first and enable:
            self._channel.enter_iteration()
        return first

    def __reduce__(self) -> tuple[Any, ...]:
        return (_JoinConfig, tuple(self))


def shadow_iterations(
    hooks: Sequence[Any],
    group: dist.ProcessGroup,
    device: torch.device,
    throw_on_early_termination: bool,
    count: int,
    timeout: float,
) -> None:
    """Shadow ``count`` iterations of the other ranks, as a joined rank does.

    Runs on a daemon thread, joined for at most ``timeout`` seconds: a hook that blocks
    (the others never issue what it matches) must not keep the failing rank's own
    exception from propagating. Stops early when every other rank has joined (the
    notify all-reduce gives 0).
    """
    if count <= 0:
        return
    grad_enabled = torch.is_grad_enabled()

    def run() -> None:
        try:
            with torch.set_grad_enabled(grad_enabled):
                for _ in range(count):
                    working = torch.zeros(1, device=device)
                    dist.all_reduce(working, group=group)  # matches the others' notify
                    if working.item() == 0:
                        return
                    if throw_on_early_termination:  # "no rank has run out"
                        dist.all_reduce(torch.zeros(1, device=device), group=group)
                    for hook in hooks:
                        hook.main_hook()
        except Exception:
            logger.debug("shadowing the failed rank's iterations stopped", exc_info=True)

    thread = threading.Thread(target=run, name="rallypoint-join-shadow", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        logger.warning(
            "the failed rank's shadow of %d iteration(s) did not finish within %.1f s; "
            "some ranks may stay blocked until the process group's timeout",
            count,
            timeout,
        )
