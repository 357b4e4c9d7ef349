"""A ready-made joinable for a training loop's own collectives (metrics, loss averaging).

Without it, a custom ``all_reduce`` inside a :class:`~rallypoint.join.Join` context hangs as
soon as one rank joins, unless the user writes a ``JoinHook`` that issues the same
collective on the joined ranks. :class:`CollectiveJoinable` records the collectives of
each iteration (kind, shape, dtype, reduce op) and, once its rank has joined, replays them
with neutral inputs (zeros for a sum, ones for a product, the dtype's extremes for min and
max), so the ranks still working get the result of the working ranks only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from rallypoint._core.checks import check_int
from rallypoint.join._errors import JoinError
from rallypoint.join._failure import FailureChannel
from rallypoint.join._failure import wait_work as _wait_work
from rallypoint.join._interface import Joinable, JoinHook, channel_for, notify_join_context

__all__ = ["CollectiveJoinable"]

_R = dist.ReduceOp


@dataclass(frozen=True, slots=True)
class _Op:
    kind: str  # "all_reduce" | "broadcast"
    shape: tuple[int, ...]
    dtype: torch.dtype
    reduce_op: Any = None  # dist.ReduceOp.RedOpType for all_reduce
    src: int = -1  # group rank for broadcast


def _neutral(
    shape: tuple[int, ...], dtype: torch.dtype, op: Any, device: torch.device
) -> torch.Tensor:
    """The input that leaves an all-reduce's result unchanged."""
    if op == _R.SUM or op == _R.BOR or op == _R.BXOR:
        return torch.zeros(shape, dtype=dtype, device=device)
    if op == _R.PRODUCT:
        return torch.ones(shape, dtype=dtype, device=device)
    if op == _R.BAND:
        fill: Any = True if dtype == torch.bool else -1
        return torch.full(shape, fill, dtype=dtype, device=device)
    if op in (_R.MIN, _R.MAX):
        if dtype == torch.bool:
            fill = op == _R.MIN
        elif dtype.is_floating_point:
            fill = float("inf") if op == _R.MIN else float("-inf")
        else:
            info = torch.iinfo(dtype)
            fill = info.max if op == _R.MIN else info.min
        return torch.full(shape, fill, dtype=dtype, device=device)
    raise ValueError(
        f"CollectiveJoinable cannot shadow reduce op {op}: use SUM, PRODUCT, MIN, MAX, "
        "BAND, BOR or BXOR (for a mean, use CollectiveJoinable.average)"
    )


class _CollectiveJoinHook(JoinHook):
    def __init__(self, owner: CollectiveJoinable) -> None:
        self._owner = owner

    def main_hook(self) -> None:
        self._owner._shadow_iteration()


