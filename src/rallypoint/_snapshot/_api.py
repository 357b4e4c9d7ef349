"""``save``, ``restore``, ``configure`` and ``wait``: the process's one snapshot session.

Under ``rallypoint run`` (``RALLYPOINT_SNAPSHOT_SOCKET`` is set) the session keeps the
snapshots on the node's snapshot server (``_node``); otherwise, or when that server cannot
be reached, in this process (``_local``), said once on stderr. A forked child gets a
session of its own.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping, MutableMapping
from typing import Any, Protocol

from rallypoint._core import envvars
from rallypoint._core.checks import check_int
from rallypoint._snapshot._flatten import Flat, check_restorable, check_state, flatten
from rallypoint._snapshot._options import UNSET, Options
from rallypoint._snapshot._report import Reporter

__all__ = ["configure", "current_session", "restore", "save", "wait"]


class _Session(Protocol):
    def close(self) -> None: ...
    def configure(self, options: Options) -> None: ...
    def save(self, flat: Flat, step: int) -> None: ...
    def restore(self, state: MutableMapping[str, Any]) -> int | None: ...
    def wait(self) -> None: ...


class _State:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.pid = -1
        self.attempt: tuple[str, ...] = ()
        self.session: _Session | None = None
        self.options: Options | None = None
        self.report = Reporter()
        self.last_step: int | None = None


_STATE = _State()


def _options() -> Options:
    if _STATE.options is None:
        _STATE.options = Options.from_env(os.environ)
    return _STATE.options


def _attempt() -> tuple[str, ...]:
    """Which attempt of the job this process works in: an in-process restart
    (``@rallypoint.restartable``) gives a kept process a new restart count and store."""
    env = os.environ
    return tuple(env.get(k, "") for k in (envvars.RESTART_COUNT, "MASTER_ADDR", "MASTER_PORT"))


def current_session() -> _Session:
    """This process's session (made on first use; a forked child makes its own, and so
    does a process kept across an in-process restart)."""
    with _STATE.lock:
        attempt = _attempt()
        if _STATE.session is not None and _STATE.pid == os.getpid() and _STATE.attempt != attempt:
            _STATE.session.close()  # the previous attempt's, in this process
            _STATE.session, _STATE.last_step = None, None
        if _STATE.session is None or _STATE.pid != os.getpid():
            if _STATE.pid != os.getpid():
                _STATE.report = Reporter()
                _STATE.last_step = None
            _STATE.pid, _STATE.attempt = os.getpid(), attempt
            _STATE.session = _make_session(_options(), _STATE.report)
            _STATE.session.configure(_options())
        return _STATE.session


def _make_session(options: Options, report: Reporter) -> _Session:
    from rallypoint._snapshot._local import LocalSession

    path = os.environ.get(envvars.SNAPSHOT_SOCKET, "")
    needed = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    if not path or any(not os.environ.get(name) for name in needed):
        return LocalSession(options, report)
    try:
        from rallypoint._snapshot._node import NodeSession

        return NodeSession(path, options, report)
    except Exception as exc:
        why = (
            f"cannot use this node's snapshot server ({type(exc).__name__}: {exc}); "
            "keeping snapshots in this process's memory only"
        )
        return LocalSession(options, report, why)


def save(state: Mapping[str, Any], *, step: int) -> None:
    """Snapshot ``state`` as of ``step``; returns once its tensors are staged.

    ``state`` maps names to objects with ``state_dict()``/``load_state_dict()`` (modules,
    optimizers, schedulers, samplers), tensors, or picklable values. Copying to the replica
    and persisting (``--snapshot-dir``) go on in the background. Steps must increase.
    Raises ``TypeError``/``ValueError`` for bad input only; anything else is reported
    once on stderr and training goes on.
    """
    check_int(step, "step", minimum=0)
    with _STATE.lock:
        session = current_session()
        last = _STATE.last_step
        if last is not None and step <= last:
            raise ValueError(
                f"step must increase from one save to the next: got {step} after {last}"
            )
        flat = flatten(state)
        session.save(flat, step)
        _STATE.last_step = step


def restore(state: MutableMapping[str, Any]) -> int | None:
    """Load the newest snapshot that every rank has into ``state`` (in place).

    Returns its step, or ``None`` when there is none (a fresh start, or a world that the
    snapshots cannot be mapped onto: then a message says why). Every rank of the job must
    call it (it is an agreement); call it before the first ``save``.
    """
    check_state(state, "restore")
    if not isinstance(state, MutableMapping):
        raise TypeError("restore: state must be a mutable mapping (a dict)")
    check_restorable(state)
    with _STATE.lock:
        step = current_session().restore(state)
        _STATE.last_step = step
        return step


def configure(
    *, dir: Any = UNSET, every: Any = UNSET, timeout: Any = UNSET, resume_from: Any = UNSET
) -> None:
    """Change this process's snapshot options (each one given; the others stay).

    ``dir``: persist every ``every``-th snapshot there with torch.distributed.checkpoint
    (``None``: do not persist); ``--snapshot-dir`` sets it for every worker. ``every``:
    K >= 1 (``--snapshot-every``, default 10). ``timeout``: seconds (or a ``timedelta``)
    to wait for the other ranks, default 300. ``resume_from``
    (``--snapshot-resume-from``): which checkpoints in ``dir`` a restore reads besides
    this job's own: ``None`` (those of jobs that ended, never a live job's), ``"none"``
    (only this job's), a run id, or a path (a checkpoint or a job's namespace).
    """
    options = _options().update(dir=dir, every=every, timeout=timeout, resume_from=resume_from)
    with _STATE.lock:
        _STATE.options = options
        if _STATE.session is not None and _STATE.pid == os.getpid():
            _STATE.session.configure(options)


def wait() -> None:
    """Block until the last ``save`` is complete on every rank (and on its replica node),
    and a checkpoint being persisted is written."""
    with _STATE.lock:
        if _STATE.session is not None and _STATE.pid == os.getpid():
            _STATE.session.wait()
