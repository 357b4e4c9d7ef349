"""The snapshot options: where to persist, how often, how long to wait for the other ranks.

Defaults come from the environment ``rallypoint run`` gives workers (``--snapshot-dir``,
``--snapshot-every``); :func:`rallypoint.snapshot.configure` overrides them per process.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

from rallypoint._core import envvars
from rallypoint._core.checks import check_int, check_seconds

__all__ = ["DEFAULT_EVERY", "DEFAULT_TIMEOUT", "UNSET", "Options"]

DEFAULT_EVERY = 10
DEFAULT_TIMEOUT = 300.0
UNSET: Any = object()


def _check_dir(value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str | os.PathLike):
        raise TypeError(
            f"dir must be a path (str or os.PathLike) or None, got {type(value).__name__}"
        )
    path = os.fspath(value)
    if not isinstance(path, str) or not path:
        raise ValueError("dir must be a non-empty path")
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"dir {path!r} exists and is not a directory")
    return path


def _check_resume_from(value: object) -> str:
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str):
        raise TypeError(
            f"resume_from must be a run id, a path or 'none', got {type(value).__name__}"
        )
    if value and ("/" in value or value.startswith(".")):
        return os.path.abspath(value)  # a path: a checkpoint or a job's namespace
    return value


@dataclass(frozen=True, slots=True, kw_only=True)
class Options:
    dir: str | None = None
    """Persist every ``every``-th snapshot here with torch.distributed.checkpoint."""
    every: int = DEFAULT_EVERY
    timeout: float = DEFAULT_TIMEOUT
    """Seconds to wait for the other ranks (agreement, completion of a save)."""
    resume_from: str = ""
    """Which checkpoints under ``dir`` a restore may read besides this job's own: ``""``
    (those of jobs that ended), ``"none"``, a run id, or an absolute path."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "dir", _check_dir(self.dir))
        object.__setattr__(self, "resume_from", _check_resume_from(self.resume_from))
        check_int(self.every, "every", minimum=1)
        secs = check_seconds(self.timeout, "timeout", numbers=True)
        if secs is None or not math.isfinite(secs):
            raise ValueError(f"timeout must be a finite number of seconds, got {self.timeout}")

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Options:
        every = env.get(envvars.SNAPSHOT_EVERY, "")
        if every and not every.isdigit():
            raise ValueError(f"{envvars.SNAPSHOT_EVERY} must be an integer >= 1, got {every!r}")
        return cls(
            dir=env.get(envvars.SNAPSHOT_DIR) or None,
            every=int(every) if every else DEFAULT_EVERY,
            resume_from=env.get(envvars.SNAPSHOT_RESUME_FROM, ""),
        )

    def update(
        self,
        *,
        dir: Any = UNSET,
        every: Any = UNSET,
        timeout: Any = UNSET,
        resume_from: Any = UNSET,
    ) -> Options:
        changes: dict[str, Any] = {}
        if dir is not UNSET:
            changes["dir"] = dir
        if resume_from is not UNSET:
            changes["resume_from"] = "" if resume_from is None else resume_from
        if every is not UNSET:
            changes["every"] = every
        if timeout is not UNSET:
            if isinstance(timeout, timedelta):
                timeout = timeout.total_seconds()
            elif isinstance(timeout, bool) or not isinstance(timeout, int | float):
                raise TypeError(
                    f"timeout must be seconds or a datetime.timedelta, got {type(timeout).__name__}"
                )
            changes["timeout"] = float(timeout)
        return replace(self, **changes)
