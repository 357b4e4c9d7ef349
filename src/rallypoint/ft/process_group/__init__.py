"""Process groups across replica groups that a Manager rebuilds for every new quorum.

Every class here is a torch ``ProcessGroup`` (``torch.distributed.ProcessGroup``), so it
goes wherever torch takes one: ``dist.all_reduce(t, group=pg)``, DDP's
``process_group=``, FSDP2's all-reduce hook, functional collectives once ``register``-ed.
torchft's interface on top: ``configure(store_addr, replica_id, rank, world_size,
quorum_id, group_rank, group_world_size, global_ranks)`` makes a new communicator among
the quorum's members (the old one aborted first), and ``abort()`` ends its collectives at
once. ``store_addr``: ``ADDRESS#PREFIX`` (a lighthouse's store, ``HOST:PORT`` or
``etcd://...``) or torchft's ``HOST:PORT/PREFIX``.

- :class:`ProcessGroupWrapper` forwards every collective to the communicator it made at the
  last ``configure`` (or to the process group it wraps); :class:`ProcessGroupGloo` and
  :class:`ProcessGroupNCCL` make torch's own. torchft's ``ProcessGroupBaby*`` run the
  communicator in a child process so that it can be killed; here the abort works in
  process, so they are the same classes (no copy per collective).
- :class:`ManagedProcessGroup` is the Manager as a process group: its allreduce is
  ``manager.allreduce`` (the average over the quorum's participants, a failure recorded
  and never raised), its size the number of participants (HSDP: docs/ft.md).
- :class:`ProcessGroupDummy`, :class:`ErrorSwallowingProcessGroupWrapper`,
  :class:`FakeProcessGroupWrapper`: torchft's for tests and for discarding operations.
"""

from __future__ import annotations

import contextlib
import threading
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from rallypoint._core.forking import fork_safe_lock
from rallypoint._core.gloo_links import device_connections, epoll_sets, listens, shut_down
from rallypoint._core.store import Store
from rallypoint._core.torch_c import PrefixStore, TCPStore, as_torch_store
from rallypoint.ft.process_group._dummy import dummy_process_group as dummy_process_group
from rallypoint.ft.process_group._release import release
from rallypoint.ft.process_group._stores import store_from_address as store_from_address
from rallypoint.ft.work import _DummyWork

if TYPE_CHECKING:
    from rallypoint.ft.manager import Manager

__all__ = [
    "ErrorSwallowingProcessGroupWrapper",
    "FakeProcessGroupWrapper",
    "ManagedProcessGroup",
    "ProcessGroup",
    "ProcessGroupBabyGloo",
    "ProcessGroupBabyNCCL",
    "ProcessGroupBabyXCCL",
    "ProcessGroupDummy",
    "ProcessGroupGloo",
    "ProcessGroupNCCL",
    "ProcessGroupWrapper",
    "ProcessGroupXCCL",
    "create_store_client",
    "dummy_process_group",
    "store_from_address",
]


def create_store_client(store_addr: str, timeout: timedelta) -> Store:
    """torchft's: a client of the TCPStore at ``HOST:PORT/PREFIX`` under ``PREFIX`` (a bare
    or bracketed IPv6 host too: the port is the field after the last colon)."""
    address, _, prefix = store_addr.partition("/")
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"a store address is HOST:PORT/PREFIX, got {store_addr!r}")
    store = TCPStore(
        host_name=host.strip("[]"),
        port=int(port),
        is_master=False,
        wait_for_workers=False,
        timeout=timeout,
    )
    return PrefixStore(prefix, store)


def _as_timedelta(timeout: timedelta | float) -> timedelta:
    return timeout if isinstance(timeout, timedelta) else timedelta(seconds=timeout)


def _allreduce_options(opts: Any) -> Any:
    if isinstance(opts, dist.AllreduceOptions):
        return opts
    out = dist.AllreduceOptions()
    out.reduceOp = opts
    return out


