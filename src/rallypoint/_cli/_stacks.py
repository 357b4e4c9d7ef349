"""``rallypoint stacks --rdzv-endpoint HOST:PORT --rdzv-id JOB``: every worker's stacks, grouped.

Connects to the job's rendezvous store as a client (it never hosts one), asks every agent
of the run for its workers' Python stacks (the agents answer from their monitor loop) and
prints them grouped by identical stacks, plus one line per node that did not answer (or
answered in part: an agent caps its answer, ``_watch._stacks_exchange``). Above
the stacks, the collective view from the workers' Flight Recorders: each process group's
last collective completed by all its members, and what is pending on which ranks.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["stacks_main"]

PROG = "rallypoint stacks"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Print the Python stacks of every worker of a running multi-node job, "
        "grouped by identical stacks.",
    )
    p.add_argument("--rdzv-endpoint", "--rdzv_endpoint", required=True, help="HOST:PORT")
    p.add_argument("--rdzv-id", "--rdzv_id", required=True, help="the job's run id")
    p.add_argument(
        "--rdzv-backend", "--rdzv_backend", default="c10d", choices=["c10d", "etcd", "file"]
    )
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for answers")
    return p


def stacks_main(argv: Sequence[str] | None = None) -> int:
    """Exit 0 when every node answered in full, 1 when some did not, 2 on bad input."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:
        return int(exc.code) if isinstance(exc.code, int) else 2
    if args.timeout <= 0:
        print(f"{PROG}: error: --timeout must be > 0, got {args.timeout}", file=sys.stderr)
        return 2
    from rallypoint._core.torch_c import as_torch_store
    from rallypoint._elastic._rendezvous import create_rendezvous, run_store_namespace
    from rallypoint._watch._flight._format import format_hang_report
    from rallypoint._watch._stacks_exchange import request_stacks
    from rallypoint.rendezvous import RendezvousError

    conf = {"is_host": "false", "read_timeout": str(max(args.timeout, 1.0))}
    try:
        handler = create_rendezvous(args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id, 1, 1, conf)
        store = handler.open_run_store(run_store_namespace(args.rdzv_id))
        if store is None:
            raise ValueError(f"the {args.rdzv_backend} backend has no store to ask")
        dumps, missing = request_stacks(as_torch_store(store), timeout=args.timeout)
    except (RendezvousError, ValueError, RuntimeError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    print(format_hang_report(dumps, hang=False) if dumps else "(no running workers answered)")
    for node, why in sorted(missing.items()):
        print(f"node {node}: {why}")
    return 1 if missing else 0
