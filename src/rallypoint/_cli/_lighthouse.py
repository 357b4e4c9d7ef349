"""``rallypoint lighthouse``: torchft's ``torchft_lighthouse``, on rallypoint's stores.

Its flags in both spellings (``--min_replicas``/``--min-replicas``, ...); ``--store
etcd://...`` keeps the state in an etcd cluster instead of hosting a TCPStore. It runs
until SIGINT or SIGTERM and prints each new quorum.
"""

from __future__ import annotations

import argparse
import signal
import sys

__all__ = ["lighthouse_main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rallypoint lighthouse",
        description="Where replica groups agree on each step's quorum (torchft's lighthouse).",
    )
    p.add_argument(
        "--min_replicas",
        "--min-replicas",
        type=int,
        required=True,
        help="replica groups a quorum needs (until the first one forms, and after)",
    )
    p.add_argument(
        "--bind", default="[::]:29510", help="HOST:PORT of the store (default [::]:29510)"
    )
    p.add_argument(
        "--join_timeout_ms",
        "--join-timeout-ms",
        type=int,
        default=60000,
        help="how long the first quorum waits for every known group (ms)",
    )
    p.add_argument(
        "--quorum_tick_ms",
        "--quorum-tick-ms",
        type=int,
        default=100,
        help="how often the lighthouse looks at what time alone decides: heartbeats, the "
        "join timeout (ms; asks are answered as they come)",
    )
    p.add_argument(
        "--heartbeat_timeout_ms",
        "--heartbeat-timeout-ms",
        type=int,
        default=5000,
        help="a group whose heartbeat stops this long is gone (its agent usually says so at once)",
    )
    p.add_argument(
        "--store",
        default=None,
        help="etcd://HOST:PORT[,HOST:PORT...]: keep the state in etcd instead of a TCPStore",
    )
    return p


def lighthouse_main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    from rallypoint.ft.lighthouse import STORE_CONNECT_S, LighthouseServer
    from rallypoint.rendezvous import KVError

    def say(line: str) -> None:
        print(f"rallypoint lighthouse: {line}", flush=True)

    if args.store:  # an etcd that does not answer is waited for: said first, not after
        say(f"connecting to {args.store} (up to {STORE_CONNECT_S} s)")
    try:
        server = LighthouseServer(
            args.bind,
            args.min_replicas,
            args.join_timeout_ms,
            args.quorum_tick_ms,
            args.heartbeat_timeout_ms,
            store=args.store,
            say=say,
        )
    except (ValueError, KVError) as exc:
        sys.stderr.write(f"rallypoint lighthouse: error: {exc}\n")
        return 2

    def stop(*_: object) -> None:
        raise _Stopped  # out of the wait; the shutdown runs outside the handler

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop)
    rules = server.rules
    try:
        print(
            f"rallypoint lighthouse: {server.address()} (min_replicas {rules.min_replicas}, "
            f"join_timeout_ms {rules.join_timeout_ms}, heartbeat_timeout_ms "
            f"{rules.heartbeat_timeout_ms}); set TORCHFT_LIGHTHOUSE={server.address()}",
            flush=True,
        )
        server.wait()
    except _Stopped:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)  # a second one does not cut the shutdown
        server.shutdown()
    return 0


class _Stopped(Exception):
    """SIGINT or SIGTERM. A shutdown run inside the handler could wait forever on a lock
    that the interrupted main thread holds (``wait``'s event takes a plain lock each
    second): a lighthouse beside a busy test suite once did not end in 30 s."""
