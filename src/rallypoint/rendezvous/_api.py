"""The handler API: errors, parameters, the handler ABC and what a rendezvous returns.

These names mirror ``torch.distributed.elastic.rendezvous.api`` (same classes, same
validation messages, same accepted spellings) so that code written against torch's API
runs unchanged. Exception tree::

    RendezvousError
     ├── RendezvousClosedError        the run was closed (set_closed / shutdown)
     ├── RendezvousTimeoutError       the round did not complete within join_timeout
     ├── RendezvousConnectionError    the store/backend cannot be reached
     ├── RendezvousStateError         the store holds something we cannot parse
     └── RendezvousGracefulExitError  a spare node leaves because the run closed
"""

from __future__ import annotations

import socket
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import Store as C10dStore

    from rallypoint._core.store import Store


class RendezvousError(Exception):
    """Base type for rendezvous errors."""


class RendezvousClosedError(RendezvousError):
    """Raised when a rendezvous is closed."""


class RendezvousTimeoutError(RendezvousError):
    """Raised when a rendezvous did not complete on time."""


class RendezvousConnectionError(RendezvousError):
    """Raised when the connection to a rendezvous backend has failed."""


class RendezvousStateError(RendezvousError):
    """Raised when the state of a rendezvous is corrupt."""


class RendezvousGracefulExitError(RendezvousError):
    """Raised when a node was not admitted (a spare) and the run closed: exit, not a failure."""


@dataclass
class RendezvousStoreInfo:
    """Address of the store that workers use to bootstrap their process group."""

    MASTER_ADDR_KEY: ClassVar[str] = "MASTER_ADDR"
    MASTER_PORT_KEY: ClassVar[str] = "MASTER_PORT"
    master_addr: str
    master_port: int

    @staticmethod
    def build(
        rank: int, store: Store | C10dStore, local_addr: str | None, server_port: int | None = None
    ) -> RendezvousStoreInfo:
        """Rank 0 publishes its address and a port in ``store``; every rank reads them.

        ``store`` is the round's store, so a new round never sees an old address.
        """
        if rank == 0:
            from rallypoint._core.net import free_port

            addr = local_addr or socket.getfqdn()
            port = server_port or free_port()
            store.set(RendezvousStoreInfo.MASTER_ADDR_KEY, addr)
            store.set(RendezvousStoreInfo.MASTER_PORT_KEY, str(port))
        addr = store.get(RendezvousStoreInfo.MASTER_ADDR_KEY).decode()
        port = int(store.get(RendezvousStoreInfo.MASTER_PORT_KEY).decode())
        return RendezvousStoreInfo(master_addr=addr, master_port=port)


class RendezvousInfo:
    """What :meth:`RendezvousHandler.next_rendezvous` returns.

    Torch's class exposes ``store``, ``rank``, ``world_size`` and ``bootstrap_store_info``;
    ours also unpacks as the older 3-tuple ``store, rank, world_size = info``.
    """

    __slots__ = ("_bootstrap_store_info", "_rank", "_store", "_world_size")

    def __init__(
        self,
        store: C10dStore,
        rank: int,
        world_size: int,
        bootstrap_store_info: RendezvousStoreInfo | None = None,
    ) -> None:
        self._store = store
        self._rank = rank
        self._world_size = world_size
        self._bootstrap_store_info = bootstrap_store_info

    @property
    def store(self) -> C10dStore:
        """Store for the control plane, namespaced to this round."""
        return self._store

    @property
    def rank(self) -> int:
        """Rank of this node within the round."""
        return self._rank

    @property
    def world_size(self) -> int:
        """Number of nodes in the round."""
        return self._world_size

    @property
    def bootstrap_store_info(self) -> RendezvousStoreInfo | None:
        """Where workers find their store (``MASTER_ADDR``/``MASTER_PORT``)."""
        return self._bootstrap_store_info

    def __iter__(self) -> Iterator[Any]:
        return iter((self._store, self._rank, self._world_size))

    def __len__(self) -> int:
        return 3

    def __getitem__(self, index: int) -> Any:
        return (self._store, self._rank, self._world_size)[index]

    def __repr__(self) -> str:
        return f"RendezvousInfo(rank={self._rank}, world_size={self._world_size})"