class CollectiveJoinable(Joinable):
    """Issue your own collectives through this object so that joined ranks shadow them.

    Each call to :meth:`all_reduce`, :meth:`broadcast` or :meth:`average` is one iteration,
    unless calls are grouped with ``with sync.iteration():`` (needed when one training
    iteration issues more than one collective through this object). Every iteration must
    issue the same sequence of collectives: a joined rank replays the last sequence it saw.

    Example::

        sync = CollectiveJoinable()
        with Join([model, sync]):
            for batch in loader:
                loss = model(batch).sum()
                loss.backward()
                opt.step()
                mean_loss = sync.average(loss.detach())  # over the ranks still working

    Arguments:
        process_group: the group of the collectives (``None``: the default group); it
            must be the group of the other joinables in the same Join.
        device: where the shadowing tensors are made (the device of your tensors).
    """

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(
                "process_group must be a torch.distributed.ProcessGroup or None, got "
                f"{type(process_group).__name__}"
            )
        try:
            self._device = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise TypeError(
                f"device must be a torch.device or a device string, got {device!r}"
            ) from exc
        self._group = process_group
        self._recording: list[_Op] | None = None
        self._pattern: list[_Op] | None = None

    # -- Joinable interface ------------------------------------------------------------

    def join_hook(self, **kwargs: Any) -> JoinHook:
        return _CollectiveJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        return self._device

    @property
    def join_process_group(self) -> dist.ProcessGroup | None:
        return self._group

    # -- user API ----------------------------------------------------------------------

    @contextlib.contextmanager
    def iteration(self) -> Iterator[None]:
        """Group the collectives of one training iteration (one notify, one replay)."""
        if self._recording is not None:
            raise RuntimeError("CollectiveJoinable.iteration() blocks cannot be nested")
        notify_join_context(self)
        self._recording = []
        try:
            yield
        finally:
            recorded, self._recording = self._recording, None
        self._pattern = recorded

    def all_reduce(self, tensor: torch.Tensor, op: Any = _R.SUM) -> torch.Tensor:
        """``dist.all_reduce(tensor, op)`` in place, over the ranks that have not joined."""
        self._check_tensor(tensor)
        _neutral((0,), tensor.dtype, op, self._device)  # rejects ops we cannot shadow
        record = _Op("all_reduce", tuple(tensor.shape), tensor.dtype, reduce_op=op)
        with self._one_op(record):
            work = dist.all_reduce(tensor, op=op, group=self._group, async_op=True)
            _wait_work(work, self._channel())
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """``dist.broadcast(tensor, src)`` in place; ``src`` (a rank of the group) must not
        have joined, or the others receive zeros."""
        self._check_tensor(tensor)
        world = dist.get_world_size(self._group)
        if not 0 <= check_int(src, "src") < world:
            raise ValueError(f"src must be a rank in [0, {world}), got {src!r}")
        record = _Op("broadcast", tuple(tensor.shape), tensor.dtype, src=src)
        with self._one_op(record):
            global_src = dist.get_global_rank(self._group, src) if self._group is not None else src
            work = dist.broadcast(tensor, src=global_src, group=self._group, async_op=True)
            _wait_work(work, self._channel())
        return tensor

    def average(self, tensor: torch.Tensor) -> torch.Tensor:
        """The mean of ``tensor`` over the ranks that have not joined (a new tensor).

        One all-reduce of ``tensor`` plus a count, so joined ranks do not drag the mean
        towards zero.
        """
        self._check_tensor(tensor)
        if not tensor.dtype.is_floating_point:
            raise TypeError(
                f"average() needs a floating point tensor, got {tensor.dtype}; "
                "convert it with .float()"
            )
        packed = torch.cat([tensor.detach().reshape(-1), tensor.new_ones(1)])
        self.all_reduce(packed)
        return (packed[:-1] / packed[-1]).reshape(tensor.shape)

    # -- internals ---------------------------------------------------------------------

    def _check_tensor(self, tensor: object) -> None:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
        if tensor.device.type != self._device.type:
            raise ValueError(
                f"tensor is on {tensor.device} but this CollectiveJoinable was made for "
                f"{self._device}; pass device={tensor.device.type!r} to CollectiveJoinable"
            )

    def _channel(self) -> FailureChannel | None:
        return channel_for(self) if self._device.type == "cpu" else None

    @contextlib.contextmanager
    def _one_op(self, record: _Op) -> Iterator[None]:
        if self._recording is not None:
            self._recording.append(record)
            yield
            return
        notify_join_context(self)
        yield
        self._pattern = [record]

    def _shadow_iteration(self) -> None:
        if self._pattern is None:
            raise JoinError(
                f"rank {dist.get_rank(self._group)} joined before finishing one iteration "
                "of CollectiveJoinable, so it does not know which collectives to shadow; "
                "give every rank at least one input"
            )
        channel = self._channel()
        for op in self._pattern:
            if op.kind == "all_reduce":
                tensor = _neutral(op.shape, op.dtype, op.reduce_op, self._device)
                work = dist.all_reduce(tensor, op=op.reduce_op, group=self._group, async_op=True)
            else:
                tensor = torch.zeros(op.shape, dtype=op.dtype, device=self._device)
                global_src = (
                    dist.get_global_rank(self._group, op.src) if self._group is not None else op.src
                )
                work = dist.broadcast(tensor, src=global_src, group=self._group, async_op=True)
            _wait_work(work, channel)
