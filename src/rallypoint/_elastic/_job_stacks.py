"""A running job's workers' stacks, asked for from outside it (``rallypoint stacks``)."""

from __future__ import annotations

from rallypoint._elastic._errors import RendezvousFailedError
from rallypoint._elastic._rendezvous import (
    create_rendezvous,
    open_run_store,
    run_store_namespace,
)

__all__ = ["job_stacks"]


def job_stacks(
    backend: str, endpoint: str, run_id: str, timeout: float
) -> tuple[str, dict[int, str]]:
    """Every running worker's stacks, grouped, with the collective view of their Flight
    Recorders above them, and ``{node_rank: why}`` for each node that did not answer in
    full within ``timeout`` seconds.

    Connects to the job's rendezvous store as a client (it never hosts one); every agent of
    the run answers from its monitor loop. :class:`RendezvousFailedError` when the store
    cannot be reached, ``ValueError`` when the backend has no store or no agent of the run
    is running.
    """
    from rallypoint._watch._flight._format import format_hang_report
    from rallypoint._watch._stacks_exchange import MalformedRequestCounter, request_stacks
    from rallypoint.rendezvous import KVError, RendezvousError

    conf = {"is_host": "false", "read_timeout": str(max(timeout, 1.0))}
    try:
        handler = create_rendezvous(backend, endpoint, run_id, 1, 1, conf)
    except (RendezvousError, KVError, RuntimeError) as exc:
        raise RendezvousFailedError(f"rendezvous {endpoint!r}: {exc}") from None
    store = open_run_store(handler, run_id, endpoint)
    if store is None:
        raise ValueError(f"the {backend} backend has no store to ask")
    try:
        dumps, missing = request_stacks(store, timeout=timeout)
    except MalformedRequestCounter as exc:
        raise ValueError(exc.message(run_store_namespace(run_id))) from None
    except RuntimeError as exc:  # the store's connection broke while waiting
        raise RendezvousFailedError(f"rendezvous {endpoint!r}: {exc}") from None
    report = format_hang_report(dumps, hang=False) if dumps else "(no running workers answered)"
    return report, missing
