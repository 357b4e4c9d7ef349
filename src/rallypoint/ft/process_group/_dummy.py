"""A c10d process group of one rank, for DDP inside a replica group (the Manager averages
across the groups)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from rallypoint._core.torch_c import HashStore

__all__ = ["dummy_process_group"]


def dummy_process_group() -> Any:
    """A c10d process group of one rank: it absorbs DDP's own broadcasts (the Manager
    averages the gradients across the replica groups)."""
    store = HashStore()
    pg = dist.ProcessGroup(store, 0, 1)
    backend = dist.ProcessGroupGloo(store, 0, 1, timedelta(seconds=60))
    pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    if torch.cuda.is_available():
        pg._register_backend(torch.device("cuda"), dist.ProcessGroup.BackendType.GLOO, backend)
    return pg
