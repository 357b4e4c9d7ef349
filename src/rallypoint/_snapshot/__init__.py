"""In-memory snapshots: the worker's API, the node's snapshot server, the peer replica and
the checkpoint directory.

Internal: the public names are re-exported by :mod:`rallypoint.snapshot`; the launcher
side forks the node's server (``_server.serve``) from its warm process.

- ``_api``: ``save``, ``restore``, ``configure``, ``wait``; ``_local``: outside a launch;
- ``_node``, ``_client``, ``_agree``: a rank's snapshots through its node's server, and
  the newest snapshot every rank has;
- ``_server``, ``_records``, ``_wire``, ``_auth``: the node's server, its slots, the wire
  form and the handshake between servers and clients;
- ``_flatten``, ``_layout``: a state dict as tensors in shared memory;
- ``_persist``, ``_snapshot_dir``: torch.distributed.checkpoint in ``--snapshot-dir``;
- ``_options``, ``_errors``, ``_report``: settings, errors, the events a rank reports.
"""
