"""Every Kth snapshot on disk with ``torch.distributed.checkpoint`` (DCP), in the background.

A checkpoint is ``DIR/step-<step>/``, written by DCP (no format of ours) from the bytes
already staged in the snapshot's slot, by a thread, on a gloo group of its own (so it never
interleaves with the training loop's collectives). Its keys:

- ``tensors/<path>``: every tensor of the state (``model/fc.weight``...). DCP's rule holds:
  a plain tensor with the same key on every rank is one replicated tensor (written once);
  so a per-rank tensor (an RNG state) comes back as one rank's copy;
- ``meta/<rank>``: each rank's skeleton (its non-tensor state and the tensor list), so every
  rank gets its own samplers, counters and RNG states back.

A checkpoint is complete when DCP has written ``.metadata`` (after every rank's data).
Rank 0 keeps the newest :data:`KEEP` complete ones. Loading reads the full tensors
(``no_dist``: no process group needed), so a checkpoint written by a world of N ranks loads
into any world size: ranks below N get their own skeleton, the others rank 0's.
"""

from __future__ import annotations

import os
import re
import shutil
import threading
import warnings
from pathlib import Path
from typing import Any

import torch

from rallypoint.snapshot._layout import Meta, decode_meta, encode_meta

__all__ = ["KEEP", "Persister", "persister_for"]

KEEP = 2
_DIR = re.compile(r"^step-(\d{12})$")


def _name(step: int) -> str:
    return f"step-{step:012d}"


class Persister:
    """One worker's DCP writer and reader."""

    def __init__(self, directory: str, every: int, *, rank: int, world: int) -> None:
        self.directory = Path(directory)
        self.every = every
        self.rank = rank
        self.world = world
        self._thread: threading.Thread | None = None
        self._busy_fid = -1
        self._group: Any = None
        self.error: str = ""
        """The last background failure (reported once by the caller)."""

    # ------------------------------------------------------------------ writing
    def due(self, step: int) -> bool:
        return step % self.every == 0

    def busy_with(self, fid: int) -> bool:
        """Whether the thread still reads the slot ``fid`` (then it must not be rewritten)."""
        return self._thread is not None and self._thread.is_alive() and self._busy_fid == fid

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _process_group(self) -> tuple[Any, bool] | None:
        """``(group, no_dist)``; ``None`` when a multi-rank job has no process group."""
        import torch.distributed as dist

        if self.world == 1:
            warnings.filterwarnings(  # DCP says it on every no_dist save; we chose it
                "ignore", message="torch.distributed is disabled, unavailable or uninitialized"
            )
            return None, True
        if not dist.is_available() or not dist.is_initialized():
            return None
        if self._group is None:  # collective: every rank persists the same steps
            self._group = dist.new_group(backend="gloo")
        return self._group, False

    def start(self, step: int, tensors: list[torch.Tensor], meta: Meta, fid: int = -1) -> bool:
        """Write the snapshot of ``meta`` (its tensors: ``tensors``, which the caller does not
        change until :meth:`busy_with` ``fid`` is over) in the background; False if this
        multi-rank job has no process group to write a DCP checkpoint with."""
        self.join()
        group = self._process_group()
        if group is None:
            return False
        state: dict[str, Any] = {
            f"tensors/{e.path}": t for e, t in zip(meta.entries, tensors, strict=True)
        }
        state[f"meta/{self.rank}"] = encode_meta(meta)
        self._busy_fid = fid
        self._thread = threading.Thread(
            target=self._write, args=(step, state, *group), daemon=True, name="snapshot-dcp"
        )
        self._thread.start()
        return True

    def _write(self, step: int, state: dict[str, Any], group: Any, no_dist: bool) -> None:
        from torch.distributed.checkpoint.state_dict_saver import save

        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            path = self.directory / _name(step)
            save(state, checkpoint_id=path, process_group=group, no_dist=no_dist)
            if self.rank == 0:
                self._prune()
        except Exception as exc:  # reported by the caller; training goes on
            self.error = f"{type(exc).__name__}: {exc}"

    def _prune(self) -> None:
        complete = self.complete_steps()
        keep = set(complete[-KEEP:])
        oldest = min(keep) if keep else 0
        for child in self.directory.iterdir():
            m = _DIR.match(child.name)
            if m is not None and int(m.group(1)) not in keep and int(m.group(1)) < oldest:
                shutil.rmtree(child, ignore_errors=True)

    # ------------------------------------------------------------------ reading
    def complete_steps(self) -> list[int]:
        """Steps with a complete checkpoint, oldest first."""
        try:
            names = os.listdir(self.directory)
        except OSError:
            return []
        steps = []
        for name in names:
            m = _DIR.match(name)
            if m is not None and (self.directory / name / ".metadata").is_file():
                steps.append(int(m.group(1)))
        return sorted(steps)

    def load(self, step: int) -> tuple[Meta, list[torch.Tensor]]:
        """This rank's meta and full tensors from the checkpoint of ``step``."""
        from torch.distributed.checkpoint.filesystem import FileSystemReader
        from torch.distributed.checkpoint.state_dict_loader import load

        path = self.directory / _name(step)
        keys = FileSystemReader(path).read_metadata().state_dict_metadata
        mine = f"meta/{self.rank}" if f"meta/{self.rank}" in keys else "meta/0"
        head: dict[str, Any] = {mine: b""}
        load(head, checkpoint_id=path, no_dist=True)
        meta = decode_meta(head[mine])
        tensors = {
            f"tensors/{e.path}": torch.empty(e.shape, dtype=getattr(torch, e.dtype))
            for e in meta.entries
        }
        if tensors:
            load(tensors, checkpoint_id=path, no_dist=True)
        return meta, [tensors[f"tensors/{e.path}"] for e in meta.entries]


def persister_for(
    options: Any, previous: Persister | None, *, rank: int, world: int
) -> Persister | None:
    """The persister for ``options`` (``None`` without a directory), after ``previous``
    finished what it was writing."""
    if previous is not None:
        previous.join()
    if options.dir is None:
        return None
    return Persister(options.dir, options.every, rank=rank, world=world)