class ProcessGroup(dist.ProcessGroup):
    """torchft's reconfigurable process group: a torch ``ProcessGroup`` of one rank to torch
    (its size and rank change at each ``configure``), whose collectives subclasses give."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*(args or (0, 1)), **kwargs)
        self._group_name: str | None = None

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
        """Make a new communicator of ``world_size`` ranks at ``store_addr`` (a new prefix each
        time); blocks until every member joined, or raises."""
        raise NotImplementedError(f"{type(self).__name__} cannot be configured")

    def broadcast_one(self, tensor: torch.Tensor, root: int) -> Any:
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        return self.broadcast([tensor], opts)

    def size(self) -> int:
        raise NotImplementedError(f"{type(self).__name__}.size")

    def getBackendName(self) -> str:
        raise NotImplementedError(f"{type(self).__name__}.getBackendName")

    def abort(self, errored: bool = True) -> None:
        """End this communicator's collectives at once."""

    def shutdown(self) -> None:
        """Let go of the communicator."""

    def errored(self) -> Exception | None:
        """The error of an abort since the last ``configure`` (the step must not commit)."""
        return None

    def set_timeout(self, timeout: timedelta) -> None:
        raise NotImplementedError(f"{type(self).__name__}.set_timeout")

    # ------------------------------------------------------------------ torch's registry
    def register(self, name: str) -> ProcessGroup:
        """Register as torch backend ``<backend>:<name>`` and make it a torch group of this
        rank alone (what functional collectives and ``DeviceMesh`` resolve by name); call
        once, on every rank of the default group."""
        backend = f"{self.getBackendName()}:{name}"
        devices = ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
        dist.Backend.register_backend(backend, lambda *_: self, devices=devices)
        made: object = dist.new_group(
            ranks=[dist.get_rank()],
            backend=backend,
            group_desc=backend,
            timeout=timedelta(seconds=60),  # the groups made at each quorum have their own
        )
        if made is not self:
            raise RuntimeError(f"torch made a process group of its own for backend {backend}")
        return self

    def unregister(self) -> None:
        dist.destroy_process_group(self)

    @property
    def group_name(self) -> str:  # type: ignore[override]
        if self._group_name is None:
            raise ValueError("the process group has no name: register() gives it one")
        return self._group_name

    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    # ------------------------------------------------------------------ collectives
    def _collective(self, name: str, *args: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} does not support {name}")

    def allgather(self, *args: Any) -> Any:
        return self._collective("allgather", *args)

    def allgather_into_tensor_coalesced(self, *args: Any) -> Any:
        return self._collective("allgather_into_tensor_coalesced", *args)

    def allreduce(self, *args: Any) -> Any:
        return self._collective("allreduce", *args)

    def allreduce_coalesced(self, *args: Any) -> Any:
        return self._collective("allreduce_coalesced", *args)

    def alltoall_base(self, *args: Any) -> Any:
        return self._collective("alltoall_base", *args)

    def barrier(self, *args: Any) -> Any:
        return self._collective("barrier", *(args or (dist.BarrierOptions(),)))

    def broadcast(self, *args: Any) -> Any:
        return self._collective("broadcast", *args)

    def recv(self, *args: Any) -> Any:
        return self._collective("recv", *args)

    def reduce_scatter(self, *args: Any) -> Any:
        return self._collective("reduce_scatter", *args)

    def reduce_scatter_tensor_coalesced(self, *args: Any) -> Any:
        return self._collective("reduce_scatter_tensor_coalesced", *args)

    def send(self, *args: Any) -> Any:
        return self._collective("send", *args)


