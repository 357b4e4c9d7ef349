"""The ``rallypoint`` command line: flags, ``PET_*`` and SLURM in, a config out.

Internal; ``python -m rallypoint`` / the ``rallypoint`` script (``rallypoint.__main__``)
dispatch to:

- ``_run``: ``rallypoint run`` (``_parser``: torchrun's options; ``_args``: to a
  ``LaunchConfig``; ``_cluster_env``: ``PET_*`` and SLURM defaults);
- ``_stacks``: ``rallypoint stacks``; ``_report``: ``rallypoint report``.

Nothing here decides how a job runs: that is ``rallypoint.launcher`` and below.

Its face offers ``rallypoint.__main__`` one entry point per command, ``run_main``,
``report_main`` and ``stacks_main`` (each ``argv -> exit status``), imported on first
access: importing this package loads nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rallypoint._core.lazy import homes, lazy_attributes

if TYPE_CHECKING:
    from rallypoint.cli._report import report_main
    from rallypoint.cli._run import run_main
    from rallypoint.cli._stacks import stacks_main

# private module -> the names it offers rallypoint.__main__ (each resolved on first access)
_MODULES = {
    "_report": ("report_main",),
    "_run": ("run_main",),
    "_stacks": ("stacks_main",),
}
_HOME = homes(__name__, _MODULES)

__all__ = [
    "report_main",
    "run_main",
    "stacks_main",
]


__getattr__, __dir__ = lazy_attributes(__name__, globals(), _HOME)
