"""The ``rallypoint`` command line: flags, ``PET_*`` and SLURM in, a config out.

Internal; ``python -m rallypoint`` / the ``rallypoint`` script (``rallypoint.__main__``)
dispatch to:

- ``_run``: ``rallypoint run`` (``_parser``: torchrun's options; ``_args``: to a
  ``LaunchConfig``; ``_cluster_env``: ``PET_*`` and SLURM defaults);
- ``_stacks``: ``rallypoint stacks``; ``_report``: ``rallypoint report``.

Nothing here decides how a job runs: that is ``rallypoint.launcher`` and below.
"""