class ProcessGroupWrapper(ProcessGroup):
    """Forwards every collective to the torch process group under it: ``pg`` (a
    reconfigurable one is configured with it), or the one ``configure`` makes
    (``_create_pg``, which subclasses give)."""

    def __init__(self, timeout: timedelta | float = timedelta(seconds=60), pg: Any = None) -> None:
        super().__init__(0, 1)
        self._timeout = _as_timedelta(timeout)
        self._wrapped = pg
        self._made: Any = None
        self._rank, self._size = 0, 1
        self._errored: Exception | None = None
        self._lock = threading.Lock()
        self._made_for = 0  # configures and aborts: one made for an older count is dropped
        self.quorum_id: int | None = None

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
        args = (store_addr, replica_id, rank, world_size, quorum_id)
        if isinstance(self._wrapped, ProcessGroup):
            self._wrapped.configure(*args, group_rank, group_world_size, global_ranks)
        else:  # a communicator of its own (a torch group given, not reconfigurable, stays)
            with self._lock:
                old, self._made = [self._made], None
                self._made_for += 1
                count = self._made_for
            if old[0] is not None:
                self._abort_pg(old[0])
            release(old)
            store = store_from_address(store_addr, self._timeout)
            made = [self._create_pg(store, rank, world_size)]
            with self._lock:
                if self._made_for == count:
                    self._made, made = made[0], []
            if made:  # aborted while its rendezvous ran (a member died): never used
                self._abort_pg(made[0])
                release(made)
                raise RuntimeError("the process group was aborted while it was being made")
        with self._lock:
            self._rank, self._size, self.quorum_id = rank, world_size, quorum_id
            self._errored = None

    @property
    def parent(self) -> Any:
        """The torch process group that runs the collectives."""
        pg = self._made if self._made is not None else self._wrapped
        if pg is None:
            raise RuntimeError(
                "process group not initialized (the Manager configures it at a quorum)"
                if self._errored is None
                else f"the process group was aborted: {self._errored}"
            )
        return pg

    def abort(self, errored: bool = True) -> None:
        with self._lock:
            made, self._made = [self._made], None
            self._made_for += 1
            if errored and (made[0] is not None or self._wrapped is not None):
                self._errored = RuntimeError("the process group was aborted")
        if made[0] is not None:
            self._abort_pg(made[0])
        elif self._wrapped is not None and hasattr(self._wrapped, "abort"):
            self._wrapped.abort()
        release(made)  # its destructor waits for its collectives: not on this thread

    def shutdown(self) -> None:
        self.abort(errored=False)

    def errored(self) -> Exception | None:
        if self._errored is None and isinstance(self._wrapped, ProcessGroup):
            return self._wrapped.errored()
        return self._errored

    def size(self) -> int:
        if self._made is not None or self._wrapped is None:
            return self._size
        return int(self._wrapped.size())

    def rank(self) -> int:
        return self._rank

    def getBackendName(self) -> str:
        if isinstance(self._wrapped, ProcessGroup):
            return self._wrapped.getBackendName()
        if isinstance(self._wrapped, dist.ProcessGroup):
            return str(self._wrapped.name())
        raise NotImplementedError(f"{type(self).__name__}.getBackendName")

    def set_timeout(self, timeout: timedelta) -> None:
        """The timeout of the communicators made from now on and, as torch's
        ``Backend.set_timeout``, of the next collectives of the one in use (where its
        backend can change it: gloo can)."""
        self._timeout = _as_timedelta(timeout)
        made = self._made
        if made is None:
            return
        for device in ("cpu", "cuda"):
            with contextlib.suppress(RuntimeError):  # no backend there, or one that cannot
                made._get_backend(torch.device(device)).set_timeout(self._timeout)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(pg={self._made or self._wrapped})"

    def _collective(self, name: str, *args: Any) -> Any:
        if name == "allreduce" and len(args) > 1:
            args = (args[0], _allreduce_options(args[1]), *args[2:])
        elif name == "broadcast" and len(args) > 1 and isinstance(args[1], int):
            opts = dist.BroadcastOptions()
            opts.rootRank = args[1]
            args = (args[0], opts)
        return getattr(self.parent, name)(*args)

    def _create_pg(self, store: Store, rank: int, world_size: int) -> Any:
        raise NotImplementedError(
            f"{type(self).__name__} makes no communicator: wrap a process group (pg=...)"
        )

    def _abort_pg(self, pg: Any) -> None:
        """End the collectives of ``pg``, a process group ``_create_pg`` made."""


def _torch_group(store: Store, rank: int, world_size: int, kind: Any, backend: Any) -> Any:
    """A torch ``ProcessGroup`` over ``backend`` (torch's gloo or NCCL) for its devices."""
    pg = dist.ProcessGroup(as_torch_store(store), rank, world_size)
    pg._set_default_backend(kind)
    devices = ["cuda"] if kind == dist.ProcessGroup.BackendType.NCCL else ["cpu"]
    if kind == dist.ProcessGroup.BackendType.GLOO and torch.cuda.is_available():
        devices.append("cuda")
    for device in devices:
        pg._register_backend(torch.device(device), kind, backend)
    return pg


