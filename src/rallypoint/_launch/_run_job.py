"""Run one job on this node: the observer, the supervisor, and the coordinator that owns it.

Shared by :func:`~rallypoint.launcher.launch` and ``rallypoint run``: one restart loop
(:class:`~rallypoint._elastic._coordinator.Coordinator`) on a world of its own for a
single-node launch, or through the rendezvous for a multi-node one (imported only then).
"""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile
import uuid
from collections.abc import Mapping
from dataclasses import replace
from datetime import timedelta
from typing import Any

from rallypoint._core import envvars
from rallypoint._core.status import JobStatus
from rallypoint._core.tempdirs import mark_owned, remove_stale
from rallypoint._elastic._coordinator import Coordinator, Membership
from rallypoint._elastic._health._check_run import HealthContext
from rallypoint._elastic._health._checks import HealthChecks
from rallypoint._elastic._job import stop_on_signal
from rallypoint._elastic._one_node import OneNode
from rallypoint._launch._config import LaunchConfig
from rallypoint._snapshot._snapshot_dir import live_problem, resume_problem
from rallypoint._supervise._env import user_rpc_secret
from rallypoint._supervise._errors import LaunchInterruptedError
from rallypoint._supervise._signals import SignalQueue
from rallypoint._supervise._supervisor import Supervisor, prepare_warm
from rallypoint._supervise._warm._process import WarmProcess
from rallypoint._supervise._warm._snapshots import socket_parent
from rallypoint._supervise._worker import Target
from rallypoint._watch._observer import Observer

__all__ = ["run_job"]


def run_job(
    config: LaunchConfig,
    target: Target,
    warm: WarmProcess,
    *,
    title: str,
    collect_results: bool = False,
    warn_omp: bool = False,
) -> list[Any]:
    """Run the job to its end; returns this node's per-rank results (``None`` for scripts).

    Writes ``job_end`` to the event log however it ends. Waits for the warm process's
    imports first, so that it can clean up after this process from the moment anything
    temporary exists (``_supervise._warm._server``).
    """
    run_id = config.world.run_id or uuid.uuid4().hex[:12]
    _check_snapshots(config, run_id)
    # what launches killed with their whole process group left (never a live one's)
    remove_stale([tempfile.gettempdir(), socket_parent()])
    with SignalQueue(config.stop.signal_numbers) as signals:
        # what a replacement or a spare would import, once idle: only where one can come
        prepare_warm(warm, config.workers.preload, signals, later=config.forks_workers_later)
        return _run(config, target, warm, signals, run_id, title, collect_results, warn_omp)


def _run(
    config: LaunchConfig,
    target: Target,
    warm: WarmProcess,
    signals: SignalQueue,
    run_id: str,
    title: str,
    collect_results: bool,
    warn_omp: bool,
) -> list[Any]:
    status, code = JobStatus.FAILED, 1
    with Observer(nproc=config.workers.nproc, watch=config.watch, node=socket.gethostname()) as obs:
        for path in obs.temp_paths():  # its stacks directory, removed by a later launch
            if os.path.isdir(path):  # should this one be killed with its process group
                mark_owned(path)
        try:
            with Supervisor(
                warm,
                target,
                workers=config.workers,
                output=config.output,
                stop=config.stop,
                observer=obs,
                run_id=run_id,
                collect_results=collect_results,
                warn_omp=warn_omp,
                signals=signals,
            ) as supervisor:
                results = _coordinator(config, supervisor, obs, run_id, title).run()
            status, code = JobStatus.SUCCEEDED, 0
            return results
        except LaunchInterruptedError as exc:
            status, code = JobStatus.INTERRUPTED, 128 + exc.signum
            raise
        finally:
            with contextlib.suppress(Exception):
                obs.emit("job_end", status=status, exitcode=code)


def _snapshot_setting(config: LaunchConfig, name: str) -> str:
    """A snapshot setting of the workers (``launch(env=...)``, the CLI's, or inherited)."""
    return config.workers.env.get(name, os.environ.get(name, ""))


def _check_snapshots(config: LaunchConfig, run_id: str) -> None:
    """Before any worker starts, else one line (``ValueError``): no live job with this
    one-node job's ``--rdzv-id`` writes ``--snapshot-dir`` (it would restore that job's
    checkpoints), and ``--snapshot-resume-from`` names a job or a path that offers a
    checkpoint that loads, and not a live job."""
    directory = _snapshot_setting(config, envvars.SNAPSHOT_DIR)
    if not directory:
        return
    root = os.path.abspath(directory)
    why = ""
    if config.world.run_id and not config.rendezvous.multi_node:
        why = live_problem(root, run_id)
    resume_from = _snapshot_setting(config, envvars.SNAPSHOT_RESUME_FROM)
    if resume_from and not why:
        why = resume_problem(root, resume_from, run_id)
    if why:
        raise ValueError(why)


def _health(config: LaunchConfig, supervisor: Supervisor, observer: Observer) -> HealthChecks:
    """This node's ``health_check`` list; ``builtin:disk`` looks at the log, snapshot and
    temp directories (the coordinator gives ``builtin:store`` its store)."""
    dirs = []
    if config.output.log_dir:
        dirs.append(("--log-dir", os.path.abspath(config.output.log_dir)))
    snapshots = _snapshot_setting(config, envvars.SNAPSHOT_DIR)
    if snapshots:
        dirs.append(("--snapshot-dir", os.path.abspath(snapshots)))
    dirs.append(("the temp dir", tempfile.gettempdir()))
    context = HealthContext(
        directories=tuple(dirs),
        poll=lambda: stop_on_signal(supervisor.next_signal(), "a health check"),
        env=dict(config.workers.env),
    )
    return HealthChecks(config.health, context, observer)


def _coordinator(
    config: LaunchConfig, supervisor: Supervisor, observer: Observer, run_id: str, title: str
) -> Coordinator:
    """The restart loop of this node, on a world of its own or through the rendezvous."""
    membership: Membership
    if not config.rendezvous.multi_node:
        world = config.world
        if config.rendezvous.local_addr is not None:  # as torchrun: this node's address
            world = replace(world, master_addr=config.rendezvous.local_addr)
        membership = OneNode(
            supervisor, observer, world=world, restarts=config.restarts, run_id=run_id
        )
    else:
        from rallypoint._elastic._rendezvous import connect
        from rallypoint._elastic._rendezvous_rounds import RendezvousRounds

        job_id = config.world.run_id or "none"
        membership = RendezvousRounds(
            supervisor,
            lambda: connect(config.rendezvous, job_id),
            observer,
            restarts=config.restarts,
            run_id=job_id,
            endpoint=config.rendezvous.endpoint,
            share_rpc_secret=not user_rpc_secret(config.workers),
            store_timeout=_read_timeout(config.rendezvous.conf),
            node=config.rendezvous.local_addr or "",
            min_nodes=config.rendezvous.min_nodes,
        )
    return Coordinator(
        supervisor,
        membership,
        observer,
        restarts=config.restarts,
        title=title,
        monitor_interval=config.stop.monitor_interval.total_seconds(),
        timeout=config.stop.timeout,
        health=_health(config, supervisor, observer),
    )


def _read_timeout(conf: Mapping[str, Any]) -> float:
    """``--rdzv-conf read_timeout=`` in seconds (the handler validates it when it connects)."""
    value = conf.get("read_timeout", 60.0)
    try:
        seconds = value.total_seconds() if isinstance(value, timedelta) else float(value)
    except (TypeError, ValueError):
        return 60.0
    return seconds if seconds > 0 else 60.0
