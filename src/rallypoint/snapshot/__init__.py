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

Importing this package loads nothing (not torch): each name is imported on first use. The
machinery lives in ``rallypoint._snapshot``, shared with the launcher side, which forks
the node's snapshot server (``rallypoint._snapshot._server``).
"""

from typing import TYPE_CHECKING

from rallypoint._core.public import lazy_face

if TYPE_CHECKING:
    from rallypoint._snapshot._api import configure as configure
    from rallypoint._snapshot._api import restore as restore
    from rallypoint._snapshot._api import save as save
    from rallypoint._snapshot._api import wait as wait
    from rallypoint._snapshot._errors import SnapshotError as SnapshotError

__all__ = [
    "SnapshotError",
    "configure",
    "restore",
    "save",
    "wait",
]

_HOMES = {
    "SnapshotError": "rallypoint._snapshot._errors",
    "configure": "rallypoint._snapshot._api",
    "restore": "rallypoint._snapshot._api",
    "save": "rallypoint._snapshot._api",
    "wait": "rallypoint._snapshot._api",
}
"""Each name's module, imported on first access (PEP 562)."""

lazy_face(__name__)  # its __getattr__ and __dir__ read _HOMES (mypy reads the imports above)
del lazy_face
