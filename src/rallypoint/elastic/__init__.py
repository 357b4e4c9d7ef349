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

Its face below offers the packages above it (``rallypoint.launcher``, ``rallypoint.cli``)
the names they use, each imported on first access (importing this package loads nothing);
they import nothing else from here: the two coordinators, the option groups (and
``parse_nnodes``, ``BUILTIN_CHECKS`` for the CLI), the health checks, the exit statuses of
an excluded or unhealthy node, connecting to the rendezvous (and the run store's
namespace, for ``rallypoint stacks``), and ``stop_on_signal``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rallypoint._core.lazy import homes, lazy_attributes

if TYPE_CHECKING:
    from rallypoint.elastic._check_run import HealthContext
    from rallypoint.elastic._coordinator import ElasticCoordinator
    from rallypoint.elastic._exits import EXIT_EXCLUDED, EXIT_UNHEALTHY
    from rallypoint.elastic._health import HealthChecks
    from rallypoint.elastic._job import stop_on_signal
    from rallypoint.elastic._local import LocalCoordinator
    from rallypoint.elastic._options import (
        BUILTIN_CHECKS,
        HealthOptions,
        RendezvousOptions,
        RestartOptions,
        parse_nnodes,
    )
    from rallypoint.elastic._rendezvous import connect, create_rendezvous, run_store_namespace

# private module -> the names it offers the packages above (each resolved on first access)
_MODULES = {
    "_check_run": ("HealthContext",),
    "_coordinator": ("ElasticCoordinator",),
    "_exits": ("EXIT_EXCLUDED", "EXIT_UNHEALTHY"),
    "_health": ("HealthChecks",),
    "_job": ("stop_on_signal",),
    "_local": ("LocalCoordinator",),
    "_options": (
        "BUILTIN_CHECKS",
        "HealthOptions",
        "RendezvousOptions",
        "RestartOptions",
        "parse_nnodes",
    ),
    "_rendezvous": ("connect", "create_rendezvous", "run_store_namespace"),
}
_HOME = homes(__name__, _MODULES)

__all__ = [
    "BUILTIN_CHECKS",
    "EXIT_EXCLUDED",
    "EXIT_UNHEALTHY",
    "ElasticCoordinator",
    "HealthChecks",
    "HealthContext",
    "HealthOptions",
    "LocalCoordinator",
    "RendezvousOptions",
    "RestartOptions",
    "connect",
    "create_rendezvous",
    "parse_nnodes",
    "run_store_namespace",
    "stop_on_signal",
]


__getattr__, __dir__ = lazy_attributes(__name__, globals(), _HOME)
