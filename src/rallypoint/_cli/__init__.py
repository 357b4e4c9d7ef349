"""The ``rallypoint`` command line: flags, ``PET_*`` and SLURM in, a config out.

Internal: ``python -m rallypoint`` / the ``rallypoint`` script run ``_main.main``, which
dispatches to one entry point per command (``argv -> exit status``):

- ``_run.run_main``: ``rallypoint run`` (``_parser``: torchrun's options; ``_args``: to a
  ``LaunchConfig``; ``_cluster_env``: ``PET_*`` and SLURM defaults);
- ``_stacks.stacks_main``: ``rallypoint stacks``; ``_report.report_main``: ``rallypoint
  report``.

Nothing here decides how a job runs: that is ``rallypoint._launch`` and below.
"""