class RendezvousHandler(ABC):
    """The rendezvous interface an agent drives (torch's ``RendezvousHandler``)."""

    _spare_round: int | None = None

    @abstractmethod
    def get_backend(self) -> str:
        """Return the name of the rendezvous backend."""

    @property
    def use_agent_store(self) -> bool:
        """Whether the store info returned can be shared with the workers."""
        return False

    @abstractmethod
    def next_rendezvous(self) -> RendezvousInfo:
        """Block until this node is admitted to a round; return its rank and store.

        Raises:
            RendezvousClosedError: the rendezvous is closed.
            RendezvousConnectionError: the backend cannot be reached.
            RendezvousStateError: the rendezvous state is corrupt.
            RendezvousTimeoutError: the round did not complete on time.
        """

    @abstractmethod
    def is_closed(self) -> bool:
        """Whether the rendezvous has been closed (eventually consistent)."""

    @abstractmethod
    def set_closed(self) -> None:
        """Mark the rendezvous as closed for every node."""

    @abstractmethod
    def num_nodes_waiting(self) -> int:
        """Number of nodes waiting to be admitted; > 0 means: re-rendezvous."""

    @abstractmethod
    def get_run_id(self) -> str:
        """Return the run id of the rendezvous."""

    @abstractmethod
    def shutdown(self) -> bool:
        """Release the resources of the rendezvous; return whether that succeeded."""

    # ---------------------------------------------------------------- rallypoint's additions
    # Not in torch's ABC; the defaults fit a handler without rounds, heartbeats or a store of
    # its own (``static``), so torch-style handlers keep working unchanged.

    @property
    def round(self) -> int | None:
        """The number of the round this node was last admitted to; ``None`` before the first
        round, or when the backend does not number its rounds."""
        return None

    def open_run_store(self, namespace: str) -> C10dStore | None:
        """A new connection to a store that lives as long as the run (not one round), with
        its keys under ``namespace``; ``None`` when the backend has no run-level store
        (then use the round's ``RendezvousInfo.store``).

        The connection does not queue behind the handler's own blocking waits; a c10d
        handler's is the one side connection per process its heartbeats use too, so a
        caller must not block in it (``Store.clone()`` makes a connection of one's own).
        """
        return None

    def liveness_window(self) -> timedelta | None:
        """How long after a node is lost the others have noticed it at the latest: the
        heartbeats it may miss, one more interval for the check that sees it, and one for
        writing the mark; ``None`` when the backend has no heartbeats."""
        return None

    @property
    def node_id(self) -> str | None:
        """This node's identity in the rendezvous (as torch's node descriptor: its address,
        process id and a counter), unique to this handler: an agent started again is a new
        node; ``None`` when the backend does not name its nodes."""
        return None

    @property
    def hosts_store(self) -> bool:
        """Whether this node's process serves the rendezvous store (the c10d node whose
        address is the endpoint): the store goes away when this process ends."""
        return False

    def leave(self) -> None:  # noqa: B027 - optional hook
        """This node leaves the job for good while the others go on (it was excluded), so
        that the next round does not wait for it; a backend without rounds does nothing."""

    @property
    def spare_round(self) -> int | None:
        """While ``next_rendezvous()`` waits because round ``k`` was already full at
        ``max_nodes`` when this node arrived (a spare, to take a lost node's place at a
        later round): ``k``; otherwise ``None``. Read from another thread; a handler with
        spares sets ``_spare_round`` while it waits."""
        return self._spare_round


class RendezvousParameters:
    """The parameters to construct a :class:`RendezvousHandler` (torch's class, same checks).

    Args:
        backend: name of the backend (``c10d``, ``file``, ``etcd``, ``static`` or a plugin).
        endpoint: where the backend lives, usually ``<host>[:<port>]``.
        run_id: the id of the job; nodes with the same run id meet.
        min_nodes: the minimum number of nodes to admit.
        max_nodes: the maximum number of nodes to admit.
        local_addr: the address of this node.
        **kwargs: backend options (strings from the CLI, or typed values).
    """

    def __init__(
        self,
        backend: str,
        endpoint: str,
        run_id: str,
        min_nodes: int,
        max_nodes: int,
        local_addr: str | None = None,
        **kwargs: Any,
    ) -> None:
        if not backend:
            raise ValueError("The rendezvous backend name must be a non-empty string.")
        if min_nodes < 1:
            raise ValueError(
                f"The minimum number of rendezvous nodes ({min_nodes}) must be greater than zero."
            )
        if max_nodes < min_nodes:
            raise ValueError(
                f"The maximum number of rendezvous nodes ({max_nodes}) must be greater than or "
                f"equal to the minimum number of rendezvous nodes ({min_nodes})."
            )
        self.backend = backend
        self.endpoint = endpoint
        self.run_id = run_id
        self.min_nodes = min_nodes
        self.max_nodes = max_nodes
        self.config: dict[str, Any] = kwargs
        self.local_addr = local_addr

    def get(self, key: str, default: Any = None) -> Any:
        """Return the value for ``key`` if ``key`` exists, else ``default``."""
        return self.config.get(key, default)

    def get_as_bool(self, key: str, default: bool | None = None) -> bool | None:
        """Return the value for ``key`` as a ``bool`` (1/0, true/false, t/f, yes/no, y/n)."""
        value = self.get(key, default)
        if value is None or isinstance(value, bool):
            return value
        if isinstance(value, int):
            if value in (0, 1):
                return value == 1
        elif isinstance(value, str):
            lowered = value.lower()
            if lowered in ("1", "true", "t", "yes", "y"):
                return True
            if lowered in ("0", "false", "f", "no", "n"):
                return False
        raise ValueError(
            f"The rendezvous configuration option '{key}' does not represent a valid boolean value."
        )

    def get_as_int(self, key: str, default: int | None = None) -> int | None:
        """Return the value for ``key`` as an ``int``."""
        value = self.get(key, default)
        if value is None:
            return None
        try:
            return int(value)
        except ValueError as exc:
            raise ValueError(
                f"The rendezvous configuration option '{key}' does not represent a valid integer "
                "value."
            ) from exc

    def __repr__(self) -> str:
        return (
            f"RendezvousParameters(backend={self.backend!r}, endpoint={self.endpoint!r}, "
            f"run_id={self.run_id!r}, min_nodes={self.min_nodes}, max_nodes={self.max_nodes})"
        )


RendezvousHandlerCreator = Callable[[RendezvousParameters], RendezvousHandler]
