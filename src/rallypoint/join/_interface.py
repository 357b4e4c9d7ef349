"""What a joinable is, and how it reaches the :class:`~rallypoint.join.Join` it is in.

torch's contract: a joinable (``DistributedDataParallel``, ``ZeroRedundancyOptimizer``,
:class:`~rallypoint.join.CollectiveJoinable`, a user's class) has ``join_hook``,
``join_device``, ``join_process_group`` and a ``_join_config`` that the context manager
sets, and calls :func:`notify_join_context` before each iteration's collectives.

This module sits below both the context manager (``_join.py``) and the ready-made
joinables (``_collective.py``): it also keeps the registry that maps a joinable to the
failure channel of the ``Join`` it is in, so their waits can be interrupted when another
rank fails.
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Joinable as _TorchJoinable
from torch.distributed.algorithms.join import JoinHook as _TorchJoinHook
from torch.futures import Future

from rallypoint.join._errors import EarlyTerminationError
from rallypoint.join._failure import FailureChannel, wait_work

__all__ = [
    "THROW_MESSAGE",
    "JoinHook",
    "Joinable",
    "SupportsJoin",
    "channel_for",
    "notify_join_context",
    "register_channel",
    "unregister_channel",
]

THROW_MESSAGE = "Detected at least one rank that exhausted inputs. Throwing across all ranks."

# id(joinable) -> (the joinable, or a weak reference to it; the failure channel of the Join
# it is in), for notify_join_context and CollectiveJoinable's interruptible waits
_channels: dict[int, tuple[Any, FailureChannel]] = {}


def register_channel(joinable: object, channel: FailureChannel) -> None:
    try:
        ref: Any = weakref.ref(joinable)
    except TypeError:  # no weak references (__slots__): keep it alive while registered
        ref = lambda: joinable  # noqa: E731
    _channels[id(joinable)] = (ref, channel)


def unregister_channel(joinable: object, channel: FailureChannel) -> None:
    entry = _channels.get(id(joinable))
    if entry is not None and entry[1] is channel:
        del _channels[id(joinable)]


def channel_for(joinable: object) -> FailureChannel | None:
    """The failure channel of the Join context ``joinable`` is in, if any."""
    entry = _channels.get(id(joinable))
    if entry is None or entry[0]() is not joinable:
        return None
    return entry[1]


class JoinHook(_TorchJoinHook):
    """The two entry points a joinable gives the join context manager.

    ``main_hook()`` runs once per iteration on a rank that has joined while some rank has
    not, to shadow that iteration's collectives; ``post_hook(is_last_joiner)`` runs once
    after every rank has joined. Both default to doing nothing. A subclass of torch's
    ``JoinHook``, so hooks written for either work with either ``Join``.
    """

    def main_hook(self) -> None:
        """Shadow the collectives of one training iteration of a rank that has not joined."""

    def post_hook(self, is_last_joiner: bool) -> None:
        """Run once all ranks have joined; ``is_last_joiner`` is ``True`` on the rank(s)
        that joined last (the ones that never shadowed an iteration)."""


class Joinable(_TorchJoinable):
    """Base class for objects that take part in a :class:`Join`.

    Subclasses call ``super().__init__()`` (which sets the ``_join_config`` the context
    manager reads), implement :meth:`join_hook`, :attr:`join_device` and
    :attr:`join_process_group`, and call :meth:`Join.notify_join_context` before each
    iteration's collectives. A subclass of torch's ``Joinable``: it also works in torch's
    ``Join``.
    """

    def __init__(self) -> None:
        super().__init__()


class SupportsJoin(Protocol):
    """What :class:`Join` needs from a joinable (torch's DDP and ZeRO qualify)."""

    def join_hook(self, **kwargs: Any) -> Any: ...

    @property
    def join_device(self) -> Any: ...

    @property
    def join_process_group(self) -> Any: ...


def notify_join_context(joinable: SupportsJoin) -> Future[list[torch.Tensor]] | None:
    """:meth:`Join.notify_join_context <rallypoint.join.Join.notify_join_context>`."""
    config = getattr(joinable, "_join_config", None)
    if config is None:
        raise TypeError(
            f"Check that the {type(joinable)} constructor calls the ``Joinable`` "
            "constructor (super().__init__() or Joinable.__init__(self))"
        )
    if not config.is_first_joinable or not config.enable:
        return None
    device = joinable.join_device
    group = joinable.join_process_group
    ones = torch.ones(1, device=device)
    work = dist.all_reduce(ones, group=group, async_op=True)
    if config.throw_on_early_termination:
        zeros = torch.zeros(1, device=device)
        channel = channel_for(joinable) if zeros.device.type == "cpu" else None
        wait_work(dist.all_reduce(zeros, group=group, async_op=True), channel)
        if zeros.item():
            raise EarlyTerminationError(THROW_MESSAGE)
    future: Future[list[torch.Tensor]] = work.get_future()
    return future
