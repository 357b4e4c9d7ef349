"""Every Kth snapshot on disk with ``torch.distributed.checkpoint`` (DCP), in the background.

A checkpoint is ``DIR/run-<run id>/step-<step>/`` (``_snapshot_dir``), written by DCP (no
format of ours) from the bytes already staged in the snapshot's slot, by a thread, on a
gloo group of its own so that it never interleaves with the training loop's collectives.
It is complete once DCP wrote ``.metadata``; rank 0 keeps the newest :data:`KEEP`. A failed
write (a full or read-only disk) never ends the job: its partial directory is removed,
one line says why, and the snapshots stay in memory. Loading needs no process group, so
a checkpoint loads into any world size.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from rallypoint._core.disk import free_space
from rallypoint._core.throttle import Throttle
from rallypoint._snapshot._errors import ExplicitResumeError, SnapshotError
from rallypoint._snapshot._layout import Meta, decode_meta, encode_meta
from rallypoint._snapshot._report import Reporter
from rallypoint._snapshot._snapshot_dir import KEEP, Checkpoint, CheckpointDir, step_name

__all__ = ["KEEP", "REPEAT", "Persister", "describe", "persister_for"]

REPEAT = 60.0
"""Seconds between two lines about failed writes."""


def _quiet_no_dist() -> None:
    # DCP warns on every no_dist save and load; we chose no_dist (one rank, or a full read)
    warnings.filterwarnings(
        "ignore", message="torch.distributed is disabled, unavailable or uninitialized"
    )


def describe(exc: BaseException) -> str:
    """What failed, in one line (DCP wraps each rank's exception with its traceback)."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(exc, CheckpointException) and exc.failures:
        exc = exc.failures[min(exc.failures)][0]
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class Persister:
    """One worker's DCP writer and reader.

    A checkpoint's keys: ``tensors/<path>``, every tensor of the state (DCP's rule holds: a
    plain tensor with the same key on every rank is one replicated tensor, so a per-rank
    tensor such as an RNG state comes back as one rank's copy); ``meta/<rank>``, each rank's
    skeleton (its non-tensor state and the tensor list), so every rank gets its own
    samplers, counters and RNG states back. Ranks at or above the world that wrote it get
    rank 0's skeleton.
    """

    def __init__(
        self,
        directory: str,
        every: int,
        *,
        rank: int,
        world: int,
        run_id: str,
        token: str,
        report: Reporter,
        timeout: float = 300.0,
        resume_from: str = "",
    ) -> None:
        self.directory = Path(directory)
        self.ckdir = CheckpointDir(directory, run_id, token)
        self.resume_from = resume_from
        """``--snapshot-resume-from``: ``""`` (this job's and ended jobs' checkpoints),
        ``none``, a run id or an absolute path (``_snapshot_dir``)."""
        self.every = every
        self.rank = rank
        self.world = world
        self.report = report
        self.timeout = timeout
        self._thread: threading.Thread | None = None
        self._busy_fid = -1
        self._group: Any = None
        self._lines = Throttle(REPEAT)
        self.refused = ""
        """Why this job does not write ``directory`` (another live job writes its namespace)."""
        self.failures = 0
        with contextlib.suppress(OSError):  # said when a write is due (it may become writable)
            self.refused = self.ckdir.claim()

    def close(self) -> None:
        self.join()
        self.ckdir.close()

    def abandon(self) -> None:
        """Stop owning the namespace without waiting for a write in progress (its peers may
        be gone: the thread fails on its own and removes nothing of another attempt's)."""
        self.ckdir.close()

    # ------------------------------------------------------------------ writing
    def due(self, step: int) -> bool:
        return step % self.every == 0

    def busy_with(self, fid: int) -> bool:
        """Whether the thread still reads the slot ``fid`` (then it must not be rewritten)."""
        return self._thread is not None and self._thread.is_alive() and self._busy_fid == fid

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)
            if not self._thread.is_alive():
                self._thread = None

    def _process_group(self) -> tuple[Any, bool] | None:
        """``(group, no_dist)``; ``None`` when a multi-rank job has no process group."""
        import torch.distributed as dist

        if self.world == 1:
            _quiet_no_dist()
            return None, True
        if not dist.is_available() or not dist.is_initialized():
            return None
        if self._group is None:  # collective: every rank persists the same steps
            self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.timeout))
        return self._group, False

    def start(self, step: int, tensors: list[torch.Tensor], meta: Meta, fid: int = -1) -> bool:
        """Write the snapshot of ``meta`` (its tensors: ``tensors``, which the caller does not
        change until :meth:`busy_with` ``fid`` is over) in the background; False if this
        multi-rank job has no process group to write a DCP checkpoint with."""
        self.join()
        if self.refused:
            self.report.once("dcp-refused", f"not persisting: {self.refused}")
            return True
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
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.state_dict_saver import save

        try:
            self.refused = self.ckdir.claim()
            if not self.refused:
                save(state, checkpoint_id=self.ckdir.own / step_name(step),
                     process_group=group, no_dist=no_dist)  # fmt: skip
                if self.rank == 0:
                    self.ckdir.mark_written(step)
                    self.ckdir.prune()
        # torch's CheckpointException is a BaseException; training goes on
        except BaseException as exc:
            if not isinstance(exc, Exception | CheckpointException):
                raise
            self._failed(step, exc, collective=isinstance(exc, CheckpointException))

    def _failed(self, step: int, exc: BaseException, *, collective: bool) -> None:
        """Remove the partial checkpoint; say so (at most once every :data:`REPEAT` s)."""
        self.failures += 1
        if self.rank == 0 or self.world == 1:
            self.ckdir.remove_partial(step)
        if collective and self.rank != 0:
            return  # every rank got the same exception: rank 0 says it
        if not self._lines.ready():
            return
        where = self.ckdir.own
        self.report.always(
            f"rank {self.rank}: persisting step {step} to {where} failed ({describe(exc)}; "
            f"{free_space(where)}); the snapshots stay in memory and training goes on"
        )

    # ------------------------------------------------------------------ reading
    def complete(self) -> list[Checkpoint]:
        """Complete checkpoints this job may restore, newest first.

        Raises ``SnapshotError`` when ``--snapshot-resume-from`` names a job or a path
        that offers none (or a job that is still running) and this job wrote none yet."""
        found = self.ckdir.complete(self.resume_from)
        source = self.ckdir.source(self.resume_from)
        if found or source is None:
            return found
        why = self.ckdir.refusal(self.resume_from) or (
            f"--snapshot-resume-from {self.resume_from}: no complete checkpoint in {source}"
        )
        raise SnapshotError(why)

    @property
    def explicit(self) -> bool:
        """Whether ``--snapshot-resume-from`` names a job or a path (a choice that must
        load: a restore that loads nothing then raises, it never starts from scratch)."""
        return self.ckdir.source(self.resume_from) is not None

    def nothing_loaded(self, failures: list[str]) -> SnapshotError:
        """The error of a restore that loaded nothing although ``--snapshot-resume-from``
        names a source; ``failures``: ``PATH (why)`` of each checkpoint the ranks tried,
        newest first."""
        flag = f"--snapshot-resume-from {self.resume_from}"
        if failures:
            older = f" (and {len(failures) - 1} older)" if len(failures) > 1 else ""
            return ExplicitResumeError(
                f"{flag}: cannot load the checkpoint {failures[0]}{older}; restore() does not "
                "start from scratch for an explicit choice: repair it, or name another one"
            )
        return SnapshotError(
            f"{flag}: not every rank sees a complete checkpoint in "
            f"{self.ckdir.source(self.resume_from)}: every node needs the same --snapshot-dir "
            "(shared storage)"
        )

    def resumed(self, checkpoint: Checkpoint) -> None:
        """Every rank loaded ``checkpoint``: when it is an ended job's, found on its own (no
        ``--snapshot-resume-from``), rank 0 records that this job continues that training."""
        if self.rank != 0 or self.refused or self.resume_from or not checkpoint.job:
            return
        try:
            self.ckdir.record_resume(checkpoint)
        except OSError as exc:
            self.report.once("resumed", f"could not record the resume in {self.ckdir.own}: {exc}")

    def origin(self, checkpoint: Checkpoint) -> str:
        """Where ``checkpoint`` comes from, for the restore line: its path, and the job that
        wrote it when that is another job."""
        where = self.directory / checkpoint.name
        if not checkpoint.job:
            return str(where)
        if self.ckdir.source(self.resume_from) is not None:
            return f"{where} (--snapshot-resume-from {self.resume_from})"
        return f"{where}, a checkpoint of job {checkpoint.job!r}, which ended"

    def load(self, checkpoint: Checkpoint) -> tuple[Meta, list[torch.Tensor]]:
        """This rank's meta and full tensors from ``checkpoint``."""
        from torch.distributed.checkpoint.filesystem import FileSystemReader
        from torch.distributed.checkpoint.state_dict_loader import load

        _quiet_no_dist()
        path = self.directory / checkpoint.name
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

    def try_load(self, checkpoint: Checkpoint) -> tuple[Meta, list[torch.Tensor]] | str:
        """:meth:`load`, or what failed (a checkpoint that vanished or is damaged)."""
        from torch.distributed.checkpoint.api import CheckpointException

        try:
            return self.load(checkpoint)
        except (Exception, CheckpointException) as exc:
            return describe(exc)


def persister_for(
    options: Any,
    previous: Persister | None,
    *,
    rank: int,
    world: int,
    run_id: str,
    token: str,
    report: Reporter,
) -> Persister | None:
    """The persister for ``options`` (``None`` without a directory), after ``previous``
    finished what it was writing."""
    if previous is not None:
        previous.close()
    if options.dir is None:
        return None
    return Persister(
        options.dir, options.every, rank=rank, world=world, run_id=run_id, token=token,
        report=report, timeout=options.timeout, resume_from=options.resume_from,
    )  # fmt: skip
