"""The ``--snapshot-dir`` directory: one namespace per job, locks, listing and pruning.

A job writes and prunes only its own namespace, ``DIR/run-<run id>/`` (its run id:
``--rdzv-id``, or the random id of a one-node job), so two jobs sharing ``DIR`` never
delete each other's checkpoints, and a second live job with the same run id is refused.
Flocks tell a live job's namespace from an ended one's: a restore may read this job's
checkpoints and those of jobs that ended (a relaunched training), never those of another
live job. The layout: :class:`CheckpointDir`; what a restore reads:
:meth:`CheckpointDir.complete`; what is removed: :meth:`CheckpointDir.prune`.
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

__all__ = [
    "FRESH",
    "KEEP",
    "Checkpoint",
    "CheckpointDir",
    "live_problem",
    "namespace",
    "resume_problem",
    "step_name",
]

KEEP = 2
PREFIX = "run-"
FRESH = "none"
"""``--snapshot-resume-from none``: restore only what this job wrote itself."""
_STEP = re.compile(r"^step-(\d{12})$")
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


def step_name(step: int) -> str:
    return f"step-{step:012d}"


def namespace(run_id: str) -> str:
    """The directory name of ``run_id``'s namespace (unsafe characters become ``_``)."""
    return PREFIX + _UNSAFE.sub("_", run_id)[:120]


@dataclass(frozen=True, order=True, slots=True)
class Checkpoint:
    """A complete checkpoint: its step, its path relative to ``DIR`` (absolute when it is
    outside), and the run id of the job that wrote it when that is another job (``""``: this
    job's own namespace)."""

    step: int
    name: str
    job: str = ""


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


def _step_of(path: Path) -> int:
    m = _STEP.match(path.name)
    return int(m.group(1)) if m is not None else -1


def _job_of(ns: Path) -> str:
    """The run id a namespace's name shows (the directory's own name outside ``DIR``)."""
    return ns.name[len(PREFIX) :] if ns.name.startswith(PREFIX) else str(ns)


def _relative(path: Path, root: Path) -> str:
    return str(path.relative_to(root)) if path.is_relative_to(root) else str(path)


