"""The CPUs each local rank binds to under ``numa_binding``, found by torch in a throwaway child.

:func:`find_cpu_sets` runs in the warm process, which must never initialise CUDA (see
``_supervise._numa``). It forks a child that takes the workers' environment (their
``CUDA_VISIBLE_DEVICES`` and ``CUDA_DEVICE_ORDER`` decide which GPU is index N), runs
``torch.numa.binding``'s own computation for GPU ``local_rank`` of every local rank, as
torchrun does for its workers, sends the sets back on a pipe and exits. The child starts
CUDA; the warm process only reads a pipe. torch's affinity rules intersect with the CPUs
this process may use, which the workers forked from it inherit.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import time
from typing import Any, NoReturn

from rallypoint._core.procs import set_parent_death_signal

__all__ = ["NumaProbeError", "find_cpu_sets"]

PROBE_TIMEOUT = 45.0
"""Seconds the child may take (it initialises CUDA; below the supervisor's reply timeout)."""


class NumaProbeError(Exception):
    """torch could not say which CPUs a local rank binds to; the message is one line."""


def find_cpu_sets(
    mode: str, nproc: int, env: dict[str, str], timeout: float = PROBE_TIMEOUT
) -> tuple[frozenset[int], ...]:
    """The CPU set of each local rank ``0..nproc-1`` under torch's affinity ``mode``."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child never returns here
        os.close(read_end)
        _child(mode, nproc, env, write_end)
    os.close(write_end)
    try:
        data = _read_all(read_end, time.monotonic() + timeout)
    finally:
        os.close(read_end)
        _end(pid)
    if data is None:
        raise NumaProbeError(f"torch did not find the GPUs' CPUs within {timeout:.0f} s")
    try:
        answer = json.loads(data)
    except ValueError:
        raise NumaProbeError("the NUMA probe died before it answered") from None
    if "error" in answer:
        raise NumaProbeError(str(answer["error"]))
    return tuple(frozenset(int(c) for c in cpus) for cpus in answer["cpus"])


def _read_all(fd: int, deadline: float) -> bytes | None:
    """Everything written to ``fd`` until its writer closes it; ``None`` past ``deadline``."""
    chunks: list[bytes] = []
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return None
        chunk = os.read(fd, 65536)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def _end(pid: int) -> None:
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)


def _child(mode: str, nproc: int, env: dict[str, str], fd: int) -> NoReturn:
    code = 1
    try:
        set_parent_death_signal(signal.SIGKILL)
        signal.set_wakeup_fd(-1)  # the warm process's wake-up pipe is not this child's
        devnull = os.open(os.devnull, os.O_WRONLY)  # torch's warnings: the answer says it
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        os.environ.clear()
        os.environ.update(env)  # read by CUDA when it starts, below
        try:
            answer: dict[str, Any] = {"cpus": [sorted(s) for s in _compute(mode, nproc)]}
        except Exception as exc:
            answer = {"error": str(exc)}
        data = memoryview(json.dumps(answer).encode())
        while data:
            data = data[os.write(fd, data) :]
        code = 0
    finally:
        os._exit(code)


def _compute(mode: str, nproc: int) -> list[set[int]]:
    """torch's sets (what torchrun hands ``numactl --physcpubind``) for GPUs ``0..nproc-1``."""
    import torch
    from torch.numa.binding import AffinityMode, NumaOptions, _get_logical_cpus_to_bind_to

    options = NumaOptions(affinity_mode=AffinityMode(mode))
    gpus = torch.cuda.device_count()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if gpus < nproc:
        shown = "" if visible is None else f" (CUDA_VISIBLE_DEVICES={visible!r})"
        raise RuntimeError(
            f"NUMA binding ({mode!r}) needs a GPU per local rank: torch sees {gpus} GPU"
            f"{'s' if gpus != 1 else ''}{shown} for {nproc} worker{'s' if nproc != 1 else ''}"
        )
    sets = []
    for local_rank in range(nproc):
        try:
            cpus = _get_logical_cpus_to_bind_to(gpu_index=local_rank, numa_options=options)
        except Exception as exc:
            text = " ".join(f"{type(exc).__name__}: {exc}".split())
            raise RuntimeError(
                f"NUMA binding ({mode!r}): no CPUs found for local rank {local_rank}: {text}"
            ) from None
        if not cpus:  # torch's own check
            raise RuntimeError(
                f"NUMA binding ({mode!r}): local rank {local_rank} may use none of the CPUs "
                f"near GPU {local_rank}"
            )
        sets.append(cpus)
    return sets
