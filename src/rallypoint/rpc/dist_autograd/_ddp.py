"""DDP modules in a distributed backward pass: their reducer all-reduces, as under torch.

Under torch the distributed engine runs the hooks of each leaf's ``AccumulateGrad`` node,
where ``DistributedDataParallel``'s reducer listens, and the reducer writes the
all-reduced gradients into the context. rallypoint's engine captures leaf gradients
without running that node, so without this module the replicas would silently train on
their local gradients. :class:`DDPRound` does the reducer's part for the parameters of DDP
modules only, leaving every ``.grad`` as it was; :class:`DDPIndex` finds which parameters
belong to a DDP module (through the garbage collector, once, then cached). A reducer that
has not finished when the round is settled is an error naming the module.
"""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from rallypoint.rpc.dist_autograd._ddp_groups import GROUPS

_Entry = tuple["weakref.ref[Any]", int]  # (the DDP module, the parameter's index in its reducer)


def _ddp_class() -> type:
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel


def reducer_parameters(ddp: Any) -> list[torch.nn.Parameter]:
    """The parameters of ``ddp``'s reducer, in the reducer's order (DDP's own rule)."""
    ignore = ddp.parameters_to_ignore
    found: list[torch.nn.Parameter] = []
    seen: set[torch.nn.Parameter] = set()
    for module_name, module in ddp.module.named_modules():
        for name, param in module.named_parameters(recurse=False):
            if param.requires_grad and f"{module_name}.{name}" not in ignore and param not in seen:
                seen.add(param)
                found.append(param)
    return found