def _written(checkpoint: Path) -> float:
    """When ``checkpoint`` was completed (its ``.metadata``'s time)."""
    try:
        return (checkpoint / ".metadata").stat().st_mtime
    except OSError:
        return 0.0


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
    process of the job, another in any other job).

    ::

        DIR/run-<run id>/step-<step>/      this job's DCP checkpoints (``.metadata`` once complete)
        DIR/run-<run id>/step-<step>/.job  the token of the job that wrote it (after ``.metadata``)
        DIR/run-<run id>/.owner            which job writes the namespace (a token of the job)
        DIR/run-<run id>/.live             every process of that job holds a shared flock on it
        DIR/run-<run id>/.claim            held (exclusive flock) while the owner is checked
        DIR/run-<run id>/.resumed          the namespaces of ended jobs this job resumed from
        DIR/step-<step>/                   the flat layout: read, never written
    """

    def __init__(self, root: str | os.PathLike[str], run_id: str, token: str) -> None:
        self.root = Path(root)
        self.own = self.root / namespace(run_id)
        self.token = token
        self._live = -1
        self._refused = False  # another live job writes our namespace: its checkpoints too

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
                    self._refused = True
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

    def _ended_others(self) -> list[Path]:
        """``root`` itself (the flat layout) and the namespaces of other jobs that ended."""
        try:
            names = sorted(os.listdir(self.root))
        except OSError:
            return []
        out = [self.root]
        for name in names:
            path = self.root / name
            other = name.startswith(PREFIX) and path != self.own and path.is_dir()
            if other and self._ended(path):
                out.append(path)
        return out

    # ------------------------------------------------------------------ reading
    def complete(self, resume_from: str = "") -> list[Checkpoint]:
        """Complete checkpoints this job may restore, newest first.

        ``resume_from`` (``--snapshot-resume-from``):

        - ``""``: this job's namespace, the namespaces of jobs that ended (no process holds
          their ``.live``) and the flat layout; never the namespace of another live job (nor
          what it wrote in this job's namespace, when :meth:`claim` found it writing there);
        - :data:`FRESH` (``none``): only the checkpoints this job wrote itself;
        - a run id or an absolute path: the checkpoints this job wrote, and those of that job
          (a namespace under ``DIR``, refused while that job lives) or that path (one
          checkpoint, or a namespace).

        The newest complete checkpoint wins; on a tie this job's own, then the newest written.
        """
        found: list[tuple[int, bool, float, Checkpoint]] = []

        def add(ns: Path, mine: bool, only_ours: bool = False) -> None:
            job = "" if mine else _job_of(ns)
            for step, path, done in _steps(ns):
                if done and (not only_ours or self.wrote(path)):
                    name = _relative(path, self.root)
                    found.append((step, mine, _written(path), Checkpoint(step, name, job)))

        if not resume_from:
            add(self.own, True, only_ours=self._refused)
            for ns in self._ended_others():
                add(ns, False)
        else:
            source = self.source(resume_from)
            add(self.own, True, only_ours=source != self.own or self._refused)
            if source is not None and source != self.own and not self.refusal(resume_from):
                if (source / ".metadata").is_file():  # one checkpoint
                    step, job = _step_of(source), _job_of(source.parent)
                    name = _relative(source, self.root)
                    found.append((step, False, _written(source), Checkpoint(step, name, job)))
                else:
                    add(source, False)
        found.sort(key=lambda f: (f[0], f[1], f[2]), reverse=True)
        return [checkpoint for *_, checkpoint in found]

    def source(self, resume_from: str) -> Path | None:
        """The directory ``resume_from`` names (``None`` for ``""`` and :data:`FRESH`)."""
        if resume_from in ("", FRESH):
            return None
        if os.path.isabs(resume_from):
            return Path(resume_from)
        return self.root / namespace(resume_from)

    def refusal(self, resume_from: str) -> str:
        """Why ``resume_from`` cannot be read (its job is live), or ``""``."""
        source = self.source(resume_from)
        if source is None or source == self.own:
            return ""
        ns = source.parent if (source / ".metadata").is_file() else source
        if ns.name.startswith(PREFIX) and not self._ended(ns):
            return (
                f"--snapshot-resume-from {resume_from}: job {_job_of(ns)!r} is still running "
                f"({ns}); a live job's checkpoints belong to another training: resume from "
                "them once it ended, or name a checkpoint of another job"
            )
        return ""

    def offered(self, resume_from: str) -> list[Path]:
        """The complete checkpoints the source ``resume_from`` names holds (the source
        itself when it is one checkpoint), newest first."""
        source = self.source(resume_from)
        if source is None:
            return []
        if (source / ".metadata").is_file():
            return [source]
        found = sorted((step, path) for step, path, done in _steps(source) if done)
        return [path for _, path in reversed(found)]

    def jobs_with_checkpoints(self) -> list[str]:
        """The run ids of the namespaces under ``root`` that hold a complete checkpoint."""
        try:
            names = sorted(os.listdir(self.root))
        except OSError:
            return []
        return [
            _job_of(self.root / name)
            for name in names
            if name.startswith(PREFIX) and any(done for *_, done in _steps(self.root / name))
        ]

    def wrote(self, checkpoint: Path) -> bool:
        """Whether this job wrote ``checkpoint`` (its ``.job`` holds this job's token)."""
        try:
            return (checkpoint / ".job").read_text() == self.token
        except OSError:
            return False

    def mark_written(self, step: int) -> None:
        """Record that this job wrote its checkpoint of ``step`` (after ``.metadata``)."""
        path = self.own / step_name(step) / ".job"
        tmp = path.with_name(".job.tmp")
        tmp.write_text(self.token)
        os.replace(tmp, path)

    def record_resume(self, checkpoint: Checkpoint) -> None:
        """Remember that this job continues the training of another job that ended, from
        ``checkpoint`` (so that :meth:`prune` may remove that job's namespace once it is
        superseded)."""
        ns = (self.root / checkpoint.name).parent
        if not checkpoint.job or not ns.is_relative_to(self.root):
            return
        with open(self.own / ".resumed", "a") as fp:
            fp.write(f"{ns.relative_to(self.root)}\n")

    def _resumed(self) -> set[Path]:
        try:
            lines = (self.own / ".resumed").read_text().splitlines()
        except OSError:
            return set()
        return {self.root / line for line in lines if line}

    def own_complete(self) -> list[int]:
        return sorted(step for step, _, done in _steps(self.own) if done)

    # ------------------------------------------------------------------ pruning
    def prune(self) -> None:
        """Keep this job's newest :data:`KEEP` complete checkpoints and remove its others;
        remove the partial checkpoints of jobs that ended; once this job has :data:`KEEP`,
        remove the namespaces of the ended jobs it resumed from on its own (``.resumed``)
        whose checkpoints are all older than the oldest one it keeps (superseded), and those
        of ended jobs that hold no complete checkpoint."""
        steps = self.own_complete()
        keep = steps[-KEEP:]
        for step, path, _ in _steps(self.own):
            if step not in keep:
                shutil.rmtree(path, ignore_errors=True)
        resumed = self._resumed()
        for ns in self._ended_others():
            found = list(_steps(ns))
            older = len(keep) >= KEEP and all(step < keep[0] for step, _, done in found if done)
            empty = not any(done for _, _, done in found)
            older = older and (ns in resumed or empty)
            for _, path, done in found:
                if not done or older:
                    shutil.rmtree(path, ignore_errors=True)
            if ns != self.root and older:
                shutil.rmtree(ns, ignore_errors=True)

    def remove_partial(self, step: int) -> None:
        """A failed save: remove its directory and every other partial one."""
        shutil.rmtree(self.own / step_name(step), ignore_errors=True)
        for ns in [self.own, *self._ended_others()]:
            for _, path, done in _steps(ns):
                if not done:
                    shutil.rmtree(path, ignore_errors=True)


def live_problem(root: str | os.PathLike[str], run_id: str) -> str:
    """Why a job may not start with the run id ``run_id`` and ``--snapshot-dir root``: a
    live job with the same run id writes that namespace (its checkpoints are another
    training's, which the new job would restore), in one line; ``""`` otherwise. For a
    one-node job, checked before its workers start (the nodes of one multi-node job share
    a run id: their workers tell each other apart from another job by its token)."""
    ckdir = CheckpointDir(root, run_id, "")
    if not (ckdir.own / ".live").exists() or ckdir._ended(ckdir.own):
        return ""
    return (
        f"--rdzv-id {run_id}: a job with this run id is running and writing {ckdir.own} "
        f"(--snapshot-dir {ckdir.root}); this one would restore its checkpoints: give it its "
        "own --rdzv-id, or start it once that job ended"
    )


def resume_problem(root: str | os.PathLike[str], resume_from: str, run_id: str) -> str:
    """Why the job ``run_id`` cannot resume from ``resume_from`` (``--snapshot-resume-from``,
    with ``--snapshot-dir root``), in one line that says what to change; ``""`` when it
    can. Checked before the workers start: a checkpoint whose metadata or files are damaged
    is found here (``_verify``); damage inside a data file only the workers' load finds."""
    ckdir = CheckpointDir(root, run_id, "")
    source = ckdir.source(resume_from)
    if source is None:
        return ""
    flag = f"--snapshot-resume-from {resume_from}"
    if os.path.isabs(resume_from) and not source.is_dir():
        return f"{flag}: no such directory"
    why = ckdir.refusal(resume_from)
    if why:
        return why
    offered = ckdir.offered(resume_from)
    if offered:
        return _none_loads(flag, offered)
    if os.path.isabs(resume_from):
        return (
            f"{flag}: no complete checkpoint in {source} (name a step-<N> directory with a "
            ".metadata file, or a directory of them)"
        )
    jobs = [job for job in ckdir.jobs_with_checkpoints() if job != resume_from]
    known = f"run ids with checkpoints there: {', '.join(jobs[:8])}" if jobs else "none has any"
    return (
        f"{flag}: no checkpoint of job {resume_from!r} in {ckdir.root} ({source} holds no "
        f"complete checkpoint); {known}"
    )


def _none_loads(flag: str, offered: list[Path]) -> str:
    """``""`` when one of the ``offered`` checkpoints (newest first) looks loadable (the
    workers restore the newest that loads), else one line naming the newest and what is
    wrong with it."""
    from rallypoint._snapshot._verify import checkpoint_problem

    problems = []
    for path in offered:
        why = checkpoint_problem(path)
        if not why:
            return ""
        problems.append(f"{path}: {why}")
    older = f" (and {len(problems) - 1} older)" if len(problems) > 1 else ""
    return (
        f"{flag}: cannot load the checkpoint {problems[0]}{older}; an explicit choice never "
        "starts from scratch: repair it, or name another one"
    )
