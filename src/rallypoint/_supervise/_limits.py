"""Whether this host can run ``nproc`` workers, checked before the first fork.

The launcher holds eight descriptors per worker while it starts them (three pipes and the
control channel's pair) and six while they run (three read ends, the control channel's
end, two log files); each worker is a process of this user.
Without the check, ``--nproc-per-node 10000`` forked until ``EMFILE`` and ended with a
40-line traceback after 11 s. The soft open-files limit is raised up to the hard one when
that is enough, as a user would with ``ulimit -n``.
"""

from __future__ import annotations

import os
import resource

__all__ = ["check_worker_limits"]

FDS_PER_WORKER = 8
_SPARE_FDS = 64
"""Descriptors for everything else: the store, the rendezvous, the events file, logs."""
_SPARE_PROCS = 16


def _open_fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0


def _read_int(path: str) -> int | None:
    try:
        with open(path) as fp:
            return int(fp.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _tasks_on_host() -> int:
    try:
        return sum(name.isdigit() for name in os.listdir("/proc"))
    except OSError:
        return 0


def check_worker_limits(nproc: int) -> None:
    """Raise ``ValueError`` naming the limit when ``nproc`` workers cannot start here."""
    need = FDS_PER_WORKER * nproc + _open_fds() + _SPARE_FDS
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        if hard == resource.RLIM_INFINITY or hard >= need:
            resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
        else:
            raise ValueError(
                f"--nproc-per-node {nproc} needs about {need} open files in the launcher "
                f"({FDS_PER_WORKER} per worker), but its limit is {soft} (hard limit {hard}; "
                "`ulimit -n`): raise the limit or start fewer workers"
            )
    user_max, _ = resource.getrlimit(resource.RLIMIT_NPROC)
    if os.geteuid() != 0 and user_max != resource.RLIM_INFINITY and nproc + _SPARE_PROCS > user_max:
        raise ValueError(
            f"--nproc-per-node {nproc} needs {nproc} processes, but this user may run at most "
            f"{user_max} (`ulimit -u`): raise the limit or start fewer workers"
        )
    host_max = min(
        n
        for n in (
            _read_int("/proc/sys/kernel/pid_max"),
            _read_int("/proc/sys/kernel/threads-max"),
            1 << 31,
        )
        if n is not None
    )
    running = _tasks_on_host()
    if running + nproc + _SPARE_PROCS > host_max:
        raise ValueError(
            f"--nproc-per-node {nproc} needs {nproc} processes, but this host has room for "
            f"{max(0, host_max - running - _SPARE_PROCS)} more "
            f"({running} running, kernel.pid_max/threads-max {host_max}): start fewer workers"
        )
