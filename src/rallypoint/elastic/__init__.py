"""Job-level coordination: attempts, rounds, the restart budget, node loss, scale-up, and
the job's root cause.

Internal; the public names live in :mod:`rallypoint.launcher`. A coordinator owns one
node's supervisor (``rallypoint.supervise``), behind the :class:`NodeSupervisor` Protocol
(``_protocols``), and runs it attempt after attempt:

- ``_local``: :class:`LocalCoordinator`, one node on its own (a static world);
- ``_coordinator``: :class:`ElasticCoordinator`, one node of a multi-node job, round after
  round through a ``rallypoint.rendezvous`` handler (only its public API: ``round``,
  ``open_run_store()``, ``liveness_window()``, ``num_nodes_waiting()``...);
- ``_policy``: what an elastic attempt checks each monitor tick, and the job-wide hang;
- ``_job``, ``_round``, ``_stores``, ``_records``: the run and the round, their store keys
  and the typed records the nodes exchange; ``_verdict``: the same error on every node;
- ``_rendezvous``: the agent's handler; ``_options``: the option groups this part reads.
"""
