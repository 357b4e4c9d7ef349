"""The ``rallypoint run`` parser: torchrun's options (both spellings, ``PET_*`` defaults,
SLURM defaults) plus rallypoint's own, made from their declarations: ``LaunchConfig``'s
fields and, for the flags that are no launch option, :class:`RunFlags`'."""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from rallypoint._core.checks import MAX_SECONDS, duration_text
from rallypoint._launch._config import LaunchConfig
from rallypoint._launch._option import Flag, cli_flag, declared

__all__ = ["PROG", "RunFlags", "UsageError", "build_parser", "command_line", "duration_type"]

PROG = "rallypoint run"
_MICROSECOND = 1e-6


class UsageError(ValueError):
    """Bad command line."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def _cluster_defaults() -> dict[str, Any]:
    """``PET_*`` and SLURM defaults (a flag beats ``PET_*``, which beats SLURM)."""
    from rallypoint._cli._cluster_env import detect_cluster_env

    try:
        return detect_cluster_env(os.environ).options()
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def duration_type(maximum: float = MAX_SECONDS, *, zero: bool = False) -> Callable[[str], float]:
    """The ``type`` of a duration option: seconds, a finite number > 0 (``zero``: >= 0) up
    to ``maximum``; argparse names the option in the error, which shows the number as
    typed. A ``timedelta`` holds microseconds: a smaller positive number is refused, not
    made 0."""

    def seconds(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number of seconds, got {text!r}")
        if value < 0 or (value == 0 and not zero):
            raise argparse.ArgumentTypeError(f"must be {'>= 0' if zero else '> 0'}, got {text}")
        if 0 < value < _MICROSECOND:
            least = "0 or at least" if zero else "at least"
            raise argparse.ArgumentTypeError(
                f"must be {least} 0.000001 (a microsecond), got {text}"
            )
        if value > maximum:
            raise argparse.ArgumentTypeError(
                f"must be at most {duration_text(maximum)}, got {text!r}"
            )
        return value

    return seconds


@dataclass(frozen=True, slots=True, kw_only=True)
class RunFlags:
    """The flags of ``rallypoint run`` that are no launch option: what to run, and
    torchrun's flags that change nothing here. Each says where it goes in ``--help``."""

    standalone: bool = cli_flag(
        "--standalone",
        after="rdzv_conf",
        switch=True,
        help="single node with a store on a free port (the default here)",
    )
    module: bool = cli_flag(
        "-m",
        "--module",
        after="role",
        switch=True,
        help="run the script as a module, like python -m",
    )
    no_python: bool = cli_flag(
        "--no-python",
        "--no_python",
        after="module",
        switch=True,
        help="execute the script directly, not with python",
    )
    run_path: bool = cli_flag(
        "--run-path",
        "--run_path",
        after="no_python",
        switch=True,
        help="run the script with runpy (what fork does anyway)",
    )
    event_log_handler: str = cli_flag(
        "--event-log-handler",
        "--event_log_handler",
        after="workers",
        section="output",
        default="null",
        help="accepted, unused",
    )
    logs_specs: str | None = cli_flag(
        "--logs-specs", "--logs_specs", after="output", help="not supported"
    )
    no_prefix: bool = cli_flag(
        "--no-prefix", "--no_prefix", after="prefix", switch=True, help="do not prefix worker lines"
    )
    snapshot_dir: str | None = cli_flag(
        "--snapshot-dir",
        "--snapshot_dir",
        after="rallypoint",
        help="persist every Kth rallypoint.snapshot with torch.distributed.checkpoint in DIR",
    )
    snapshot_every: int | None = cli_flag(
        "--snapshot-every",
        "--snapshot_every",
        after="snapshot_dir",
        type=int,
        help="K for --snapshot-dir (default 10)",
    )
    snapshot_resume_from: str | None = cli_flag(
        "--snapshot-resume-from",
        "--snapshot_resume_from",
        after="snapshot_every",
        metavar="RUN_ID|PATH|none",
        help="which checkpoints in --snapshot-dir a restore may read besides this job's own: "
        "another job's (by its run id), a checkpoint or namespace (by its path), or none; "
        "default: those of jobs that ended, never a running job's",
    )


def command_line() -> list[tuple[str, str, Flag]]:
    """``(name, section, flag)`` for every flag of ``rallypoint run``, in ``--help`` order:
    the launch options' in their declaration order, each of :class:`RunFlags` after the
    option, or the section, its ``after`` names."""
    out: list[tuple[str, str, Flag]] = []
    for name, option in declared(LaunchConfig):
        if option.flag is not None:
            out.append((name, option.flag.section or out[-1][1], option.flag))
    for name, extra in declared(RunFlags):
        at = [i for i, (other, section, _) in enumerate(out) if extra.after in (other, section)]
        if not at:
            raise AssertionError(f"RunFlags.{name}: no option or section {extra.after!r}")
        out.insert(at[-1] + 1, (name, extra.section or out[at[-1]][1], extra))
    return out


class _Repeat(argparse.Action):
    """``append``, except that the first value given replaces the default (``PET_*``)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        items = getattr(namespace, self.dest)
        items = [] if items is None or items is self.default else list(items)
        setattr(namespace, self.dest, [*items, values])


def _add(group: argparse._ActionsContainer, f: Flag, cluster: dict[str, Any]) -> None:
    """One flag, its default from the cluster, then ``PET_<OPTION>``, then the code."""
    pet = os.environ.get(f.pet)
    if f.switch:
        on = (pet or "").strip().lower() not in ("", "0", "false", "no")
        group.add_argument(*f.spellings, dest=f.dest, action="store_true", default=on, help=f.help)
        return
    kw: dict[str, Any] = {"help": f.help}
    if f.repeat:
        lines = [line for line in (pet or "").splitlines() if line.strip()]
        kw.update(action=_Repeat, default=lines or None)
    else:
        default = f.default() if callable(f.default) else f.default
        kw["default"] = cluster.get(f.pet[len("PET_") :].lower(), default if pet is None else pet)
    if f.seconds is not None:
        kw["type"] = duration_type(f.seconds, zero=f.zero)
    for name in ("type", "choices", "metavar"):
        if getattr(f, name) is not None:
            kw[name] = getattr(f, name)
    group.add_argument(*f.spellings, dest=f.dest, **kw)


def build_parser() -> argparse.ArgumentParser:
    """The ``rallypoint run`` parser (torchrun's options plus rallypoint's own)."""
    parser = _Parser(
        prog=PROG,
        description="Start NPROC workers of a torchrun-style script on this node, forked "
        "from a warm process that has already imported torch.",
    )
    cluster = _cluster_defaults()
    groups: dict[str, argparse._ActionsContainer] = {}
    for _, section, f in command_line():
        if section not in groups:
            groups[section] = parser.add_argument_group(section)
        _add(groups[section], f, cluster)
    parser.add_argument(
        "training_script", help="script (or module with -m, command with --no-python)"
    )
    parser.add_argument("training_script_args", nargs=argparse.REMAINDER)
    return parser
