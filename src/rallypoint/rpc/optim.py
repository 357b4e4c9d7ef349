"""``rallypoint.rpc.optim.DistributedOptimizer``: torch's ``DistributedOptimizer`` API.

Change ``from torch.distributed.optim import DistributedOptimizer`` to
``from rallypoint.rpc import DistributedOptimizer`` (also importable from here)::

    opt = DistributedOptimizer(torch.optim.SGD, param_rrefs, lr=0.05)
    with dist_autograd.context() as context_id:
        dist_autograd.backward(context_id, [loss])
        opt.step(context_id)

The constructor creates one local optimizer on every worker that owns parameters (over
RPC, concurrently); ``step(context_id)`` applies that context's gradients (from
``dist_autograd.get_gradients``) on every owner concurrently and returns when all are
done. As in torch, the optimizers torch has functional versions of (SGD, Adam, AdamW,
Adagrad, Adadelta, RMSprop, Rprop, Adamax) run their functional version (the same
update); any other ``torch.optim.Optimizer`` gets the gradients in ``.grad`` and its
``step()`` is called, one step at a time per worker. torch compiles the functional
optimizers with TorchScript to escape the GIL of its C++ threads; rallypoint runs them
as Python, which computes the same update. Under ``BackendType.TENSORPIPE`` this class
is torch's ``DistributedOptimizer``.
"""

from __future__ import annotations

import importlib
import itertools
import warnings
import weakref
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from rallypoint._core.forking import fork_safe_lock
from rallypoint.rpc import dist_autograd
from rallypoint.rpc._backend import CURRENT_AGENT
from rallypoint.rpc._calls import rpc_async
from rallypoint.rpc._rref._rref import RRef
from rallypoint.rpc.constants import UNSET_RPC_TIMEOUT
from rallypoint.rpc.dist_autograd._autograd import CURRENT_AUTOGRAD

__all__ = ["DistributedOptimizer"]


def _functional_map() -> dict[Any, Any]:
    utils: Any = importlib.import_module("torch.distributed.optim.utils")
    found: dict[Any, Any] = utils.functional_optim_map
    return found


class _LocalOptimizer:
    """The optimizer of one owner's parameters (created there over RPC)."""

    # as in torch: steps of every local optimizer on a worker run one at a time
    lock = fork_safe_lock()

    def __init__(
        self,
        optim_cls: Any,
        functional: bool,
        params_rref: list[Any],
        *args: Any,
        **kwargs: Any,
    ) -> None:
        self._params = [rref.local_value() for rref in params_rref]
        self._functional = functional
        with warnings.catch_warnings():
            # torch's functional optimizers warn that TorchScript support is deprecated;
            # rallypoint does not script them. The warning is raised under torch's own
            # simplefilter("always"), which overrides any filter: drop it where it is shown
            warnings.showwarning = _without_torchscript_warning(warnings.showwarning)
            self.optim = optim_cls(self._params, *args, **kwargs)

    def step(self, context_id: int) -> None:
        grads = dist_autograd.get_gradients(context_id)
        with _LocalOptimizer.lock:
            if self._functional:
                self.optim.step([grads.get(p) for p in self._params])
                return
            for param, grad in grads.items():
                param.grad = grad
            self.optim.step()


def _without_torchscript_warning(show: Callable[..., Any]) -> Callable[..., Any]:
    def showing(message: Any, category: Any, *args: Any, **kwargs: Any) -> Any:
        if issubclass(category, DeprecationWarning) and "`TorchScript` support" in str(message):
            return None
        return show(message, category, *args, **kwargs)

    return showing


# the local optimizers of this worker, by key, alive as long as their RRef's owner entry:
# a step names its optimizer by key, so it carries no RRef to fork (two fewer messages)
_LOCAL: weakref.WeakValueDictionary[int, _LocalOptimizer] = weakref.WeakValueDictionary()
_KEYS = itertools.count()


def _new_local_optimizer(
    optim_cls: Any, functional: bool, params_rref: list[Any], *args: Any, **kwargs: Any
) -> tuple[RRef[_LocalOptimizer], int]:
    local = _LocalOptimizer(optim_cls, functional, params_rref, *args, **kwargs)
    key = next(_KEYS)
    _LOCAL[key] = local
    return RRef(local), key


def _local_optimizer_step(key: int, context_id: int) -> None:
    local = _LOCAL.get(key)
    if local is None:
        raise RuntimeError(
            "the local optimizer of this DistributedOptimizer is gone from this worker "
            "(RPC was restarted since it was created)"
        )
    local.step(context_id)


def _wait_for_all(futures: list[torch.futures.Future[Any]]) -> list[Any]:
    """Every result; the last error is raised after all futures completed (torch's rule)."""
    error: BaseException | None = None
    results: list[Any] = []
    for future in futures:
        try:
            results.append(future.wait())
        except Exception as exc:
            results.append(exc)
            error = exc
    if error is not None:
        raise error
    return results


class DistributedOptimizer:
    """torch's ``DistributedOptimizer(optimizer_class, params_rref, *args, **kwargs)``.

    ``params_rref`` lists ``RRef``\\ s to parameters (local or remote); ``args`` and
    ``kwargs`` go to ``optimizer_class`` on each owner. ``remote_optimizers`` holds an
    ``RRef`` to each owner's local optimizer.
    """

    def __init__(self, optimizer_class: Any, params_rref: Any, *args: Any, **kwargs: Any) -> None:
        self._torch: Any = None
        self.remote_optimizers: list[Any]
        if CURRENT_AUTOGRAD.peek() is None and CURRENT_AGENT.peek() is not None:
            optim: Any = importlib.import_module("torch.distributed.optim")
            self._torch = optim.DistributedOptimizer(optimizer_class, params_rref, *args, **kwargs)
            self.remote_optimizers = self._torch.remote_optimizers
            return
        per_worker: dict[Any, list[Any]] = defaultdict(list)
        for param in params_rref:
            per_worker[param.owner()].append(param)
        functional = _functional_map().get(optimizer_class)
        ctor = optimizer_class if functional is None else functional
        futures = [
            rpc_async(
                worker,
                _new_local_optimizer,
                args=(ctor, functional is not None, rrefs, *args),
                kwargs=kwargs,
            )
            for worker, rrefs in per_worker.items()
        ]
        created = _wait_for_all(futures)
        self.remote_optimizers = [rref for rref, _ in created]
        self._keys = [(rref.owner(), key) for rref, key in created]

    def step(self, context_id: int) -> None:
        """One optimizer step on every owner with the gradients of context ``context_id``."""
        if self._torch is not None:
            self._torch.step(context_id)
            return
        dist_autograd._is_valid_context(context_id)
        calls = [(owner, _local_optimizer_step, (key, context_id)) for owner, key in self._keys]
        _wait_for_all(CURRENT_AGENT.get().rpc_all(calls, UNSET_RPC_TIMEOUT))
