"""The environment of a worker: the launcher's, the job's extras, and what torchrun sets."""

from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path

from rallypoint._core import envvars
from rallypoint._supervise._options import WorkerOptions, visible_gpus
from rallypoint._supervise._output import write_console
from rallypoint._supervise._state import GroupInfo

__all__ = [
    "STANDBY_UNSET",
    "base_env",
    "spare_env",
    "standby_env",
    "user_rpc_secret",
    "worker_env",
]

STANDBY_UNSET = (
    "RANK", "GROUP_RANK", "ROLE_RANK", "WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE",
    "MASTER_ADDR", "MASTER_PORT", envvars.RESTART_COUNT,
)  # fmt: skip
"""What a hot spare's workers do not know until they are given ranks."""

_OMP_WARNING = (
    "\n*****************************************\n"
    "Setting OMP_NUM_THREADS environment variable for each process to be 1 in default, "
    "to avoid your system being overloaded, please further tune the variable for optimal "
    "performance in your application as needed. \n"
    "*****************************************\n"
)


def base_env(
    workers: WorkerOptions, *, warn_omp: bool, signals_to_handle: tuple[str, ...] = ()
) -> dict[str, str]:
    """What every worker of this node starts from, the same for every attempt.

    The launcher's environment and ``env``; ``OMP_NUM_THREADS=1`` with several workers (with
    torchrun's warning when ``warn_omp``); ``TORCHELASTIC_SIGNALS_TO_HANDLE`` (the signals
    the launcher forwards, as torch's launcher sets it); an RPC secret (the user's, or a
    generated one that a multi-node job replaces by the run's, see :func:`worker_env`);
    ``PYTHONPATH`` for spawned interpreters so they import what this process imports.
    """
    env = dict(os.environ)
    if signals_to_handle:
        env[envvars.SIGNALS_TO_HANDLE] = ",".join(signals_to_handle)
    env.update(workers.env)
    if "OMP_NUM_THREADS" not in env and workers.nproc > 1:
        if warn_omp:
            write_console(2, _OMP_WARNING.encode())
        env["OMP_NUM_THREADS"] = "1"
    env.setdefault(envvars.RPC_SECRET, secrets.token_hex(32))
    if workers.start_method == "spawn":
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    return env


def user_rpc_secret(workers: WorkerOptions) -> bool:
    """Whether the user set ``RALLYPOINT_RPC_SECRET`` (then no node replaces it)."""
    return bool(workers.env.get(envvars.RPC_SECRET) or os.environ.get(envvars.RPC_SECRET))


def worker_env(
    base: dict[str, str],
    group: GroupInfo,
    *,
    local_rank: int,
    workers: WorkerOptions,
    error_file: Path,
) -> dict[str, str]:
    """``base`` plus the variables torchrun sets for ``local_rank`` in ``group``."""
    env = dict(base)
    rank = group.rank_offset + local_rank
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(local_rank),
        GROUP_RANK=str(group.group_rank),
        ROLE_RANK=str(rank),
        ROLE_NAME=workers.role,
        LOCAL_WORLD_SIZE=str(workers.nproc),
        WORLD_SIZE=str(group.world_size),
        GROUP_WORLD_SIZE=str(group.group_world_size),
        ROLE_WORLD_SIZE=str(group.world_size),
        MASTER_ADDR=group.master_addr,
        MASTER_PORT=str(group.master_port),
        TORCHELASTIC_MAX_RESTARTS=str(group.max_restarts),
        TORCH_NCCL_ASYNC_ERROR_HANDLING=base.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
    )
    if group.rpc_secret:  # one secret for the whole job, from the run's store
        env[envvars.RPC_SECRET] = group.rpc_secret
    env[envvars.LOCAL_RANK] = str(local_rank)
    if workers.virtual_local_rank:  # torch's agent: one GPU per worker, seen as device 0
        env["LOCAL_RANK"] = "0"
        gpus = visible_gpus(base.get("CUDA_VISIBLE_DEVICES"), workers.nproc)
        env["CUDA_VISIBLE_DEVICES"] = gpus[local_rank]
    env[envvars.RESTART_COUNT] = str(group.restart_count)
    env[envvars.RUN_ID] = group.run_id
    env[envvars.USE_AGENT_STORE] = "True"
    env[envvars.ERROR_FILE] = str(error_file)
    return env


def standby_env(env: dict[str, str]) -> dict[str, str]:
    """A worker's environment as a hot spare: no ranks and no store yet (:data:`STANDBY_UNSET`),
    and ``RALLYPOINT_STANDBY`` set, so that its restartable function waits for them."""
    out = {k: v for k, v in env.items() if k not in STANDBY_UNSET}
    out[envvars.STANDBY] = "1"
    return out


SPARE_UNSET = ("LOCAL_RANK", envvars.LOCAL_RANK, envvars.PROGRESS_SLOT)
"""What a spare worker does not know either: which local rank it will take."""


def spare_env(env: dict[str, str]) -> dict[str, str]:
    """A spare worker's environment (``--spare-workers``): a hot spare's, without a local
    rank (:data:`SPARE_UNSET`) until it takes a replaced rank's place."""
    return {k: v for k, v in standby_env(env).items() if k not in SPARE_UNSET}
