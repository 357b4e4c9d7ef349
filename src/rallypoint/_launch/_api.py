"""``rallypoint.launch``: run a Python function in N local workers and collect the results."""

from __future__ import annotations

import os
import pickle
import sys
import uuid
import warnings
from collections.abc import Callable
from typing import Any

from rallypoint._launch._config import OPTION_NAMES, LaunchConfig

__all__ = ["launch"]


def launch(fn: Callable[..., Any], *args: Any, **options: Any) -> list[Any]:
    """Run ``fn(*args)`` in ``nproc`` workers and return their return values by local rank.

    Each worker gets the environment torchrun sets (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT``, ...), so ``torch.distributed.init_process_group()``
    works unchanged. ``options`` are the options of :class:`LaunchConfig` (``nproc=1`` by
    default). By default the workers are forked from a copy of the calling process (which
    already holds ``fn`` and has imported torch); ``start_method="spawn"`` starts fresh
    interpreters instead, and then ``fn`` and ``args`` must pickle.

    With ``nnodes`` above 1 (and ``rdzv_endpoint``), this call is one node of an elastic
    job (see ``docs/multinode.md``) and returns this node's results of the last round.

    Raises :class:`WorkerFailedError` naming the first failed rank with its remote
    traceback (the original exception, when it pickles, is its ``__cause__``),
    ``ValueError``/``TypeError`` for bad options.
    """
    if not callable(fn):
        raise TypeError(f"launch() needs a callable as its first argument, got {fn!r}")
    if "config" in options:
        raise TypeError("pass LaunchConfig fields as keyword arguments, not config=")
    unknown = sorted(set(options) - OPTION_NAMES)
    if unknown:
        raise TypeError(
            f"launch() got an unexpected keyword argument {unknown[0]!r}; "
            f"LaunchConfig fields are: {', '.join(sorted(OPTION_NAMES))}"
        )
    config = LaunchConfig(**options)
    if _forked_workers_would_hang(config):
        warnings.warn(_OPENMP_WARNING, RuntimeWarning, stacklevel=2)
        options["env"] = {**config.env, "OMP_NUM_THREADS": "1"}
        config = LaunchConfig(**options)
    fn = _wrap_parallel(fn, config)
    if config.start_method == "spawn":
        try:
            pickle.dumps((fn, args))
        except Exception as exc:
            raise TypeError(
                f"start_method='spawn' needs a picklable fn and args (define fn at module "
                f"level, or use start_method='fork'): cannot pickle {fn!r}: {exc}"
            ) from exc
    return _run(fn, tuple(args), config)


_OPENMP_WARNING = (
    "rallypoint.launch: this process ran a parallel torch CPU op before launch(), so its "
    "OpenMP threads exist, and GNU OpenMP is not fork-safe: a forked worker would hang in "
    "its first parallel op. The workers run with OMP_NUM_THREADS=1 instead. To keep more "
    "intra-op threads, call launch() before running torch ops, or pass "
    "start_method='spawn'."
)


def _forked_workers_would_hang(config: LaunchConfig) -> bool:
    """Whether forked workers would use more than one intra-op thread, and a probe child
    forked now hangs in a parallel op (see :mod:`rallypoint._supervise._warm._fork_probe`)."""
    from rallypoint._supervise._warm._fork_probe import openmp_survives_fork

    torch = sys.modules.get("torch")
    if config.start_method != "fork" or torch is None:
        return False
    setting = config.env.get("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS"))
    if setting is not None:
        threads = int(setting) if setting.isdigit() else 1
    else:
        threads = 1 if config.nproc > 1 else int(torch.get_num_threads())
    return not openmp_survives_fork(threads)


def _wrap_parallel(fn: Callable[..., Any], config: LaunchConfig) -> Callable[..., Any]:
    if config.parallel is None:
        return fn
    from rallypoint.distributed import parallel_worker

    wrapped: Callable[..., Any] = parallel_worker(fn, config.parallel)  # validates now
    return wrapped


def _run(fn: Callable[..., Any], args: tuple[Any, ...], config: LaunchConfig) -> list[Any]:
    from rallypoint._launch._run_job import run_job
    from rallypoint._supervise._warm._process import WarmProcess
    from rallypoint._supervise._worker import CALLABLES, Target

    key = uuid.uuid4().hex
    CALLABLES[key] = (fn, args)
    try:
        warm = WarmProcess.fork(import_torch=True)
        try:
            name = getattr(fn, "__qualname__", type(fn).__name__)
            target = Target("callable", key)
            return run_job(config, target, warm, title=f"launch({name})", collect_results=True)
        finally:
            warm.close()
    finally:
        CALLABLES.pop(key, None)
