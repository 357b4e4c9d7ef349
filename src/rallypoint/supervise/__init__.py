"""One node's workers: start them from the warm process, watch them, stop them.

Internal; the public names live in :mod:`rallypoint.launcher`. The parts:

- ``_warm/``: the warm process that imports torch once and forks every worker (``_server``),
  the supervisor's handle on it (``_process``), the typed messages between them
  (``_messages``), the OpenMP fork probe and the snapshot server it forks;
- ``_worker`` / ``_spawned``: what a worker does before and after the user's code;
- ``_env``: the environment torchrun gives workers; ``_output``: their stdout/stderr;
- ``_supervisor``: :class:`Supervisor` runs one attempt of the local workers under a
  policy (``_policy``) and returns an ``Outcome`` (``_state``);
- ``_signals``, ``_stop``: signals to the launcher, stopping whole process trees;
- ``_summary``: what a failed worker left behind, and the failure screen;
- ``_options``: the option groups this part reads; ``_errors``: the launcher's errors;
- ``_numa``: ``numa_binding``, each worker on the CPUs near its GPU (torch's rules, run by
  ``_warm._numa_probe`` in a child of the warm process).

This package imports nothing at import time: ``rallypoint run`` imports ``_warm._process`` and forks
the warm process before anything else is loaded. Its face below offers the packages above it
(``rallypoint.elastic``, ``rallypoint.launcher``, ``rallypoint.cli``, ``rallypoint.__main__``)
the names they use, each imported on first access; they import nothing else from here:

- to the launcher: the errors (re-exported by ``rallypoint.launcher``), the option groups,
  :class:`Supervisor`, :class:`WarmProcess`, :class:`Target`, signals, the fork probe;
- to the coordinators (``rallypoint.elastic``): an attempt's ``Outcome`` and its parts, the
  policies, failure signatures and summaries, ``write_console``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rallypoint._core.lazy import homes, lazy_attributes

if TYPE_CHECKING:
    from rallypoint.supervise._env import user_rpc_secret
    from rallypoint.supervise._errors import (
        BadTargetError,
        FatalError,
        HangError,
        LaunchError,
        LaunchInterruptedError,
        LaunchTimeoutError,
        NodeExcludedError,
        PortInUseError,
        RendezvousFailedError,
        UnhealthyNodeError,
        WarmErrorKind,
        WarmProcessError,
        WorkerFailedError,
        WorkerSummary,
    )
    from rallypoint.supervise._inprocess import in_process_line
    from rallypoint.supervise._numa import NUMA_MODES
    from rallypoint.supervise._options import (
        DEFAULT_PREFIX,
        OutputOptions,
        StdSpec,
        StopOptions,
        WorkerOptions,
        WorldOptions,
        parse_std_spec,
    )
    from rallypoint.supervise._output import write_console
    from rallypoint.supervise._policy import AttemptPolicy, LocalPolicy, collective_timeout_reason
    from rallypoint.supervise._restartable import RestartInterrupt, restartable
    from rallypoint.supervise._signals import SignalQueue
    from rallypoint.supervise._signature import Streak, failure_signature, repeated_line
    from rallypoint.supervise._state import (
        Culprit,
        Failure,
        GroupInfo,
        Outcome,
        OutcomeKind,
        Stop,
    )
    from rallypoint.supervise._summary import format_summary, peer_vanished
    from rallypoint.supervise._supervisor import Supervisor, prepare_warm
    from rallypoint.supervise._warm._fork_probe import openmp_survives_fork
    from rallypoint.supervise._warm._process import WarmProcess
    from rallypoint.supervise._worker import CALLABLES, Target

# private module -> the names it offers the packages above (each resolved on first access)
_MODULES = {
    "_env": ("user_rpc_secret",),
    "_errors": (
        "BadTargetError",
        "FatalError",
        "HangError",
        "LaunchError",
        "LaunchInterruptedError",
        "LaunchTimeoutError",
        "NodeExcludedError",
        "PortInUseError",
        "RendezvousFailedError",
        "UnhealthyNodeError",
        "WarmErrorKind",
        "WarmProcessError",
        "WorkerFailedError",
        "WorkerSummary",
    ),
    "_warm._fork_probe": ("openmp_survives_fork",),
    "_numa": ("NUMA_MODES",),
    "_options": (
        "DEFAULT_PREFIX",
        "OutputOptions",
        "StdSpec",
        "StopOptions",
        "WorkerOptions",
        "WorldOptions",
        "parse_std_spec",
    ),
    "_inprocess": ("in_process_line",),
    "_output": ("write_console",),
    "_restartable": ("RestartInterrupt", "restartable"),
    "_policy": ("AttemptPolicy", "LocalPolicy", "collective_timeout_reason"),
    "_signals": ("SignalQueue",),
    "_signature": ("Streak", "failure_signature", "repeated_line"),
    "_state": ("Culprit", "Failure", "GroupInfo", "Outcome", "OutcomeKind", "Stop"),
    "_summary": ("format_summary", "peer_vanished"),
    "_supervisor": ("Supervisor", "prepare_warm"),
    "_warm._process": ("WarmProcess",),
    "_worker": ("CALLABLES", "Target"),
}
_HOME = homes(__name__, _MODULES)

__all__ = [
    "CALLABLES",
    "DEFAULT_PREFIX",
    "NUMA_MODES",
    "AttemptPolicy",
    "BadTargetError",
    "Culprit",
    "Failure",
    "FatalError",
    "GroupInfo",
    "HangError",
    "LaunchError",
    "LaunchInterruptedError",
    "LaunchTimeoutError",
    "LocalPolicy",
    "NodeExcludedError",
    "Outcome",
    "OutcomeKind",
    "OutputOptions",
    "PortInUseError",
    "RendezvousFailedError",
    "RestartInterrupt",
    "SignalQueue",
    "StdSpec",
    "Stop",
    "StopOptions",
    "Streak",
    "Supervisor",
    "Target",
    "UnhealthyNodeError",
    "WarmErrorKind",
    "WarmProcess",
    "WarmProcessError",
    "WorkerFailedError",
    "WorkerOptions",
    "WorkerSummary",
    "WorldOptions",
    "collective_timeout_reason",
    "failure_signature",
    "format_summary",
    "in_process_line",
    "openmp_survives_fork",
    "parse_std_spec",
    "peer_vanished",
    "prepare_warm",
    "repeated_line",
    "restartable",
    "user_rpc_secret",
    "write_console",
]


__getattr__, __dir__ = lazy_attributes(__name__, globals(), _HOME)
