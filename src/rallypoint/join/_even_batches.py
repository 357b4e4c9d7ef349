"""Even batches: give every rank the same number of batches instead of joining.

The alternative to :class:`~rallypoint.join.Join` that Accelerate calls ``even_batches``:
at the start of each epoch the ranks agree on a batch count (one all-reduce of their
``len(loader)``) and each rank either repeats batches from the start of its own loader up
to the longest rank's count (``mode="pad"``, every sample is seen, a few twice) or stops
at the shortest rank's count (``mode="truncate"``, some samples are skipped). No hooks, no
extra collectives per iteration; the price is duplicated or dropped samples.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sized
from typing import Generic, Literal, TypeVar

import torch
import torch.distributed as dist

__all__ = ["EvenBatches", "even_batches"]

_B = TypeVar("_B")
_MODES = ("pad", "truncate")


class EvenBatches(Generic[_B]):
    """An iterable over ``loader`` that yields the same number of batches on every rank.

    Made by :func:`even_batches`, which agrees on the count (one all-reduce on the process
    group); every later epoch (each ``iter()`` after the first) agrees again, so every rank
    must iterate it. ``len()`` is the agreed count and never communicates. ``padded`` is
    the number of repeated batches this rank yielded in the last epoch.
    """

    def __init__(
        self,
        loader: Iterable[_B],
        *,
        mode: Literal["pad", "truncate"],
        group: dist.ProcessGroup | None,
    ) -> None:
        self.loader = loader
        self.mode = mode
        self.group = group
        self.padded = 0
        self._fresh = True
        self._count = self._agree()

    def set_epoch(self, epoch: int) -> None:
        """Forward to the loader's ``DistributedSampler.set_epoch`` (if it has one)."""
        for holder in (
            self.loader,
            getattr(self.loader, "sampler", None),
            getattr(self.loader, "batch_sampler", None),
        ):
            setter = getattr(holder, "set_epoch", None)
            if callable(setter):
                setter(epoch)
                return

    def _agree(self) -> int:
        try:
            own = len(self.loader)  # type: ignore[arg-type]
        except TypeError as exc:
            raise TypeError(
                "even_batches needs a loader with len(); this one has none (an "
                "IterableDataset?): use rallypoint.join.Join instead"
            ) from exc
        backend = dist.get_backend(self.group)
        device = (
            torch.device("cuda", torch.cuda.current_device())
            if backend == "nccl"
            else torch.device("cpu")
        )
        value = torch.tensor(
            [own if self.mode == "pad" else -own], dtype=torch.int64, device=device
        )
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.group)
        agreed = int(value.item())
        count = agreed if self.mode == "pad" else -agreed
        if self.mode == "pad" and own == 0 and count > 0:
            raise ValueError(
                f"rank {dist.get_rank(self.group)} has no batches, so even_batches(mode='pad') "
                f"cannot repeat any to reach {count}; give every rank data or use "
                "mode='truncate'"
            )
        self._count = count
        return count

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[_B]:
        count = self._count if self._fresh else self._agree()
        self._fresh = False
        self.padded = 0
        produced = 0
        passes = 0
        while produced < count:
            before = produced
            for batch in self.loader:
                if produced >= count:
                    break
                if passes > 0:
                    self.padded += 1
                yield batch
                produced += 1
            if produced == before:
                raise RuntimeError(
                    f"the loader yielded no batches although len() said {len(self.loader)}"  # type: ignore[arg-type]
                )
            passes += 1


def even_batches(
    loader: Iterable[_B],
    *,
    mode: Literal["pad", "truncate"] = "pad",
    group: dist.ProcessGroup | None = None,
) -> EvenBatches[_B]:
    """Wrap ``loader`` (anything with ``len()``: a ``DataLoader`` with or without a
    ``DistributedSampler``, a list of batches) so that every rank yields as many batches
    as the longest rank (``mode="pad"``, repeating its own first batches) or the shortest
    (``mode="truncate"``). A collective: call it on every rank of ``group``.

    Example::

        for batch in even_batches(loader):      # no Join needed
            loss = ddp_model(batch).sum()
            loss.backward()
            opt.step()
    """
    if not isinstance(loader, Sized) or not isinstance(loader, Iterable):
        raise TypeError(
            f"even_batches needs an iterable with len() (a DataLoader over a map-style "
            f"dataset, a list), got {type(loader).__name__}; for iterable datasets use "
            "rallypoint.join.Join instead"
        )
    if mode not in _MODES:
        raise ValueError(f"mode must be 'pad' or 'truncate', got {mode!r}")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"group must be a torch.distributed.ProcessGroup or None, got {type(group).__name__}"
        )
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "even_batches needs an initialized process group: call "
            "torch.distributed.init_process_group() first"
        )
    return EvenBatches(loader, mode=mode, group=group)
