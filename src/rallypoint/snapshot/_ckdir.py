"""The ``--snapshot-dir`` directory: one namespace per job, locks, listing and pruning.

::

    DIR/run-<run id>/step-<step>/      this job's DCP checkpoints (``.metadata`` once complete)
    DIR/run-<run id>/.owner            which job writes the namespace (a token of the job)
    DIR/run-<run id>/.live             every process of that job holds a shared flock on it
    DIR/run-<run id>/.claim            held (exclusive flock) while the owner is checked
    DIR/step-<step>/                   the layout before namespaces: read, never written

A job writes and prunes only its own namespace (its run id: ``--rdzv-id``, or the random id
of a one-node job), so two jobs sharing ``DIR`` never delete each other's checkpoints; a
second job with the same run id while the first one lives is refused (:meth:`claim`). A
restore reads every namespace and the old flat layout (the newest complete checkpoint
wins; a tie goes to this job's own). Another job's namespace is pruned only once that job
ended (no process holds its ``.live``): its partial checkpoints (no ``.metadata``: a failed
or interrupted save) at once, and all of it once this job has :data:`KEEP` complete
checkpoints newer than every one of it (a restarted training superseded it).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = ["KEEP", "Checkpoint", "CheckpointDir", "namespace", "step_name"]

KEEP = 2
PREFIX = "run-"
_STEP = re.compile(r"^step-(\d{12})$")
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


def step_name(step: int) -> str:
    return f"step-{step:012d}"


def namespace(run_id: str) -> str:
    """The directory name of ``run_id``'s namespace (unsafe characters become ``_``)."""
    return PREFIX + _UNSAFE.sub("_", run_id)[:120]


@dataclass(frozen=True, order=True, slots=True)
class Checkpoint:
    """A complete checkpoint: its step and its path relative to ``DIR``."""

    step: int
    name: str


def _steps(path: Path) -> Iterator[tuple[int, Path, bool]]:
    """``(step, directory, complete)`` of every step directory right under ``path``."""
    try:
        names = os.listdir(path)
    except OSError:
        return
    for name in names:
        m = _STEP.match(name)
        if m is not None:
            child = path / name
            yield int(m.group(1)), child, (child / ".metadata").is_file()


def _open(path: Path) -> int:
    # read-only: a lock file held open must not keep its file system from going read-only
    return os.open(path, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)


@contextlib.contextmanager
def _guard(ns: Path) -> Iterator[None]:
    fd = _open(ns / ".claim")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


class CheckpointDir:
    """One process's view of ``root`` for the job ``run_id`` (``token``: the same in every
    process of the job, another in any other job)."""

    def __init__(self, root: str | os.PathLike[str], run_id: str, token: str) -> None:
        self.root = Path(root)
        self.own = self.root / namespace(run_id)
        self.token = token
        self._live = -1

    def close(self) -> None:
        if self._live >= 0:
            os.close(self._live)
            self._live = -1

    # ------------------------------------------------------------------ ownership
    def claim(self) -> str:
        """Take this job's namespace: ``""``, or why not (another live job writes it).
        ``OSError`` when the directory cannot be written."""
        if self._live >= 0:
            return ""
        self.own.mkdir(parents=True, exist_ok=True)
        with _guard(self.own):
            live = _open(self.own / ".live")
            owner_file = self.own / ".owner"
            owner = owner_file.read_text() if owner_file.is_file() else ""
            if owner != self.token:
                try:
                    fcntl.flock(live, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(live)
                    return (
                        f"another job with the same run id is writing {self.own}: give each "
                        "job its own --rdzv-id or --snapshot-dir"
                    )
                owner_file.write_text(self.token)
            fcntl.flock(live, fcntl.LOCK_SH)
            self._live = live
        return ""

    def _ended(self, ns: Path) -> bool:
        """Whether no process holds ``ns``'s ``.live`` (its job ended, or never claimed it)."""
        if not (ns / ".live").exists():
            return True
        try:
            with _guard(ns):
                fd = _open(ns / ".live")
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    return False
                finally:
                    os.close(fd)
        except OSError:
            return True  # cannot tell (read-only): then nothing can be deleted either
        return True

    def _others(self, *, ended: bool) -> list[Path]:
        """``root`` itself (the flat layout) and the other jobs' namespaces (``ended``: only
        those of jobs that ended)."""
        try:
            names = sorted(os.listdir(self.root))
        except OSError:
            return []
        out = [self.root]
        for name in names:
            path = self.root / name
            other = name.startswith(PREFIX) and path != self.own and path.is_dir()
            if other and (not ended or self._ended(path)):
                out.append(path)
        return out

    # ------------------------------------------------------------------ reading
    def complete(self) -> list[Checkpoint]:
        """Complete checkpoints this job may restore, newest first (this job's first on a
        tie)."""
        found: list[tuple[int, int, str]] = []
        for rank, ns in enumerate([self.own, *self._others(ended=False)]):
            for step, path, done in _steps(ns):
                if done:
                    found.append((step, -rank, str(path.relative_to(self.root))))
        return [Checkpoint(step, name) for step, _, name in sorted(found, reverse=True)]

    def own_complete(self) -> list[int]:
        return sorted(step for step, _, done in _steps(self.own) if done)

    # ------------------------------------------------------------------ pruning
    def prune(self) -> None:
        """Keep this job's newest :data:`KEEP` complete checkpoints and remove its others;
        remove the partial checkpoints of jobs that ended; once this job has :data:`KEEP`,
        remove the checkpoints (and namespaces) of jobs that ended which are all older than
        the oldest one it keeps (a later job of the same training superseded them)."""
        steps = self.own_complete()
        keep = steps[-KEEP:]
        for step, path, _ in _steps(self.own):
            if step not in keep:
                shutil.rmtree(path, ignore_errors=True)
        for ns in self._others(ended=True):
            found = list(_steps(ns))
            older = len(keep) >= KEEP and all(step < keep[0] for step, _, done in found if done)
            for _, path, done in found:
                if not done or older:
                    shutil.rmtree(path, ignore_errors=True)
            if ns != self.root and older:
                shutil.rmtree(ns, ignore_errors=True)

    def remove_partial(self, step: int) -> None:
        """A failed save: remove its directory and every other partial one."""
        shutil.rmtree(self.own / step_name(step), ignore_errors=True)
        for ns in [self.own, *self._others(ended=True)]:
            for _, path, done in _steps(ns):
                if not done:
                    shutil.rmtree(path, ignore_errors=True)