class ProcessGroupGloo(ProcessGroupWrapper):
    """torch's gloo (as torchft's, without reduce-scatter: gloo's works of it have no
    future). gloo has no working abort, so ``abort()`` shuts down the connections
    of this communicator's own device (:mod:`rallypoint._core.gloo_links`): every rank
    blocked on them fails at once. The device is made here, one at a time in a process,
    so that its loop is known for sure: the one epoll set that appeared with it (other
    communicators made at the same time, by other managers or the program, are not it)."""

    def __init__(self, timeout: timedelta | float = timedelta(seconds=60), pg: Any = None) -> None:
        super().__init__(timeout, pg)
        self._loops: dict[int, set[int]] = {}  # id of a communicator -> its device's loop

    def getBackendName(self) -> str:
        return "torchft-gloo"

    def _create_pg(self, store: Store, rank: int, world_size: int) -> Any:
        gloo = dist.ProcessGroupGloo
        with _DEVICE_LOCK:
            before = epoll_sets()
            device = gloo.create_default_device()
            new = epoll_sets() - before
        options = gloo._Options()  # type: ignore[attr-defined]
        options._devices = [device]
        options._timeout = self._timeout
        backend = gloo(as_torch_store(store), rank, world_size, options)
        pg = _torch_group(store, rank, world_size, dist.ProcessGroup.BackendType.GLOO, backend)
        self._loops[id(pg)] = {fd for fd in new if listens(fd)} or new
        return pg

    def reduce_scatter(self, *args: Any) -> Any:
        raise RuntimeError("ProcessGroupGloo does not support reduce_scatter.")

    def reduce_scatter_tensor_coalesced(self, *args: Any) -> Any:
        raise RuntimeError("ProcessGroupGloo does not support reduce_scatter_tensor_coalesced.")

    def _abort_pg(self, pg: Any) -> None:
        for fd in self._loops.pop(id(pg), set()):  # its device is alive while pg is
            shut_down(device_connections(fd))


_DEVICE_LOCK = fork_safe_lock()
"""Held while a gloo device is made (no rendezvous: milliseconds)."""


class ProcessGroupNCCL(ProcessGroupWrapper):
    """torch's NCCL; ``abort()`` is its communicator abort."""

    def getBackendName(self) -> str:
        return "torchft-nccl"

    def _create_pg(self, store: Store, rank: int, world_size: int) -> Any:
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = self._timeout
        backend = dist.ProcessGroupNCCL(as_torch_store(store), rank, world_size, options)
        backend.eager_connect_single_device(torch.device("cuda", torch.cuda.current_device()))
        return _torch_group(store, rank, world_size, dist.ProcessGroup.BackendType.NCCL, backend)

    def _abort_pg(self, pg: Any) -> None:
        pg._get_backend(torch.device("cuda")).abort()


class ProcessGroupXCCL(ProcessGroupWrapper):
    """torchft's Intel GPU group: not available in this torch build."""

    def getBackendName(self) -> str:
        return "torchft-xccl"

    def _create_pg(self, store: Store, rank: int, world_size: int) -> Any:
        raise RuntimeError("XCCL (Intel GPUs) is not supported by rallypoint.ft")


ProcessGroupBabyGloo = ProcessGroupGloo
ProcessGroupBabyNCCL = ProcessGroupNCCL
ProcessGroupBabyXCCL = ProcessGroupXCCL


class ProcessGroupDummy(ProcessGroup):
    """A group of one rank that sends nothing: every collective is done at once, with its
    output what one rank would get (a gather copies the input). For discarding operations
    without changing the library that issues them, and for tests."""

    def __init__(self, rank: int, world: int) -> None:
        if (rank, world) != (0, 1):
            raise ValueError(f"ProcessGroupDummy is rank 0 of 1, got rank {rank} of {world}")
        super().__init__(rank, world)
        self._rank, self._world = rank, world
        self.wait_count = 0
        self.get_future_count = 0
        self.configure_count = 0
        self._work: list[Any] = []

    def configure(self, *args: Any, **kwargs: Any) -> None:
        self.configure_count += 1

    def size(self) -> int:
        return self._world

    def getBackendName(self) -> str:
        return "torchft-dummy"

    def _collective(self, name: str, *args: Any) -> Any:
        result: Any = args[0] if args else None
        if name in ("allgather", "reduce_scatter"):  # [[outputs]] from [inputs] or back
            outs, ins = (args[0][0], args[1]) if name == "allgather" else (args[0], args[1][0])
            for out, given in zip(outs, ins, strict=False):
                out.copy_(given)
        elif name in ("allgather_into_tensor_coalesced", "reduce_scatter_tensor_coalesced"):
            for out, given in zip(args[0], args[1], strict=False):
                out.copy_(given)
        elif name == "alltoall_base":
            args[0].copy_(args[1])
            result = [args[0]]
        elif name in ("barrier", "send", "recv"):
            return _DummyWork(None)
        work = _DummyWork(result)
        self._work.append(work)
        return work


