"""``rallypoint.rpc.nn.RemoteModule``: torch's ``RemoteModule`` on either backend.

Change ``from torch.distributed.nn import RemoteModule`` to
``from rallypoint.rpc.nn import RemoteModule``::

    emb = RemoteModule("ps", nn.EmbeddingBag, args=(100, 16), kwargs={"mode": "sum"})
    out = emb.forward(indices, offsets)          # runs on "ps"; gradients flow back
    fut = emb.forward_async(indices, offsets)    # a Future of the same
    opt = DistributedOptimizer(optim.SGD, emb.remote_parameters(), lr=0.05)

The module is created on the remote worker (``rpc.remote``); ``forward`` and
``forward_async`` call its ``forward`` there with the same arguments, so inside a
``dist_autograd.context()`` gradients flow back to it. A ``RemoteModule`` can be sent to
other workers as an RPC argument (it travels as its ``RRef``); plain ``pickle`` (and so
``torch.save``) raises torch's ``RuntimeError``. As in torch, the ``nn.Module`` methods
that would need the remote state (``parameters()``, ``to()``, ``state_dict()``, hooks,
...) raise ``ValueError``; ``remote_parameters()`` and ``get_module_rref()`` replace them.
Only the non-scriptable flavour exists (torch's ``_module_interface_cls`` is TorchScript's).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

import torch
from torch import nn

from rallypoint.rpc import _tensorpipe
from rallypoint.rpc._backend import CURRENT_AGENT
from rallypoint.rpc._calls import remote, rpc_async, rpc_sync
from rallypoint.rpc._rref._rref import RRef
from rallypoint.rpc._transport import _wire

__all__ = ["RemoteModule"]


class RemoteDevice:
    """``"<worker>/<device>"`` or ``"rank:<rank>/<device>"`` (torch's ``_remote_device``).

    The device part is optional (``"cpu"``). A string that is only a local device
    (``"cpu"``, ``"cuda:0"``) names no worker.
    """

    __slots__ = ("device", "rank", "worker_name")

    def __init__(self, remote_device: str | torch.device) -> None:
        error = (
            f"Could not parse remote_device: {remote_device}. The valid format is "
            "'<workername>/<device>' or 'rank:<rank>/<device>' or '<device>'"
        )
        self.worker_name: str | None = None
        self.rank: int | None = None
        if isinstance(remote_device, torch.device):
            self.device = remote_device
            return
        if not isinstance(remote_device, str):
            raise TypeError(f"Invalid type for remote_device: {type(remote_device)}")
        fields = remote_device.split("/")
        if len(fields) == 2:
            worker, device = fields
        elif len(fields) == 1 and _is_device(fields[0]):
            worker, device = None, fields[0]
        elif len(fields) == 1:
            worker, device = fields[0], "cpu"
        else:
            raise ValueError(error)
        if worker is not None and not worker:
            raise ValueError(error)
        self.device = torch.device(device)
        if worker is not None and ":" in worker:
            kind, _, rank = worker.partition(":")
            if kind != "rank" or not rank.isdigit() or ":" in rank:
                raise ValueError(error)
            self.rank = int(rank)
            worker = None
        self.worker_name = worker

    def __repr__(self) -> str:
        where = self.worker_name if self.rank is None else f"rank:{self.rank}"
        return str(self.device) if where is None else f"{where}/{self.device}"


def _is_device(text: str) -> bool:
    try:
        torch.device(text)
    except (RuntimeError, ValueError):
        return False
    return True


# ---- what runs on the module's owner -----------------------------------------------------
def _create_module(
    module_cls: Callable[..., Any], args: Any, kwargs: Any, device: str
) -> nn.Module:
    module = module_cls(*args, **kwargs)
    if not isinstance(module, nn.Module):
        raise ValueError(
            "Expect `module_cls(*args, **kwargs)` returns an instance of <class nn.Module>, "
            f"but it returns an instance of {type(module)}."
        )
    module.to(device)
    return module


def _param_rrefs(module_rref: Any, recurse: bool) -> list[Any]:
    return [RRef(param) for param in module_rref.local_value().parameters(recurse)]


def _to_device(value: Any, device: torch.device) -> Any:
    return value.to(device) if isinstance(value, torch.Tensor) else value


def _remote_forward(
    module_rref: Any, device: str, is_device_map_set: bool, *args: Any, **kwargs: Any
) -> Any:
    module = module_rref.local_value()
    where = torch.device(device)
    if where.type != "cuda":
        return module.forward(*args, **kwargs)
    # as torch: CPU inputs move to the module's GPU, and without a device map to the
    # caller the outputs come back on the CPU
    args = tuple(_to_device(a, where) for a in args)
    kwargs = {k: _to_device(v, where) for k, v in kwargs.items()}
    out = module.forward(*args, **kwargs)
    if is_device_map_set:
        return out
    if isinstance(out, tuple | list):
        return type(out)(_to_device(o, torch.device("cpu")) for o in out)
    return _to_device(out, torch.device("cpu"))


def _remote_train(module_rref: Any, mode: bool) -> None:
    module_rref.local_value().train(mode)


# ---- the module ----------------------------------------------------------------------------
def _not_supported(name: str) -> NoReturn:
    raise ValueError(f"Method ``{name}`` not supported for RemoteModule")


class RemoteModule(nn.Module):
    """A module created on a remote worker; ``forward`` runs there (torch's API).

    ``remote_device`` is ``"<worker>/<device>"`` or ``"rank:<rank>/<device>"`` (device
    optional, default ``"cpu"``); ``module_cls(*args, **kwargs)`` is created there.
    """

    on: str | int
    device: str
    is_device_map_set: bool
    is_scriptable: bool
    module_rref: Any

    def __init__(
        self,
        remote_device: str,
        module_cls: Callable[..., nn.Module],
        args: tuple[Any, ...] | None = None,
        kwargs: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self._prepare(remote_device)
        args = args if args is not None else ()
        kwargs = kwargs if kwargs is not None else {}
        self.module_rref = remote(self.on, _create_module, (module_cls, args, kwargs, self.device))

    @staticmethod
    def init_from_module_rref(remote_device: str, module_rref: Any) -> RemoteModule:
        """A ``RemoteModule`` over an existing module's ``RRef`` (shares that module)."""
        module: RemoteModule = RemoteModule.__new__(RemoteModule)
        nn.Module.__init__(module)
        module._prepare(remote_device)
        module.module_rref = module_rref
        return module

    def _prepare(self, remote_device: str) -> None:
        agent = CURRENT_AGENT.peek()
        if agent is None:
            raise AssertionError("RemoteModule only works in RPC.")
        parsed = RemoteDevice(remote_device)
        if parsed.worker_name is None and parsed.rank is None:
            raise ValueError(
                f"remote_device {remote_device!r} names no worker: use "
                "'<workername>/<device>' or 'rank:<rank>/<device>'"
            )
        on: str | int = parsed.worker_name if parsed.worker_name is not None else parsed.rank  # type: ignore[assignment]
        info = agent.get_worker_info(on)  # torch's error for an unknown worker
        self.on = on
        self.device = str(parsed.device)
        self.is_device_map_set = bool(agent.device_map_to(info.name))
        self.is_scriptable = False

    # ---- the generated methods (torch generates them from a template) ----------------
    def forward_async(self, *args: Any, **kwargs: Any) -> torch.futures.Future[Any]:
        """Run the remote module's ``forward(*args, **kwargs)``; a Future of its result."""
        call_args = (self.module_rref, self.device, self.is_device_map_set, *args)
        return rpc_async(self.module_rref.owner(), _remote_forward, call_args, kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the remote module's ``forward(*args, **kwargs)`` and return its result."""
        return self.forward_async(*args, **kwargs).wait()

    # ---- what replaces the local-state methods -------------------------------------------
    def remote_parameters(self, recurse: bool = True) -> list[Any]:
        """``RRef``\\ s to the remote module's parameters (for ``DistributedOptimizer``)."""
        rrefs: list[Any] = rpc_sync(self.on, _param_rrefs, args=(self.module_rref, recurse))
        return rrefs

    def get_module_rref(self) -> Any:
        """The ``RRef`` of the remote module."""
        return self.module_rref

    def train(self, mode: bool = True) -> RemoteModule:
        """Set the remote module's training mode (torch's ignores ``mode``; this one does not)."""
        rpc_sync(self.on, _remote_train, args=(self.module_rref, bool(mode)))
        return self

    def eval(self) -> RemoteModule:
        return self.train(False)

    def parameters(self, recurse: bool = True) -> NoReturn:
        raise ValueError(
            "Method ``parameters`` not supported for RemoteModule. Please use "
            "``remote_parameters`` instead."
        )

    def __repr__(self) -> str:
        return f"RemoteModule(on={self.on!r}, device={self.device!r})"

    # ---- travelling between workers ----------------------------------------------------
    def __reduce__(self) -> NoReturn:
        # over RPC it travels by _reduce_remote_module (the codec's reducer), never this
        raise RuntimeError(
            "Cannot pickle RemoteModule in python pickler. RemoteModule can only be pickled "
            "when using RPC"
        )


def _reduce_remote_module(module: RemoteModule) -> _wire.ReduceValue:
    state = (module.on, module.device, module.is_device_map_set, module.module_rref)
    return (_remote_module_receiver, state)


def _remote_module_receiver(
    on: str | int, device: str, is_device_map_set: bool, module_rref: Any
) -> RemoteModule:
    module: RemoteModule = RemoteModule.__new__(RemoteModule)
    nn.Module.__init__(module)
    module.on = on
    module.device = device
    module.is_device_map_set = is_device_map_set
    module.is_scriptable = False
    module.module_rref = module_rref
    return module


_wire.register_reducer(RemoteModule, _reduce_remote_module)
_tensorpipe.register_reducer(RemoteModule, _reduce_remote_module)

_UNSUPPORTED = [
    "register_buffer",
    "register_parameter",
    "add_module",
    "apply",
    "cuda",
    "ipu",
    "xpu",
    "cpu",
    "type",
    "float",
    "double",
    "half",
    "bfloat16",
    "to",
    "register_backward_hook",
    "register_forward_pre_hook",
    "register_forward_hook",
    "state_dict",
    "load_state_dict",
    "named_parameters",
    "buffers",
    "named_buffers",
    "children",
    "named_children",
    "modules",
    "named_modules",
    "requires_grad_",
    "zero_grad",
    "share_memory",
    "extra_repr",
]


def _unsupported_method(name: str) -> Callable[..., NoReturn]:
    def method(self: RemoteModule, *args: Any, **kwargs: Any) -> NoReturn:
        _not_supported(name)

    method.__name__ = method.__qualname__ = name
    method.__doc__ = "Not supported for ``RemoteModule`` (``ValueError``, as in torch)."
    return method


for _name in _UNSUPPORTED:
    setattr(RemoteModule, _name, _unsupported_method(_name))
del _name
