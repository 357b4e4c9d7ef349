"""Job-level coordination: attempts, rounds, the restart budget, node loss, scale-up, and
the job's root cause.

Internal, the launcher side: ``rallypoint._launch`` and ``rallypoint._cli`` import its
modules directly. A coordinator owns one node's supervisor (``rallypoint._supervise``),
behind the ``NodeSupervisor`` Protocol (``_protocols``), and runs it attempt after attempt:

- ``_coordinator``: ``Coordinator``, the one restart loop: one node of a job, round after
  round; how the node joins each round is its ``Membership``:
- ``_rendezvous_rounds``: ``RendezvousRounds``, a node of a multi-node job, through a
  :mod:`rallypoint.rendezvous` handler (only its public API);
- ``_one_node``: ``OneNode``, a single-node launch (a static world, its records in memory);
- ``_monitor_tick``: what an elastic attempt checks each monitor tick, and the job-wide hang;
- ``_round``: the round and the restart policy (an outcome to the round's one decision);
  ``_job``, ``_stores``, ``_records``: the run, the store keys and the typed records the
  nodes exchange; ``_verdict``: the same error on every node;
  ``_signature``: when two failures are the same (futile restarts);
- ``_health/``: keeping bad nodes out: health checks, the burn-in and the exclusion list;
  ``_exits``: their exit statuses; ``_errors``: the rendezvous, exclusion and health errors;
- ``_rendezvous``: the agent's handler; ``_job_stacks``: a running job's stacks, asked for
  from outside it; ``_options``: the option groups this part reads.
"""
