"""One node's workers: start them from the warm process, watch them, stop them.

Internal; the public names live in :mod:`rallypoint.launcher`. The parts:

- ``_warm`` / ``_warm_server`` / ``_messages``: the warm process that imports torch once
  and forks every worker, and the typed messages between it and the supervisor;
- ``_worker`` / ``_spawned``: what a worker does before and after the user's code;
- ``_env``: the environment torchrun gives workers; ``_output``: their stdout/stderr;
- ``_supervisor``: :class:`Supervisor` runs one attempt of the local workers under a
  policy (``_policy``) and returns an ``Outcome`` (``_state``);
- ``_signals``, ``_stop``: signals to the launcher, stopping whole process trees;
- ``_summary``: what a failed worker left behind, and the failure screen;
- ``_options``: the option groups this part reads; ``_errors``: the launcher's errors.

This package imports nothing at import time: ``rallypoint run`` imports ``_warm`` and forks
the warm process before anything else is loaded.
"""
