"""``numa_binding``: each worker runs on the CPUs near its GPU, as with torchrun's
``--numa-binding``.

torch decides which CPUs (``torch.numa.binding``), but asking a GPU for its PCI address
initialises CUDA, which neither the warm process (its forked children could not use CUDA)
nor a worker before the user's code may do. So the launcher checks, without CUDA, that
the node has a GPU for every local rank (:func:`check_numa_binding`); the warm process
forks a short-lived child that runs torch's computation once per launch
(``_warm._numa_probe``); and each worker binds itself to its set first thing after the
fork (:func:`bind_to_cpus`), so that a worker that execs keeps it too.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

__all__ = ["NUMA_MODES", "bind_to_cpus", "check_numa_binding", "cpu_ranges", "visible_gpu_count"]

NUMA_MODES = ("node", "socket", "exclusive", "core-complex")
"""torch's ``AffinityMode`` values, the choices of ``--numa-binding`` (torch is not imported
here: the launcher never imports it)."""


def visible_gpu_count(visible: str | None, dev: str = "/dev") -> int:
    """How many GPUs a worker would see, found without torch or CUDA: NVIDIA's device nodes
    (``/dev/nvidia0``, ...), cut to the list in ``CUDA_VISIBLE_DEVICES`` (``visible``), which
    ends, as CUDA reads it, at its first empty or negative entry."""
    try:
        present = sum(1 for name in os.listdir(dev) if name[:6] == "nvidia" and name[6:].isdigit())
    except OSError:
        present = 0
    if visible is None:
        return present
    listed = 0
    for entry in visible.split(","):
        if not entry.strip() or entry.strip().startswith("-"):
            break
        listed += 1
    return min(present, listed)


def check_numa_binding(mode: object, nproc: int, visible: str | None, dev: str = "/dev") -> None:
    """``ValueError`` unless ``mode`` is one of :data:`NUMA_MODES` and this node has a GPU for
    each of its ``nproc`` local ranks (``visible``: the workers' ``CUDA_VISIBLE_DEVICES``)."""
    if not isinstance(mode, str) or mode not in NUMA_MODES:
        choices = ", ".join(repr(m) for m in NUMA_MODES)
        raise ValueError(f"numa_binding must be one of {choices} or None, got {mode!r}")
    gpus = visible_gpu_count(visible, dev)
    if gpus == 0:
        hidden = visible is not None and visible_gpu_count(None, dev) > 0
        why = (
            f"CUDA_VISIBLE_DEVICES={visible!r} hides every GPU of this node"
            if hidden
            else "this node has no GPU"
        )
        raise ValueError(
            f"NUMA binding ({mode!r}) puts each worker on the CPUs near its GPU, but {why}"
        )
    if nproc > gpus:
        raise ValueError(
            f"NUMA binding ({mode!r}) puts local rank N on the CPUs near GPU N, but this node "
            f"shows {gpus} GPU{'s' if gpus != 1 else ''} for {nproc} workers; start at most "
            f"{gpus} (--nproc-per-node gpu)"
        )


def cpu_ranges(cpus: Iterable[int]) -> str:
    """``{0, 1, 2, 5}`` -> ``"0-2,5"`` (the form of ``numactl`` and ``/sys``)."""
    spans: list[list[int]] = []
    for cpu in sorted(cpus):
        if spans and spans[-1][1] == cpu - 1:
            spans[-1][1] = cpu
        else:
            spans.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def bind_to_cpus(cpus: frozenset[int]) -> None:
    """Bind this freshly forked worker to ``cpus``, or exit 70 with one line saying why.

    Just after the fork the worker has one thread (``fork`` copies only the caller), so
    setting the process's affinity binds every thread it will start, as torch's
    ``_bind_all_threads_in_current_process_to_logical_cpus`` does for a running process.
    """
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as exc:
        os.write(
            2,
            f"rallypoint: --numa-binding: cannot bind this worker to CPUs {cpu_ranges(cpus)}: "
            f"{exc.strerror or exc}\n".encode(),
        )
        os._exit(70)
