"""Entry point of a ``start_method="spawn"`` worker: a fresh interpreter runs the target.

Invoked as ``python -u -m rallypoint._supervise._spawn_entry KIND NAME [ARGS...]`` by a child of
the warm process that has already set up the session, stdio, environment and cwd.
"""

from __future__ import annotations

import sys

from rallypoint._supervise._worker import RESULT_FD, Target, execute


def main() -> None:
    kind, name, *args = sys.argv[1:]
    if kind not in ("script", "module", "payload"):
        raise SystemExit(f"rallypoint: unknown target kind {kind!r}")
    result_fd = RESULT_FD if kind == "payload" else -1
    execute(Target(kind, name, tuple(args)), result_fd)  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