class DDPIndex:
    """Which parameters belong to a DDP module's reducer (found once, then cached).

    DDP modules are found by asking the garbage collector which objects refer to the DDP
    classes, the first time a pass reaches an ``nn.Parameter`` not classified yet while a
    default process group exists. A parameter first used in a distributed backward and
    only later wrapped in DDP stays unclassified as DDP's.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # tensors compare elementwise: key them by identity
        self._owner: WeakIdKeyDictionary = WeakIdKeyDictionary()  # param -> _Entry
        self._params: weakref.WeakKeyDictionary[Any, list[torch.nn.Parameter]] = (
            weakref.WeakKeyDictionary()
        )
        self._plain: WeakIdKeyDictionary = WeakIdKeyDictionary()  # param -> None

    def modules_of(self, leaves: Iterable[torch.Tensor]) -> dict[Any, list[int]]:
        """The DDP modules that ``leaves`` belong to, with the reducer indices reached."""
        found: dict[Any, list[int]] = {}
        if not _process_group_exists():  # no DDP reducer can run: the common RPC-only case
            return found
        unknown: list[torch.Tensor] = []
        for leaf in leaves:
            entry = self._owner.get(leaf)  # type: ignore[no-untyped-call]
            if entry is None:
                if isinstance(leaf, torch.nn.Parameter) and leaf not in self._plain:
                    unknown.append(leaf)
                continue
            _add(found, entry)
        if unknown:
            with self._lock:
                self._scan()
                for leaf in unknown:
                    entry = self._owner.get(leaf)  # type: ignore[no-untyped-call]
                    if entry is None:
                        self._plain[leaf] = None
                    else:
                        _add(found, entry)
        return found

    def parameters(self, ddp: Any) -> list[torch.nn.Parameter]:
        return self._params[ddp]

    def _scan(self) -> None:
        for obj in live_instances(_ddp_class()):
            if obj not in self._params:
                params = reducer_parameters(obj)
                self._params[obj] = params
                ref = weakref.ref(obj)
                for index, param in enumerate(params):
                    self._owner[param] = (ref, index)


def live_instances(cls: type) -> list[Any]:
    """The live instances of ``cls`` and of its subclasses.

    They are the referrers of those classes that are instances of them: an instance of a
    Python class refers to its class for the garbage collector. Never
    ``gc.get_objects()``: its list holds a reference to every object, also to those that
    other threads are still building, and CPython fails such an object when the list
    lives across a thread switch (a tuple being filled from a generator raises
    ``SystemError: ... bad argument to internal function`` in the thread building it).
    The referrers' list holds only objects that refer to the classes.
    """
    classes: set[type] = {cls}
    pending: list[type] = [cls]
    while pending:
        sub: type
        for sub in pending.pop().__subclasses__():
            if sub not in classes:
                classes.add(sub)
                pending.append(sub)
    return [obj for obj in gc.get_referrers(*classes) if type(obj) in classes]


def _add(found: dict[Any, list[int]], entry: _Entry) -> None:
    ddp = entry[0]()
    if ddp is not None:
        found.setdefault(ddp, []).append(entry[1])


def _process_group_exists() -> bool:
    dist = torch.distributed
    return bool(dist.is_available() and dist.is_initialized())


INDEX = DDPIndex()


def _check_supported(ddp: Any) -> None:
    if getattr(ddp, "_use_python_reducer", False) or getattr(ddp, "mixed_precision", None):
        raise RuntimeError(
            f"distributed autograd: {type(ddp).__name__} with mixed precision or the Python "
            "reducer (compiled autograd) is not supported in a rallypoint distributed "
            "backward pass; use the default reducer"
        )


def _fire(reducer: Any, index: int, param: torch.Tensor, grad: torch.Tensor) -> None:
    """A reached DDP parameter's gradient: into ``.grad``, then the reducer's hook."""
    with torch.no_grad():
        if grad.is_sparse:  # an embedding's (sparse=True): the reducer reads it as it is
            param.grad = grad.detach().clone()
        else:
            param.grad = torch.empty_like(param).copy_(grad)
    reducer._autograd_hook(index)


class DDPRound:
    """One backward round's dealings with DDP reducers on this worker, over its local
    passes: a module's gradients may come in several passes (its output went through
    other workers and back, as when DDP wraps a model that calls remote modules), and
    its reducer finishes in the pass that brings the last of them.

    Before the first pass of the round that reaches a DDP parameter, every parameter of
    that module has its ``.grad`` set aside. A tensor hook on each reached one puts its
    gradient into ``.grad`` and calls the reducer's autograd hook
    (``Reducer._autograd_hook``), so the reducer's final callback (all-reduce done,
    averaged gradients in ``.grad``) runs before that pass returns. The ``.grad`` of the
    module's parameters are then the leaf gradients for them, and every ``.grad`` gets back
    what it held.
    """

    def __init__(self) -> None:
        self._saved: dict[torch.Tensor, torch.Tensor | None] = {}  # in-progress modules' params
        self._modules: dict[Any, list[Any]] = {}  # module in progress -> its hook handles
        self._hooked: set[tuple[int, int]] = set()  # (id(module), reducer index)

    def reach(self, modules: dict[Any, list[int]]) -> None:
        """Before a pass: hook the parameters it reaches (a new module's ``.grad`` set aside)."""
        for ddp, indices in modules.items():
            params = INDEX.parameters(ddp)
            handles = self._modules.get(ddp)
            if handles is None:
                _check_supported(ddp)
                GROUPS.keep(ddp)  # its group is let go from Python (see _ddp_groups)
                handles = self._modules[ddp] = []
                for param in params:
                    self._saved[param] = param.grad
                    param.grad = None
            for index in indices:
                if (id(ddp), index) not in self._hooked:
                    self._hooked.add((id(ddp), index))
                    hook = _hook(ddp.reducer, index, params[index])
                    handles.append(params[index].register_hook(hook))  # type: ignore[no-untyped-call]

    @property
    def parameter_ids(self) -> set[int]:
        """``id()`` of every parameter of the modules in progress (their gradients come
        from :meth:`collect`)."""
        return {id(p) for p in self._saved}

    def collect(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """After a pass: the reduced gradients of the modules whose reducer finished (as
        the pass's leaf gradients), their ``.grad`` given back what it held."""
        reduced: list[tuple[torch.Tensor, torch.Tensor]] = []
        for ddp in list(self._modules):
            try:
                ddp.reducer._check_reducer_finalized()
            except RuntimeError:
                continue
            params = INDEX.parameters(ddp)
            reduced.extend((p, p.grad) for p in params if p.grad is not None)
            self._drop(ddp)
        return reduced

    def unfinished(self) -> list[str]:
        """Class names of the modules whose reducer has not finished."""
        return [type(ddp.module).__name__ for ddp in self._modules]

    def restore(self) -> None:
        """Remove every hook and give every ``.grad`` back what it held."""
        for ddp in list(self._modules):
            self._drop(ddp)

    def _drop(self, ddp: Any) -> None:
        for handle in self._modules.pop(ddp):
            handle.remove()
        self._hooked = {key for key in self._hooked if key[0] != id(ddp)}
        for param in INDEX.parameters(ddp):
            if param in self._saved:
                param.grad = self._saved.pop(param)


def unfinished_error(names: list[str]) -> RuntimeError:
    return RuntimeError(
        "distributed autograd: the reducer of DistributedDataParallel module "
        f"{names[0]} did not finish by the end of the distributed backward pass: some of "
        "its parameters got no gradient (torch's reducer fails the same way at the next "
        "iteration; see find_unused_parameters)"
    )


def _hook(reducer: Any, index: int, param: torch.Tensor) -> Any:
    def hook(grad: torch.Tensor) -> None:
        _fire(reducer, index, param, grad)

    return hook


def modules_of(leaves: Iterable[torch.Tensor]) -> dict[Any, list[int]]:
    """The DDP modules a pass with these leaves reaches, with the reducer indices."""
    return INDEX.modules_of(leaves)


def check_direct(leaves: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """A DDP parameter sent as it is (its gradient arrives without a local pass)."""
    if INDEX.modules_of(leaf for leaf, _ in leaves):
        raise RuntimeError(
            "distributed autograd: a parameter of a DistributedDataParallel module was sent "
            "over RPC as it is; its reducer cannot run in a rallypoint distributed backward "
            "pass (send the result of a computation with it instead)"
        )
