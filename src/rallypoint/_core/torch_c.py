"""rallypoint's one door to torch's private C extension, ``torch._C``.

Everything rallypoint takes from ``torch._C`` is named here once, so a torch release that
moves a name breaks this module only. Importing it imports torch: a torch-free module
imports it inside the function that needs it.

- Stores: torch's ``c10d`` classes, their type stubs corrected (``append``, ``multi_set``,
  ``clone`` and ``timeout`` exist; values may be ``bytes``), so that each is a
  :class:`rallypoint._core.store.Store`; :func:`as_torch_store` hands a ``Store`` to the
  torch APIs that want torch's class (``PrefixStore``, process groups, TensorPipe).
- The Flight Recorder's dumps, ``Future``, ``collect_all``, the RPC module (read at call
  time: rallypoint's agent swaps its ``PyRRef``), operator schemas, ``AccumulateGrad``.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, cast

import torch
from torch._C import _distributed_c10d as _c10d

if TYPE_CHECKING:
    from rallypoint._core.store import Store

__all__ = [
    "FileStore",
    "Future",
    "HashStore",
    "PrefixStore",
    "TCPStore",
    "TorchStore",
    "accumulate_grad_class",
    "as_torch_store",
    "check_schema",
    "collect_all",
    "distributed_rpc",
    "dump_flight_recorder",
    "find_dispatcher_schema",
    "get_schema",
    "jit_operation",
]

if TYPE_CHECKING:

    class TorchStore(_c10d.Store):
        """torch's ``Store`` as it is: the stub lacks ``append``, ``multi_set``, ``clone``
        and ``timeout``, and types values ``str``, where pybind takes ``bytes`` too."""

        def set(self, key: str, value: str | bytes) -> None: ...
        def compare_set(
            self, key: str, expected_value: str | bytes, desired_value: str | bytes
        ) -> bytes: ...
        def append(self, key: str, value: str | bytes) -> None: ...
        def multi_set(self, keys: list[str], values: Sequence[str | bytes]) -> None: ...
        def clone(self) -> TorchStore: ...
        @property
        def timeout(self) -> timedelta: ...

    class TCPStore(TorchStore, _c10d.TCPStore): ...

    class PrefixStore(TorchStore, _c10d.PrefixStore): ...

    class FileStore(TorchStore, _c10d.FileStore): ...

    class HashStore(TorchStore, _c10d.HashStore): ...

else:
    TorchStore = _c10d.Store
    TCPStore = _c10d.TCPStore
    PrefixStore = _c10d.PrefixStore
    FileStore = _c10d.FileStore
    HashStore = _c10d.HashStore


def as_torch_store(store: Store | _c10d.Store) -> TorchStore:
    """``store`` as torch's class, for a torch API that takes one (its C++ ``Store``), or
    a store a torch API returned, typed as it is (:class:`TorchStore`)."""
    if not isinstance(store, _c10d.Store):
        raise TypeError(f"torch wants a c10d Store here, not {type(store).__name__}")
    return cast("TorchStore", store)


def dump_flight_recorder(frames: bool) -> list[bytes]:
    """The pickled dumps of torch's Flight Recorders: the one of gloo (and the other CPU
    backends), and NCCL's own (CUDA events) in CUDA builds once CUDA is in use."""
    dumps: list[bytes] = [_c10d._dump_fr_trace(True, frames)]  # type: ignore[attr-defined]
    nccl = getattr(_c10d, "_dump_nccl_trace", None)
    if nccl is not None and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        dumps.append(nccl(True, frames, False))
    return dumps


Future = torch._C.Future
"""The class of the futures torch's C++ code returns (``torch.futures.Future``'s base)."""

collect_all: Any = torch._C._collect_all
"""torch's ``_collect_all(futures)``: a future of them all, failed by the first failure."""

distributed_rpc: Any = getattr(torch._C, "_distributed_rpc", None)
"""torch's RPC module (``None`` in a build without RPC); read its attributes at call time."""

accumulate_grad_class: Any = torch._C._functions.AccumulateGrad  # type: ignore[attr-defined]
"""The autograd node class that accumulates into a leaf's ``.grad``."""

check_schema: Any = torch._C._check_schema_allow_fake_script_object
"""Raises ``RuntimeError`` unless ``(schema, *args, **kwargs)`` match."""


def find_dispatcher_schema(qualname: str, overload: str) -> Any:
    """The dispatcher's schema of an operator's overload; ``RuntimeError`` if it has none."""
    return torch._C._dispatch_find_schema_or_throw(qualname, overload)


def jit_operation(qualname: str) -> tuple[Any, list[str] | None]:
    """TorchScript's ``(operation, overload names)`` of an operator (names ``None``: none)."""
    operation, names = torch._C._jit_get_operation(qualname)
    return operation, names


def get_schema(qualname: str, overload: str) -> Any:
    """An operator's overload's schema."""
    return torch._C._get_schema(qualname, overload)
