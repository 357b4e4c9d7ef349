"""The ``static`` backend: rank and world size come from the parameters, no negotiation.

This is torchrun's ``--rdzv-backend=static`` (its default without ``--rdzv-backend``):
node ``rank`` 0 hosts a TCPStore at the endpoint, every node connects to it, and the
world size is ``max_nodes``. Messages match torch's ``static_tcp_rendezvous``.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING

from rallypoint._core.blocking import call_in_thread
from rallypoint.rendezvous._api import (
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
)
from rallypoint.rendezvous._endpoint import parse_rendezvous_endpoint

if TYPE_CHECKING:
    from rallypoint._core.torch_c import TCPStore

_DEFAULT_TIMEOUT_S = 600


class StaticRendezvousHandler(RendezvousHandler):
    """A fixed group: ``rank`` of ``world_size`` nodes around a TCPStore at rank 0."""

    def __init__(
        self,
        master_addr: str,
        master_port: int,
        rank: int,
        world_size: int,
        run_id: str,
        timeout: timedelta,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank ({rank}) must be in [0, world_size={world_size}).")
        self.master_addr = master_addr
        self.master_port = master_port
        self.rank = rank
        self.world_size = world_size
        self.run_id = run_id
        self.timeout = timeout
        self._store: TCPStore | None = None

    def get_backend(self) -> str:
        return "static"

    @property
    def use_agent_store(self) -> bool:
        return True

    def next_rendezvous(self) -> RendezvousInfo:
        from rallypoint._core.torch_c import PrefixStore, TCPStore

        if self._store is None:
            seconds = self.timeout.total_seconds()
            try:
                # bounded by the timeout: torch's connect can retry past it, and its ping
                # blocks for good on a server that accepted and never answers
                self._store = call_in_thread(
                    lambda: TCPStore(
                        self.master_addr,
                        self.master_port,
                        self.world_size,
                        self.rank == 0,
                        self.timeout,
                        multi_tenant=True,
                    ),
                    timeout=seconds,
                    name="rallypoint-static-store",
                    finishes_within=2 * seconds + 1.0,
                )
            except TimeoutError:
                raise RendezvousConnectionError(
                    f"Cannot reach the static rendezvous store at "
                    f"{self.master_addr}:{self.master_port} within {seconds:g} s"
                ) from None
            except (RuntimeError, ValueError) as exc:
                raise RendezvousConnectionError(
                    f"Cannot reach the static rendezvous store at "
                    f"{self.master_addr}:{self.master_port}: {type(exc).__name__}: {exc}"
                ) from exc
        store = PrefixStore(self.run_id, self._store)
        info = RendezvousStoreInfo(self.master_addr, self.master_port)
        return RendezvousInfo(store, self.rank, self.world_size, info)

    def is_closed(self) -> bool:
        return False

    def set_closed(self) -> None:
        pass

    def num_nodes_waiting(self) -> int:
        return 0

    def get_run_id(self) -> str:
        return self.run_id

    def shutdown(self) -> bool:
        return True


def create_static_handler(params: RendezvousParameters) -> StaticRendezvousHandler:
    """Build the static handler (torch's checks and messages)."""
    if "rank" not in params.config:
        raise ValueError(
            "rank is absent in RendezvousParameters.Try add --node-rank to the cmd request"
        )
    endpoint = params.endpoint.strip() if params.endpoint else ""
    if not endpoint:
        raise ValueError(
            "endpoint is absent in RendezvousParametersTry add --master-port and --master-addr "
            "to the cmd request"
        )
    master_addr, master_port = parse_rendezvous_endpoint(endpoint, -1)
    if master_port == -1:
        raise ValueError(
            f"Port is absent in endpoint: {endpoint}. Try launching with --master-port"
        )
    rank = params.get_as_int("rank")
    assert rank is not None
    timeout = params.get_as_int("timeout", _DEFAULT_TIMEOUT_S)
    assert timeout is not None
    if timeout <= 0:
        raise ValueError(
            f"The rendezvous configuration option 'timeout' must be positive, got {timeout}."
        )
    return StaticRendezvousHandler(
        master_addr, master_port, rank, params.max_nodes, params.run_id, timedelta(seconds=timeout)
    )
