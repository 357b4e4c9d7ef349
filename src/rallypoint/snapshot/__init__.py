"""Restart without losing work: in-memory snapshots kept by the node, replicated to a peer.

::

    from rallypoint import snapshot

    state = {"model": model, "optimizer": optimizer, "sampler": sampler}
    start = snapshot.restore(state) or 0        # the newest step every rank has, or None
    for step in range(start, total_steps):
        train_one_step()
        snapshot.save(state, step=step + 1)     # returns once the tensors are staged

- :func:`save`: copies the state's tensors into shared memory owned by the node's
  snapshot server (a process of ``rallypoint run``, not the worker), so it survives the
  worker; the server copies it to the next node's server in the background, so it
  survives the node. Two snapshots per rank per copy at most.
- :func:`restore`: every rank agrees on the newest snapshot every rank has complete
  (through the workers' store) and loads it in place, from its node or from the peer
  that holds its replica; else from ``--snapshot-dir`` (torch.distributed.checkpoint,
  resharded for a changed world); else ``None``.
- :func:`configure`: ``dir``, ``every``, ``timeout`` for this process; :func:`wait`: block
  until the last save is complete everywhere.

Outside ``rallypoint run`` the snapshots stay in the process (said once). See
``docs/snapshot.md`` for the design, what is restored after which failure, and the
security model. Exceptions: ``TypeError``/``ValueError`` for bad input, and
:class:`SnapshotError` (``RuntimeError``) when the job agreed on a snapshot that this rank
cannot load.

Importing this package loads nothing (not torch): each name is imported on first use.

Internal: ``serve`` (the node's snapshot server's loop, run in the process that
``rallypoint.supervise`` forks for it) resolves the same way, for the launcher side only;
it is not in ``__all__`` or ``dir()``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rallypoint._core.lazy import lazy_attributes

if TYPE_CHECKING:
    from rallypoint.snapshot._api import configure, restore, save, wait
    from rallypoint.snapshot._errors import SnapshotError

if TYPE_CHECKING:  # internal, for rallypoint.supervise (``X as X``: re-exported, for mypy)
    from rallypoint.snapshot._server import serve as serve

__all__ = ["SnapshotError", "configure", "restore", "save", "wait"]

__getattr__, __dir__ = lazy_attributes(
    __name__,
    globals(),
    {
        "SnapshotError": "rallypoint.snapshot._errors",
        "configure": "rallypoint.snapshot._api",
        "restore": "rallypoint.snapshot._api",
        "save": "rallypoint.snapshot._api",
        "wait": "rallypoint.snapshot._api",
    },
    public_home=True,
    internal={"serve": "rallypoint.snapshot._server"},
)
