"""``rallypoint run``: torchrun's command line on the fast launcher.

Every torchrun option is accepted with both spellings (``--nproc-per-node`` and
``--nproc_per_node``) and ``PET_<OPTION>`` environment defaults, as torchrun reads them
(``_parser``); the arguments become a ``LaunchConfig`` (``_args``). Bad input gives one
line on stderr and exit status 2.
"""

from __future__ import annotations

import contextlib
import signal
import sys

from rallypoint.supervise._warm import WarmProcess

__all__ = ["main", "run_main"]


def _fail(prog: str, message: str) -> int:
    sys.stderr.write(f"{prog}: error: {message}\n")
    sys.stderr.flush()
    return 2


def run_main(argv: list[str], warm: WarmProcess | None = None) -> int:
    """Parse ``argv`` (after ``run``) and run the job; returns the exit status."""
    if warm is None:
        warm = WarmProcess.fork()
    try:
        from rallypoint.cli._args import config_from_args
        from rallypoint.cli._parser import PROG, build_parser

        try:
            args = build_parser().parse_args(argv)
            config, target = config_from_args(args)
        except SystemExit as exc:  # --help
            warm.kill()
            return exc.code if isinstance(exc.code, int) else 0
        except (ValueError, TypeError) as exc:
            warm.kill()
            return _fail(PROG, str(exc))
        from rallypoint.launcher._run import run_job

        title = f"{PROG} {'-m ' if target.kind == 'module' else ''}{target.name}"
        try:
            run_job(config, target, warm, title=title, warn_omp=True)
        except Exception as exc:
            return _exit_status(exc, PROG)
        return 0
    finally:
        warm.close()


def _exit_status(exc: Exception, prog: str) -> int:
    """The one screen (or line) printed for a failed job, and the exit status."""
    from rallypoint.launcher import LaunchError, LaunchInterruptedError, WorkerFailedError

    match exc:
        case WorkerFailedError():
            sys.stderr.write(exc.summary + "\n")
            return 1
        case LaunchInterruptedError():
            sys.stderr.write(f"{prog}: {exc}\n")
            return 128 + exc.signum
        case ValueError() | TypeError():
            return _fail(prog, str(exc))
        case LaunchError():
            sys.stderr.write(f"{prog}: {exc}\n")
            return 1
    raise exc


def main(argv: list[str] | None = None) -> int:
    """``rallypoint run`` as a function (used by tests); starts its own warm process."""
    with contextlib.suppress(ValueError):
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    return run_main(list(sys.argv[1:] if argv is None else argv))
