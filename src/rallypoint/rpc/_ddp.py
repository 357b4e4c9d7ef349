"""DDP modules in a distributed backward pass: their reducer all-reduces, as under torch.

Under torch, the distributed engine runs the hooks of a leaf's ``AccumulateGrad`` node
(where ``DistributedDataParallel``'s reducer listens) with the gradient it captures for
the context, and the reducer, seeing the thread's distributed autograd context, reads
and writes gradients there instead of ``.grad``: the context ends up with the
all-reduced, averaged gradients of the DDP parameters. rallypoint's engine captures leaf
gradients without running ``AccumulateGrad`` (:mod:`._autograd_engine`), so nothing
would reach the reducer: the replicas would silently train on their local gradients.
This module does the reducer's part, for the parameters of DDP modules only:

- Before a local pass that reaches a DDP parameter, every parameter of that module has
  its ``.grad`` set aside (``None``). A tensor hook on each reached one puts its gradient
  into ``.grad`` and calls the reducer's autograd hook (``Reducer._autograd_hook``, the
  entry DDP's own Python paths use). It runs inside the engine's run, so the reducer's
  final callback (all-reduce done, averaged gradients written to ``.grad``) runs before
  the pass returns.
- After the pass, the ``.grad`` of the module's parameters are the pass's leaf
  gradients for them (also those of parameters the reducer wrote that the pass did not
  reach), and every ``.grad`` gets back what it held: ``.grad`` is never changed.
- A reducer that did not finish in the pass (the module's gradients came in more than one
  local pass, or some never came) is an error that names the module.

DDP modules are found by one scan of the garbage collector's objects, the first time a
pass reaches an ``nn.Parameter`` that is not classified yet while a default process group
exists (DDP needs one); each parameter's class is then cached. A parameter first used
in a distributed backward and only *later* wrapped in DDP stays unclassified as DDP's.
"""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

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
    """Which parameters belong to a DDP module's reducer (found once, then cached)."""

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
        ddp_class = _ddp_class()
        verdicts: dict[type, bool] = {}
        for obj in gc.get_objects():
            kind = type(obj)
            verdict = verdicts.get(kind)
            if verdict is None:
                verdict = verdicts[kind] = issubclass(kind, ddp_class)
            if verdict and obj not in self._params:
                params = reducer_parameters(obj)
                self._params[obj] = params
                ref = weakref.ref(obj)
                for index, param in enumerate(params):
                    self._owner[param] = (ref, index)


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
        param.grad = torch.empty_like(param).copy_(grad)
    reducer._autograd_hook(index)


class DDPPass:
    """One local pass's dealings with DDP reducers: set up before, collected after."""

    def __init__(self, modules: dict[Any, list[int]]) -> None:
        self._modules = list(modules)
        self._saved: dict[torch.Tensor, torch.Tensor | None] = {}
        self._handles: list[Any] = []
        for ddp in modules:
            _check_supported(ddp)
        for ddp, indices in modules.items():
            params = INDEX.parameters(ddp)
            for param in params:
                self._saved[param] = param.grad
                param.grad = None
            for index in indices:
                hook = _hook(ddp.reducer, index, params[index])
                self._handles.append(params[index].register_hook(hook))  # type: ignore[no-untyped-call]

    @property
    def parameter_ids(self) -> set[int]:
        """``id()`` of every parameter of the modules (their gradients come from ``finish``)."""
        return {id(p) for p in self._saved}

    def restore(self) -> None:
        """Remove the hooks and give every ``.grad`` back what it held."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for param, grad in self._saved.items():
            param.grad = grad

    def finish(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The reduced gradients (as the pass's leaf gradients); ``.grad`` restored."""
        unfinished = []
        for ddp in self._modules:
            try:
                ddp.reducer._check_reducer_finalized()
            except RuntimeError:
                unfinished.append(ddp)
        reduced = [(p, p.grad) for p in self._saved if p.grad is not None]
        self.restore()
        if unfinished:
            raise RuntimeError(
                "distributed autograd: the reducer of DistributedDataParallel module "
                f"{type(unfinished[0].module).__name__} did not finish in the local pass that "
                "reached its parameters: all of a DDP module's gradients on a worker must "
                "come from one local pass of the distributed backward (torch's reducer "
                "fails the same way at the next iteration)"
            )
        return reduced


def _hook(reducer: Any, index: int, param: torch.Tensor) -> Any:
    def hook(grad: torch.Tensor) -> None:
        _fire(reducer, index, param, grad)

    return hook


def begin(leaves: Iterable[torch.Tensor]) -> DDPPass | None:
    """Set up the DDP reducers that a pass with these leaves reaches (``None``: none)."""
    modules = INDEX.modules_of(leaves)
    return DDPPass(modules) if modules else None


def check_direct(leaves: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """A DDP parameter sent as it is (its gradient arrives without a local pass)."""
    if INDEX.modules_of(leaf for leaf, _ in leaves):
        raise RuntimeError(
            "distributed autograd: a parameter of a DistributedDataParallel module was sent "
            "over RPC as it is; its reducer cannot run in a rallypoint distributed backward "
            "pass (send the result of a computation with it instead)"
        )