class _ErrorSwallowingWork(dist.Work):
    """A work whose failure is reported to its wrapper and replaced by ``default``."""

    def __init__(self, pg: ErrorSwallowingProcessGroupWrapper, work: Any, default: object):
        super().__init__()
        self._pg, self._work, self._default = pg, work, default

    def wait(self, timeout: timedelta | None = None) -> bool:
        try:
            self._work.wait()
        except Exception as exc:  # reported: the operations after it are skipped
            self._pg.report_error(exc)
        return True

    def get_future(self) -> torch.futures.Future[object]:
        def value(fut: torch.futures.Future[object]) -> object:
            try:
                return fut.value()
            except Exception as exc:  # reported: the operations after it are skipped
                self._pg.report_error(exc)
                return self._default

        return self._work.get_future().then(value)  # type: ignore[no-any-return]


class ErrorSwallowingProcessGroupWrapper(ProcessGroupWrapper):
    """Wraps ``pg``: an allreduce that fails reports its error here instead of raising, and
    every allreduce after it is skipped (its tensors left as they are) until the next
    ``configure``. Keeps error handling out of modelling code."""

    def __init__(self, pg: ProcessGroup) -> None:
        super().__init__(pg=pg)
        self._error: Exception | None = None

    def configure(self, *args: Any, **kwargs: Any) -> None:
        self._error = None
        super().configure(*args, **kwargs)

    def report_error(self, e: Exception) -> None:
        self._error = e

    def error(self) -> Exception | None:
        return self._error

    def allreduce(self, *args: Any) -> Any:
        tensors = args[0]
        if self._error is not None:
            return _DummyWork(tensors)
        try:
            return _ErrorSwallowingWork(self, super().allreduce(*args), tensors)
        except Exception as exc:  # reported: the operations after it are skipped
            self.report_error(exc)
            return _DummyWork(tensors)


class _FailedWork(dist.Work):
    """``work`` once done, then ``error`` (what :class:`FakeProcessGroupWrapper` injects)."""

    def __init__(self, work: Any, error: Exception) -> None:
        super().__init__()
        self._work, self._error = work, error

    def wait(self, timeout: timedelta | None = None) -> bool:
        self._work.wait()
        raise self._error

    def get_future(self) -> torch.futures.Future[object]:
        error = self._error

        def fail(_: torch.futures.Future[object]) -> object:
            raise error

        return self._work.get_future().then(fail)  # type: ignore[no-any-return]


class FakeProcessGroupWrapper(ProcessGroupWrapper):
    """Wraps ``pg`` for tests: ``report_future_error(e)`` makes the next allreduce's work
    fail with ``e`` once its collective is done (its ``wait()`` raises, its future holds
    the error); ``configure`` forgets an error not yet used."""

    def __init__(self, pg: ProcessGroup) -> None:
        super().__init__(pg=pg)
        self._future_error: Exception | None = None

    def configure(self, *args: Any, **kwargs: Any) -> None:
        self._future_error = None
        super().configure(*args, **kwargs)

    def report_future_error(self, e: Exception) -> None:
        self._future_error = e

    def allreduce(self, *args: Any) -> Any:
        work = super().allreduce(*args)
        error, self._future_error = self._future_error, None
        return work if error is None else _FailedWork(work, error)


class ManagedProcessGroup(ProcessGroupWrapper):
    """The Manager as a process group across replica groups: ``allreduce`` is
    ``manager.allreduce`` (AVG divides by the quorum's participants; a healing group sends
    zeros; a failure is recorded on the manager, which fails the step's commit, and never
    raised), ``size()`` is the number of participants. Its other collectives go to the
    manager's process group as they are. HSDP: FSDP2's all-reduce hook calls
    ``dist.all_reduce(grad, group=this, op=ReduceOp.AVG)`` (docs/ft.md)."""

    def __init__(self, manager: Manager) -> None:
        super().__init__(pg=manager._pg)
        self._manager = manager

    def allreduce(self, *args: Any) -> Any:
        tensors, opts = args[0], args[1] if len(args) > 1 else dist.AllreduceOptions()
        if len(tensors) != 1:
            raise ValueError(
                f"ManagedProcessGroup reduces one tensor at a time, got {len(tensors)}"
            )
        op = opts.reduceOp if isinstance(opts, dist.AllreduceOptions) else opts
        return self._manager.allreduce(tensors[0], reduce_op=op)

    def size(self) -> int:
        return self._manager.num_participants()

    def getBackendName(self) -> str:
        return str(self._manager._pg.getBackendName())

    def configure(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("a ManagedProcessGroup is configured by its Manager at each quorum")
