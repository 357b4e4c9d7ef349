"""Launching a job: :func:`launch`, its :class:`LaunchConfig`, and running one job on this
node (``run_job``, shared by ``launch`` and ``rallypoint run``).

Internal: the public names are re-exported by :mod:`rallypoint.launcher`; ``rallypoint._cli``
imports ``_run_job`` and ``_config`` directly.

- ``_config``: ``LaunchConfig``, whose fields declare every option once, its default and
  its check included (``_option``: the declarations' metadata and how the groups are made
  from it; ``_values``: what their values mean), stored in the option groups of the parts
  below, which take the checked values as they are;
- ``_api``: :func:`launch`;
- ``_run_job``: the observer, the supervisor and the coordinator that owns it.
"""
