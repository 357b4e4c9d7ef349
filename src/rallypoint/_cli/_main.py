"""The ``rallypoint`` command: one entry point per subcommand (``argv -> exit status``).

``run`` forks the launcher's warm process before anything else (before even parsing its
arguments) so that ``import torch`` in the warm process overlaps the launcher's start-up;
nothing heavy is imported at this module's top level.
"""

from __future__ import annotations

import sys
from typing import NoReturn

__all__ = ["COMMANDS", "main"]

COMMANDS: dict[str, str] = {
    "run": "start workers on this node or as one node of a job (torchrun's options)",
    "report": "draw a job's timeline from its --events files (PNG, HTML or SVG)",
    "stacks": "print the Python stacks of every worker of a running job, grouped",
    "lighthouse": "where replica groups agree on each step's quorum (torchft's lighthouse)",
}
"""Each subcommand and its line of help."""


def _usage() -> str:
    lines = ["usage: rallypoint COMMAND [options]", "", "commands:"]
    lines += [f"  {name:<13} {text}" for name, text in COMMANDS.items()]
    lines += ["", "Run 'rallypoint COMMAND --help' for a command's options."]
    return "\n".join(lines)


def _run(argv: list[str]) -> NoReturn:
    """``rallypoint run``: a ^C before the launcher handles signals itself (while it
    imports and parses) stops it with one line, not a ``KeyboardInterrupt`` traceback."""
    try:
        # Fork the warm process first: it imports torch while we parse arguments.
        from rallypoint._supervise._warm._process import WarmProcess

        warm = WarmProcess.fork()  # it dies with this process until it is ready
        from rallypoint._cli._run import run_main

        code = run_main(argv, warm, owns_process=True)
    except KeyboardInterrupt:
        sys.stderr.write("rallypoint run: received SIGINT while starting; stopped\n")
        code = 128 + 2
    from rallypoint._core.procs import exit_now

    # Not a return: daemon threads may still sit in torch's C++ store calls, and one
    # waking during interpreter finalization aborts the process (see exit_now).
    exit_now(code)


def _version() -> str:
    from rallypoint._core.version import __version__

    return f"rallypoint {__version__}"


def main(argv: list[str] | None = None) -> int:
    """Run the subcommand that ``argv`` (default: ``sys.argv[1:]``) names."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "run":
        _run(args[1:])
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0 if args else 2
    if args[0] == "--version":
        print(_version())
        return 0
    if args[0] == "report":
        from rallypoint._cli._report import report_main

        return report_main(args[1:])
    if args[0] == "stacks":
        from rallypoint._cli._stacks import stacks_main

        return stacks_main(args[1:])
    if args[0] == "lighthouse":
        from rallypoint._cli._lighthouse import lighthouse_main

        return lighthouse_main(args[1:])
    sys.stderr.write(
        f"rallypoint: error: unknown command {args[0]!r} (choose from {', '.join(COMMANDS)})\n"
    )
    return 2
