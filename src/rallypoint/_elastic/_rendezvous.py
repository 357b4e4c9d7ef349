"""The agent's rendezvous handler and the run's store, through the handler's public API."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rallypoint._elastic._errors import RendezvousFailedError
from rallypoint._elastic._options import RendezvousOptions

if TYPE_CHECKING:
    from rallypoint._core.store import Store
    from rallypoint.rendezvous import RendezvousHandler

__all__ = [
    "AGENT_KEEP_ALIVE_INTERVAL",
    "connect",
    "create_rendezvous",
    "open_run_store",
    "run_store_namespace",
]

AGENT_KEEP_ALIVE_INTERVAL = 3.0
"""Seconds between an agent's heartbeats unless ``--rdzv-conf keep_alive_interval=`` says
otherwise; with the default 3 missed beats a lost node is noticed within 12 s."""


def run_store_namespace(run_id: str) -> str:
    """Where the run store's keys live on the rendezvous backend."""
    return f"rallypoint/{run_id}/job"


def create_rendezvous(
    backend: str,
    endpoint: str,
    run_id: str,
    min_nodes: int,
    max_nodes: int,
    conf: dict[str, str],
    local_addr: str | None = None,
) -> RendezvousHandler:
    """A ``rallypoint.rendezvous`` handler for the agent (the workers' store is ours)."""
    from rallypoint.rendezvous import RendezvousParameters, rendezvous_handler_registry

    options: dict[str, Any] = dict(conf)
    options.setdefault("use_agent_store", "false")
    # torch's handler default is 5 s x 3 missed beats, and a loss is noticed within one
    # interval more than that (20 s); the agent promises at most 15 s by default: 3 s x 4 = 12 s.
    options.setdefault("keep_alive_interval", str(AGENT_KEEP_ALIVE_INTERVAL))
    params = RendezvousParameters(
        backend=backend,
        endpoint=endpoint,
        run_id=run_id,
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        local_addr=local_addr,
        **options,
    )
    return rendezvous_handler_registry.create_handler(params)


def connect(options: RendezvousOptions, run_id: str) -> RendezvousHandler:
    """This node's handler for the job; :class:`RendezvousFailedError` if it cannot be made."""
    from rallypoint.rendezvous import KVError, RendezvousError

    conf = {k: str(v) for k, v in options.conf.items()}
    if options.backend == "static" and options.node_rank is not None:
        conf.setdefault("rank", str(options.node_rank))
    try:
        return create_rendezvous(
            options.backend,
            options.endpoint,
            run_id,
            options.min_nodes,
            options.max_nodes,
            conf,
            options.local_addr,
        )
    except (RendezvousError, KVError, RuntimeError) as exc:
        raise RendezvousFailedError(f"rendezvous {options.endpoint!r}: {exc}") from None


def open_run_store(handler: RendezvousHandler, run_id: str, endpoint: str) -> Store | None:
    """A new connection to the run's store (``None``: the backend has none, use the round's)."""
    from rallypoint._core.torch_c import as_torch_store
    from rallypoint.rendezvous import KVError, RendezvousError

    try:
        store = handler.open_run_store(run_store_namespace(run_id))
    except (RendezvousError, KVError, RuntimeError) as exc:
        raise RendezvousFailedError(f"rendezvous {endpoint!r}: {exc}") from None
    return None if store is None else as_torch_store(store)
