"""Process groups across replica groups that a Manager rebuilds for every new quorum.

torchft's interface: ``configure(store_addr, replica_id, rank, world_size, quorum_id,
group_rank, group_world_size, global_ranks)`` makes a new communicator among the quorum's
members (the old one aborted first), and ``abort()`` ends its collectives at once.
Underneath are torch's own backends (:class:`ProcessGroupGloo`, :class:`ProcessGroupNCCL`).
torchft's ``ProcessGroupBaby*`` run the communicator in a child process so that it can be
killed; here the abort works in process, so they are the same classes (no copy per
collective). ``store_addr``: ``ADDRESS#PREFIX`` (a lighthouse's store, ``HOST:PORT`` or
``etcd://...``) or torchft's ``HOST:PORT/PREFIX``.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from rallypoint._core.forking import fork_safe_lock
from rallypoint._core.gloo_links import device_connections, epoll_sets, listens, shut_down
from rallypoint._core.store import Store
from rallypoint._core.torch_c import HashStore, as_torch_store
from rallypoint.rendezvous import connect_kv

__all__ = [
    "ProcessGroup",
    "ProcessGroupBabyGloo",
    "ProcessGroupBabyNCCL",
    "ProcessGroupBabyXCCL",
    "ProcessGroupGloo",
    "ProcessGroupNCCL",
    "ProcessGroupXCCL",
    "dummy_process_group",
    "store_from_address",
]


def store_from_address(store_addr: str, timeout: timedelta) -> Store:
    """A torch ``Store`` for ``store_addr`` (see the module docstring)."""
    if "#" in store_addr:
        address, _, prefix = store_addr.partition("#")
    else:
        address, _, prefix = store_addr.partition("/")
    kv, _ = connect_kv(address, timeout=timeout)
    return kv.torch_store(prefix.strip("/") + "/")


class ProcessGroup:
    """A communicator among the replica groups of the current quorum (torchft's API)."""

    backend_name = "rallypoint-ft"

    def __init__(self, timeout: timedelta | float = timedelta(seconds=60)) -> None:
        self._timeout = timeout if isinstance(timeout, timedelta) else timedelta(seconds=timeout)
        self._backend: Any = None
        self._rank, self._size = 0, 1
        self._errored: Exception | None = None
        self._lock = threading.Lock()
        self.quorum_id: int | None = None

    # ------------------------------------------------------------------ torchft's API
    def configure(
        self,
        store_addr: str,
        replica_id: str,
        rank: int,
        world_size: int,
        quorum_id: int | None = None,
        group_rank: int | None = None,
        group_world_size: int | None = None,
        global_ranks: list[int] | None = None,
    ) -> None:
        """Abort the old communicator and make one of ``world_size`` ranks (blocks until
        every member joined, or raises)."""
        self.abort(errored=False)
        store = store_from_address(store_addr, self._timeout)
        backend = self._create(store, rank, world_size)
        with self._lock:
            self._backend, self._rank, self._size = backend, rank, world_size
            self._errored = None
            self.quorum_id = quorum_id

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        if not isinstance(opts, dist.AllreduceOptions):
            op, opts = opts, dist.AllreduceOptions()
            opts.reduceOp = op
        return self._live().allreduce(tensors, opts)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        if not isinstance(opts, dist.BroadcastOptions):
            root, opts = opts, dist.BroadcastOptions()
            opts.rootRank = int(root)
        return self._live().broadcast(tensors, opts)

    def barrier(self) -> Any:
        return self._live().barrier(dist.BarrierOptions())

    def abort(self, errored: bool = True) -> None:
        """End this communicator's collectives at once (see the module docstring)."""
        with self._lock:
            backend, self._backend = self._backend, None
            if errored and backend is not None:
                self._errored = RuntimeError("the process group was aborted")
        if backend is not None:
            self._abort(backend)

    def shutdown(self) -> None:
        self.abort(errored=False)

    def errored(self) -> Exception | None:
        return self._errored

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank

    def getBackendName(self) -> str:
        return self.backend_name

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout

    # ------------------------------------------------------------------ backends
    def _live(self) -> Any:
        backend = self._backend
        if backend is None:
            raise RuntimeError(
                "the process group is not configured (the Manager configures it at a quorum)"
                if self._errored is None
                else f"the process group was aborted: {self._errored}"
            )
        return backend

    def _create(self, store: Store, rank: int, world_size: int) -> Any:
        raise NotImplementedError

    def _abort(self, backend: Any) -> None:
        raise NotImplementedError


class ProcessGroupGloo(ProcessGroup):
    """torch's gloo. gloo has no working abort, so ``abort()`` shuts down the connections
    of this communicator's own device (:mod:`rallypoint._core.gloo_links`): every rank
    blocked on them fails at once. The device is made here, one at a time in a process,
    so that its loop is known for sure: the one epoll set that appeared with it (other
    communicators made at the same time, by other managers or the program, are not it)."""

    backend_name = "torchft-gloo"

    def __init__(self, timeout: timedelta | float = timedelta(seconds=60), pg: Any = None) -> None:
        super().__init__(timeout)
        self._loops: set[int] = set()

    def _create(self, store: Store, rank: int, world_size: int) -> Any:
        gloo = dist.ProcessGroupGloo
        with _DEVICE_LOCK:
            before = epoll_sets()
            device = gloo.create_default_device()
            new = epoll_sets() - before
        options = gloo._Options()  # type: ignore[attr-defined]
        options._devices = [device]
        options._timeout = self._timeout
        backend = gloo(as_torch_store(store), rank, world_size, options)
        self._loops = {fd for fd in new if listens(fd)} or new
        return backend

    def _abort(self, backend: Any) -> None:
        for fd in self._loops:  # the backend (and so its device) is alive until this returns
            shut_down(device_connections(fd))
        self._loops = set()


_DEVICE_LOCK = fork_safe_lock()
"""Held while a gloo device is made (no rendezvous: milliseconds)."""


class ProcessGroupNCCL(ProcessGroup):
    """torch's NCCL; ``abort()`` is its communicator abort."""

    backend_name = "torchft-nccl"

    def _create(self, store: Store, rank: int, world_size: int) -> Any:
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = self._timeout
        backend = dist.ProcessGroupNCCL(as_torch_store(store), rank, world_size, options)
        backend.eager_connect_single_device(torch.device("cuda", torch.cuda.current_device()))
        return backend

    def _abort(self, backend: Any) -> None:
        backend.abort()


class ProcessGroupXCCL(ProcessGroup):
    """torchft's Intel GPU group: not available in this torch build."""

    def _create(self, store: Store, rank: int, world_size: int) -> Any:
        raise RuntimeError("XCCL (Intel GPUs) is not supported by rallypoint.ft")

    def _abort(self, backend: Any) -> None:
        pass


ProcessGroupBabyGloo = ProcessGroupGloo
ProcessGroupBabyNCCL = ProcessGroupNCCL
ProcessGroupBabyXCCL = ProcessGroupXCCL


def dummy_process_group() -> Any:
    """A c10d process group of one rank: it absorbs DDP's own broadcasts (the Manager
    averages the gradients across the replica groups)."""
    store = HashStore()
    pg = dist.ProcessGroup(store, 0, 1)
    backend = dist.ProcessGroupGloo(store, 0, 1, timedelta(seconds=60))
    pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    if torch.cuda.is_available():
        pg._register_backend(torch.device("cuda"), dist.ProcessGroup.BackendType.GLOO, backend)
    return pg
