"""Keeping bad nodes out of the job: health checks, the burn-in and the exclusion list.

Internal: the coordinator (``rallypoint._elastic._coordinator``), a multi-node job's rounds
(``_rendezvous_rounds``) and the launch (``rallypoint._launch._run_job``) import its modules
directly.

- ``_checks``: ``HealthChecks``, the ``--health-check`` list a node runs before it joins a
  round, and the failure screen; ``_check_run``: running one check within its time limit;
  ``_builtin_checks``: ``builtin:disk``, ``builtin:store``, ``builtin:gpu`` (``_gpu_probe``,
  run as ``python -m rallypoint._elastic._health._gpu_probe``);
- ``_burn_in``: after a round forms, a node whose link or GPU is much slower;
- ``_exclusion``: an excluded agent leaves the job (the store's host stays to serve it).
"""
