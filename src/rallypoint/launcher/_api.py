"""``rallypoint.launch``: run a Python function in N local workers and collect the results."""

from __future__ import annotations

import importlib
import pickle
import uuid
from collections.abc import Callable
from typing import Any

from rallypoint.launcher._config import LaunchConfig

__all__ = ["launch"]


def launch(fn: Callable[..., Any], *args: Any, nproc: int = 1, **options: Any) -> list[Any]:
    """Run ``fn(*args)`` in ``nproc`` workers and return their return values by local rank.

    Each worker gets the environment torchrun sets (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT``, ...), so ``torch.distributed.init_process_group()``
    works unchanged. ``options`` are the fields of :class:`LaunchConfig`. By default the
    workers are forked from a copy of the calling process (which already holds ``fn`` and
    has imported torch); ``start_method="spawn"`` starts fresh interpreters instead, and
    then ``fn`` and ``args`` must pickle.

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
    try:
        config = LaunchConfig(nproc=nproc, **options)
    except TypeError as exc:
        if "unexpected keyword argument" in str(exc):
            fields = ", ".join(sorted(LaunchConfig.__dataclass_fields__))
            raise TypeError(f"launch(): {exc}; LaunchConfig fields are: {fields}") from None
        raise
    if config.parallel is not None:
        distributed = importlib.import_module("rallypoint.distributed")
        if not hasattr(distributed, "parallel_worker"):
            raise NotImplementedError("rallypoint.distributed.parallel_worker is not available")
        # validates the layout here, before any worker starts
        fn = distributed.parallel_worker(fn, config.parallel)
    if config.start_method == "spawn":
        try:
            pickle.dumps((fn, args))
        except Exception as exc:
            raise TypeError(
                f"start_method='spawn' needs a picklable fn and args (define fn at module "
                f"level, or use start_method='fork'): cannot pickle {fn!r}: {exc}"
            ) from exc

    from rallypoint.launcher._agent import Agent
    from rallypoint.launcher._warm import WarmProcess
    from rallypoint.launcher._worker import CALLABLES, Target

    key = uuid.uuid4().hex
    CALLABLES[key] = (fn, tuple(args))
    try:
        warm = WarmProcess.fork(import_torch=True)
        try:
            name = getattr(fn, "__qualname__", type(fn).__name__)
            kind = Agent
            if config.multi_node:
                from rallypoint.launcher._elastic import ElasticAgent

                kind = ElasticAgent
            agent = kind(
                config, Target("callable", key), warm, title=f"launch({name})", collect_results=True
            )
            return agent.run()
        finally:
            warm.close()
    finally:
        CALLABLES.pop(key, None)
