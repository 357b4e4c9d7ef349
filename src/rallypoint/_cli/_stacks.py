"""``rallypoint stacks --rdzv-endpoint HOST:PORT --rdzv-id JOB``: every worker's stacks, grouped.

Prints ``_elastic._job_stacks.job_stacks``'s report: the collective view from the workers'
Flight Recorders (each process group's last collective completed by all its members, what
is pending on which ranks), the stacks grouped by identical stacks, and one line per node
that did not answer or answered in part (an agent caps its answer).
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
        "--rdzv-backend",
        "--rdzv_backend",
        default="c10d",
        help="the job's backend: c10d, etcd, file, or an installed plugin's",
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
    from rallypoint._elastic._errors import RendezvousFailedError
    from rallypoint._elastic._job_stacks import job_stacks
    from rallypoint._elastic._options import check_backend

    try:  # the names the rendezvous registry knows, as rallypoint run takes them
        check_backend(args.rdzv_backend, "--rdzv-backend")
    except ValueError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2

    try:
        report, missing = job_stacks(
            args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id, args.timeout
        )
    except (RendezvousFailedError, ValueError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    print(report)
    for node, why in sorted(missing.items()):
        print(f"node {node}: {why}")
    return 1 if missing else 0
