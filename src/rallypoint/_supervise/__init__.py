"""One node's workers: start them from the warm process, watch them, stop them.

Internal, the launcher side: ``rallypoint._launch`` and ``rallypoint._elastic`` import its
modules directly; its public names (the errors) are re-exported by
:mod:`rallypoint.launcher`. What runs inside a worker on the agent's behalf
(``@restartable``) is ``rallypoint._worker_side``. The parts:

- ``_warm/``: the warm process that imports torch once and forks every worker, and the
  one reader of its exit reports (``_warm/_exits``);
- ``_inprocess/``: in-process restarts, the agent's side: the restart's state and timers,
  and the spare workers; ``_kept``: the one owner of the workers kept between attempts
  (parked by an in-process restart or a hot spare, and the spares);
- ``_starter``: an attempt's worker specs, pipes and output files; ``_worker`` /
  ``_spawn_entry`` / ``_main_module``: what a worker does around the user's code (forked,
  or spawned with the caller's ``__main__``);
- ``_supervisor``, ``_attempt``: one attempt, its ``Outcome`` (``_state``); ``_stop_reasons``:
  why it stops besides exits (the caller's ``AttemptPolicy``, a single node's hang);
  ``_signals``, ``_stop``: signals, stopping whole process trees;
- ``_env``, ``_identity``, ``_output``, ``_numa``, ``_limits``: what each worker is given;
  ``_results``: what a ``launch()`` worker returns;
- ``_summary``: what a failed worker left behind, and the console's lines about it;
  ``_errors``: the launcher's errors; ``_options``: the option groups this part reads.

Nothing here is imported at import time: ``rallypoint run`` imports ``_warm._process`` and
forks the warm process before anything else is loaded.
"""
