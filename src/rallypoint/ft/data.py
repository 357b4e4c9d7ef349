"""``DistributedSampler``: torch's sampler over every rank of every replica group."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch.utils.data import Dataset
from torch.utils.data.distributed import DistributedSampler as _TorchSampler

__all__ = ["DistributedSampler"]


class DistributedSampler(_TorchSampler):  # type: ignore[type-arg]
    """torchft's ``DistributedSampler(dataset, replica_rank, num_replica_groups,
    group_rank=None, num_replicas=None, **kwargs)``: this rank's shard of ``dataset``,
    the global rank being ``group_rank + num_replicas * replica_rank``."""

    def __init__(
        self,
        dataset: Dataset[Any],
        replica_rank: int,
        num_replica_groups: int,
        group_rank: int | None = None,
        num_replicas: int | None = None,
        **kwargs: Any,
    ) -> None:
        for name, value in (
            ("replica_rank", replica_rank),
            ("num_replica_groups", num_replica_groups),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if replica_rank >= num_replica_groups:
            raise ValueError(
                f"replica_rank {replica_rank} must be below num_replica_groups {num_replica_groups}"
            )
        group_rank = dist.get_rank() if group_rank is None else group_rank
        num_replicas = dist.get_world_size() if num_replicas is None else num_replicas
        self.global_rank = group_rank + num_replicas * replica_rank
        self.global_world_size = num_replicas * num_replica_groups
        super().__init__(
            dataset, num_replicas=self.global_world_size, rank=self.global_rank, **kwargs
        )
