"""``rallypoint run``: torchrun's command line on the fast launcher.

Every torchrun option is accepted with both spellings (``--nproc-per-node`` and
``--nproc_per_node``) and ``PET_<OPTION>`` environment defaults, as torchrun reads them
(``_parser``); the arguments become a ``LaunchConfig`` (``_args``). Bad input gives one
line on stderr and exit status 2.

The screen of a failed job ends with its root cause: the agent of a multi-node job imports
torch with its C++ log level at ``FATAL`` (``RALLYPOINT_AGENT_CPP_LOG_LEVEL`` overrides it;
the workers keep the user's ``TORCH_CPP_LOG_LEVEL``), so torch's store warnings and their
frame dumps from background threads stay off the screen, and once the last line is written
nothing else of this process reaches stderr.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading

from rallypoint._core import envvars
from rallypoint._supervise._warm._process import WarmProcess

__all__ = ["main", "run_main"]


def _fail(prog: str, message: str) -> int:
    sys.stderr.write(f"{prog}: error: {message}\n")
    sys.stderr.flush()
    return 2


def run_main(
    argv: list[str], warm: WarmProcess | None = None, *, owns_process: bool = False
) -> int:
    """Parse ``argv`` (after ``run``) and run the job; returns the exit status.

    ``owns_process``: this process is the ``rallypoint`` command and exits afterwards (then
    the agent's torch is quiet and nothing follows the job's last line; see the module
    docstring).
    """
    if warm is None:
        warm = WarmProcess.fork()
    try:
        from rallypoint._cli._args import config_from_args
        from rallypoint._cli._parser import PROG, build_parser

        try:
            args = build_parser().parse_args(argv)
            config, target = config_from_args(args)
        except SystemExit as exc:  # --help
            warm.kill()
            return exc.code if isinstance(exc.code, int) else 0
        except (ValueError, TypeError) as exc:
            warm.kill()
            return _fail(PROG, str(exc))
        from rallypoint._launch._run_job import run_job

        if owns_process and config.rendezvous.multi_node:
            _quiet_agent_torch()
        title = f"{PROG} {'-m ' if target.kind == 'module' else ''}{target.name}"
        try:
            run_job(config, target, warm, title=title, warn_omp=True)
        except Exception as exc:
            code = _exit_status(exc, PROG)
            if owns_process:
                _last_line_written()
            return code
        return 0
    finally:
        warm.close()


def _quiet_agent_torch() -> None:
    """Have torch imported in this agent process with its C++ logging at ``FATAL``.

    c10 reads ``TORCH_CPP_LOG_LEVEL`` from the C environment once, when torch is imported:
    it is set there only (``os.putenv``: ``os.environ``, from which the workers' environment
    is built, keeps the user's value) before anything imports torch, torch is imported in a
    thread (the main thread stays free for signals; whoever imports torch first reads the
    level) and the variable is put back.
    """
    if "torch" in sys.modules:
        return
    name = envvars.TORCH_CPP_LOG_LEVEL
    saved = os.environ.get(name)
    os.putenv(name, os.environ.get(envvars.AGENT_CPP_LOG_LEVEL, "FATAL"))

    def load() -> None:
        try:
            with contextlib.suppress(BaseException):  # the rendezvous says it properly
                import torch  # noqa: F401
        finally:
            if saved is None:
                os.unsetenv(name)
            else:
                os.putenv(name, saved)

    threading.Thread(target=load, name="rallypoint-import-torch", daemon=True).start()


def _last_line_written() -> None:
    """The job's last line is on the screen: what daemon threads (a heartbeat that finds
    the store gone, torch's C++ warnings) would print after it goes nowhere."""
    with contextlib.suppress(OSError, ValueError):
        sys.stderr.flush()
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.close(devnull)


def _exit_status(exc: Exception, prog: str) -> int:
    """The one screen (or line) printed for a failed job, and the exit status."""
    from rallypoint._elastic._errors import NodeExcludedError, UnhealthyNodeError
    from rallypoint._elastic._exits import EXIT_EXCLUDED, EXIT_UNHEALTHY
    from rallypoint._supervise._errors import (
        LaunchError,
        LaunchInterruptedError,
        WorkerFailedError,
    )

    match exc:
        case WorkerFailedError():
            sys.stderr.write(exc.summary + "\n")
            return 1
        case NodeExcludedError():
            sys.stderr.write(f"{prog}: {exc}\n")
            return EXIT_EXCLUDED
        case UnhealthyNodeError():
            sys.stderr.write(f"{exc}\n")
            return EXIT_UNHEALTHY
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
