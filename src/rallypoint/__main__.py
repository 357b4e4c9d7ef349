"""``rallypoint`` command line: ``rallypoint run ...`` and friends.

``run`` forks the launcher's warm process before anything else (before even parsing its
arguments) so that ``import torch`` in the warm process overlaps the launcher's start-up.
This module therefore imports nothing heavy at its top level.
"""

from __future__ import annotations

import sys
from typing import NoReturn

# subcommand -> ("module" with ``main(argv) -> int``, or "module:function"; one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "run": (
        "rallypoint._cli._run:run_main",
        "start workers on this node or as one node of a job (torchrun's options)",
    ),
    "report": (
        "rallypoint._cli._report:report_main",
        "draw a job's timeline from its --events files (PNG, HTML or SVG)",
    ),
    "stacks": (
        "rallypoint._cli._stacks:stacks_main",
        "print the Python stacks of every worker of a running job, grouped",
    ),
}


def _usage() -> str:
    lines = ["usage: rallypoint COMMAND [options]", "", "commands:"]
    lines += [f"  {name:<13} {text}" for name, (_, text) in COMMANDS.items()]
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


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "run":
        _run(args[1:])
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0 if args else 2
    if args[0] == "--version":
        from rallypoint import __version__

        print(f"rallypoint {__version__}")
        return 0
    if args[0] not in COMMANDS:
        sys.stderr.write(
            f"rallypoint: error: unknown command {args[0]!r} (choose from {', '.join(COMMANDS)})\n"
        )
        return 2
    import importlib

    target = COMMANDS[args[0]][0]
    module_name, _, function = target.partition(":")
    module = importlib.import_module(module_name)
    code: int = getattr(module, function or "main")(args[1:])
    return code


if __name__ == "__main__":
    sys.exit(main())
