"""What an exited worker leaves of its Flight Recorder, for the report on its failure.

A collective that times out ends the ranks that waited in it (gloo raises in each of them;
NCCL's watchdog aborts the process), while the rank that never issued it lives on: the
first failure then names a victim. So a worker whose error is a collective timeout
(:data:`COLLECTIVE_TIMEOUT`) leaves its trace in ``$RALLYPOINT_STACKS_DIR/<pid>.fr.final.json``
before it exits (:func:`leave_final_trace`, called by the worker bootstrap), and the agent
reads it, or the dump NCCL's watchdog wrote (``TORCH_FR_DUMP_TEMP_FILE``, set by
:func:`~rallypoint._watch._flight.flight_recorder_env`), with :func:`read_final_trace`,
next to the live traces of the ranks still running.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import re
from collections.abc import Mapping
from typing import Any

from rallypoint._core import envvars
from rallypoint._watch._flight._recorder import (
    NCCL_DUMP_PREFIX,
    answers,
    recording,
    trace_from_dump,
    write_answer,
)
from rallypoint._watch._flight._records import RankTrace

__all__ = [
    "COLLECTIVE_TIMEOUT",
    "has_final_trace",
    "leave_final_trace",
    "read_final_trace",
    "remove_final_traces",
]


COLLECTIVE_TIMEOUT = re.compile(
    r"Timed out waiting \d+ ?ms for (recv|send) operation|"  # gloo
    r"collective operation timeout|Watchdog caught|ran for \d+ milliseconds before timing out"
)
"""What a worker's error says when a collective timed out (gloo's, NCCL's watchdog)."""


def _final_path(directory: str, pid: int) -> str:
    return os.path.join(directory, f"{pid}.fr.final.json")


def leave_final_trace(error: str, env: Mapping[str, str] | None = None) -> bool:
    """In a worker that is about to fail with ``error``: when that is a collective timeout,
    leave this worker's Flight Recorder in ``<pid>.fr.final.json`` for the agent's report
    (first without the issuing frames, at once, then with them); whether it did."""
    env = os.environ if env is None else env
    directory = env.get(envvars.STACKS_DIR)
    if not directory or not recording(env) or not COLLECTIVE_TIMEOUT.search(error):
        return False
    rank = int(env.get("RANK", "0") or 0)
    for final, trace in answers("final", rank):
        write_answer(_final_path(directory, os.getpid()), "final", final, trace)
    return True


def has_final_trace(directory: str | os.PathLike[str], rank: int, pid: int) -> bool:
    """Whether worker ``pid`` (``rank``) began to leave a trace: its own
    (:func:`leave_final_trace`), or NCCL's watchdog's before it aborts the process."""
    directory = os.fspath(directory)
    return os.path.exists(_final_path(directory, pid)) or os.path.exists(
        _nccl_path(directory, rank)
    )


def _nccl_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"{NCCL_DUMP_PREFIX}{rank}")


def read_final_trace(directory: str | os.PathLike[str], rank: int, pid: int) -> RankTrace | None:
    """The trace an exited worker left: its own (:func:`leave_final_trace`), or the one
    NCCL's watchdog wrote when it ended the process on a collective timeout."""
    directory = os.fspath(directory)
    with (
        contextlib.suppress(OSError, ValueError, KeyError, TypeError),
        open(_final_path(directory, pid), encoding="utf-8") as fh,
    ):
        return RankTrace.from_json(json.load(fh)["trace"])
    try:
        with open(_nccl_path(directory, rank), "rb") as fh:
            dump = pickle.load(fh)  # written by this job's worker into the agent's own 0700 dir
    except (OSError, pickle.UnpicklingError, EOFError, ValueError):
        return None
    try:
        return trace_from_dump(rank, dump, _groups_of_dump(dump))
    except (KeyError, TypeError, ValueError) as exc:
        return RankTrace(rank=rank, error=f"unreadable NCCL Flight Recorder dump: {exc}")


def _groups_of_dump(dump: Mapping[str, Any]) -> dict[str, tuple[tuple[int, ...], bool]]:
    """``{group name: (global ranks, is the default group)}`` from a dump's ``pg_config``
    (NCCL fills it in; the ranks are a string like ``"[0, 1]"``)."""
    out: dict[str, tuple[tuple[int, ...], bool]] = {}
    for name, config in dict(dump.get("pg_config") or {}).items():
        if not isinstance(config, Mapping):
            continue
        ranks = tuple(sorted(int(r) for r in re.findall(r"\d+", str(config.get("ranks", "")))))
        out[str(name)] = (ranks, config.get("desc") == "default_pg")
    return out


def remove_final_traces(directory: str | os.PathLike[str], rank: int, pid: int) -> None:
    """Delete what an exited worker left (:func:`read_final_trace` reads it)."""
    directory = os.fspath(directory)
    final = _final_path(directory, pid)
    for path in (final, f"{final}.tmp", _nccl_path(directory, rank)):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
