"""``rallypoint build-native``: compile the RPC part's fast path (:mod:`rallypoint.rpc._native`).

Optional: without it ``rallypoint.rpc`` runs the same code in Python, ~10% slower on a
distributed-autograd training step. Needs a C++ compiler (``$CXX``, else ``c++``) and the
installed torch's headers (every torch wheel has them); takes ~25 s once per torch version.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

__all__ = ["build_native_main"]

PROG = "rallypoint build-native"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Compile rallypoint.rpc's optional C++ fast path for the installed torch "
        "(the RecvRpcBackward node and the lean wire form's tensor headers).",
    )
    p.add_argument("--force", action="store_true", help="compile again even if it is built")
    p.add_argument(
        "--check", action="store_true", help="only say whether it is built and used (exit 1: not)"
    )
    return p


def build_native_main(argv: Sequence[str] | None = None) -> int:
    """Exit 0 when the module is built (and loads), 1 when it cannot be, 2 on bad input."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:
        return int(exc.code) if isinstance(exc.code, int) else 2
    from rallypoint.rpc import _native

    if args.check:
        path = _native.module_path()
        if _native.NATIVE_MODULE is not None:
            print(f"{PROG}: built and used: {path}")
            return 0
        why = "turned off by RALLYPOINT_NATIVE=0" if not _native.enabled() else "not built"
        print(f"{PROG}: not used ({why}; looked for {path})")
        return 1
    started = time.monotonic()
    try:
        path = _native.build(force=args.force)
        _native.check_loadable(path)
    except _native.NativeBuildError as exc:
        sys.stderr.write(f"{PROG}: {exc}\n")
        return 1
    print(f"{PROG}: {path} ({time.monotonic() - started:.1f} s)")
    return 0
