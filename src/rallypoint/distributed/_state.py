"""Per-process state: what this package initialised, so that it can compare and tear down.

Kept in one place so that ``init_process_group``, the parallel groups and
``destroy_process_group`` agree; nothing here touches torch at import time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rallypoint.distributed._config import DistributedConfig
    from rallypoint.distributed._mesh import ParallelGroups


class _State:
    __slots__ = ("config", "generation", "group", "parallel")

    def __init__(self) -> None:
        # the resolved config of the default group we created (None: not ours / none)
        self.config: DistributedConfig | None = None
        # that default group itself, to notice one destroyed and re-made behind our back
        self.group: object | None = None
        # the parallel groups built on top of it
        self.parallel: ParallelGroups | None = None
        # default groups this process has created so far; survives clear() so that a
        # re-initialisation on the same store never reads the previous one's keys
        self.generation = 0

    def clear(self) -> None:
        self.config = None
        self.group = None
        self.parallel = None

    def sync(self) -> None:
        """Forget state about a default group that torch no longer has."""
        import torch.distributed as dist

        world = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
        if self.group is not None and self.group is not world:
            self.clear()


STATE = _State()
