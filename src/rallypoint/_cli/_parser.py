"""The ``rallypoint run`` parser: torchrun's options (both spellings, ``PET_*`` defaults,
SLURM defaults) plus rallypoint's own."""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from typing import Any, NoReturn

from rallypoint._core.checks import MAX_SECONDS, duration_text
from rallypoint._supervise._numa import NUMA_MODES
from rallypoint._supervise._options import DEFAULT_PREFIX, MAX_MONITOR_INTERVAL

__all__ = ["PROG", "UsageError", "build_parser", "duration_type"]

PROG = "rallypoint run"


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


class _Options:
    """Adds options whose default comes from the cluster, then ``PET_<OPTION>``, then code."""

    def __init__(self, parser: argparse._ActionsContainer, cluster: dict[str, Any]) -> None:
        self.parser = parser
        self.cluster = cluster

    @staticmethod
    def _names(names: tuple[str, ...]) -> tuple[str, str]:
        dest = names[-1].lstrip("-").replace("-", "_")
        longest = max(names, key=len).lstrip("-").replace("-", "_")
        return dest, longest

    def opt(self, *names: str, default: Any = None, **kw: Any) -> None:
        dest, longest = self._names(names)
        pet = os.environ.get(f"PET_{longest.upper()}", default)
        self.parser.add_argument(*names, dest=dest, default=self.cluster.get(longest, pet), **kw)

    def flag(self, *names: str, help: str) -> None:
        dest, longest = self._names(names)
        value = os.environ.get(f"PET_{longest.upper()}", "").strip().lower()
        default = value not in ("", "0", "false", "no")
        self.parser.add_argument(*names, dest=dest, action="store_true", default=default, help=help)


def duration_type(maximum: float = MAX_SECONDS) -> Callable[[str], float]:
    """The ``type`` of a duration option: seconds, a finite number up to ``maximum``
    (argparse names the option in the error; the config checks the lower bound)."""

    def seconds(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number of seconds, got {text!r}")
        if value > maximum:
            raise argparse.ArgumentTypeError(
                f"must be at most {duration_text(maximum)}, got {text!r}"
            )
        return value

    return seconds


def build_parser() -> argparse.ArgumentParser:
    """The ``rallypoint run`` parser (torchrun's options plus rallypoint's own)."""
    parser = _Parser(
        prog=PROG,
        description="Start NPROC workers of a torchrun-style script on this node, forked "
        "from a warm process that has already imported torch.",
    )
    cluster = _cluster_defaults()
    for title, add in (
        ("nodes and rendezvous", _nodes),
        ("workers", _workers),
        ("output", _output),
        ("single-node store", _store),
        ("rallypoint", _rallypoint),
    ):
        add(_Options(parser.add_argument_group(title), cluster))
    parser.add_argument(
        "training_script", help="script (or module with -m, command with --no-python)"
    )
    parser.add_argument("training_script_args", nargs=argparse.REMAINDER)
    return parser


def _nodes(o: _Options) -> None:
    """The job's nodes and their rendezvous."""
    o.opt("--nnodes", default="1:1", help="nodes: N or MIN:MAX (elastic between MIN and MAX)")
    o.opt(
        "--rdzv-backend",
        "--rdzv_backend",
        default="static",
        choices=["c10d", "etcd", "etcd-v3", "file", "static"],
        help="rendezvous backend of a multi-node job",
    )
    o.opt("--rdzv-endpoint", "--rdzv_endpoint", default="", help="HOST:PORT of the store")
    o.opt("--rdzv-id", "--rdzv_id", default="none", help="job id (TORCHELASTIC_RUN_ID)")
    o.opt("--rdzv-conf", "--rdzv_conf", default="", help="rendezvous options: k=v,k=v")
    o.flag("--standalone", help="single node with a store on a free port (the default here)")
    o.opt("--max-restarts", "--max_restarts", default=0, type=int, help="group restarts")
    o.opt(
        "--max-same-failure",
        "--max_same_failure",
        default="3",
        help="end the job when the same root cause failed N attempts in a row, or off (default 3)",
    )
    o.flag(
        "--hot-spare",
        "--hot_spare",
        help="while this node waits as a spare, start its workers: they run the script's "
        "set-up and wait in their @rallypoint.restartable function for ranks",
    )
    o.opt(
        "--spare-workers",
        "--spare_workers",
        default=0,
        type=int,
        help="keep N extra workers that ran the script's set-up ready to take a replaced "
        "rank's place in an in-process restart (@rallypoint.restartable)",
    )
    o.flag(
        "--burn-in",
        "--burn_in",
        help="after each round forms, time the nodes' links and exclude a node much slower "
        "than the median (3 nodes or more)",
    )
    o.opt(
        "--max-node-failures",
        "--max_node_failures",
        default="2",
        help="exclude a node that was the root cause of K failures in a row while MIN nodes "
        "remain, or off (default 2)",
    )
    o.opt(
        "--monitor-interval",
        "--monitor_interval",
        default=0.1,
        type=duration_type(MAX_MONITOR_INTERVAL),
        help="seconds",
    )
    o.opt("--node-rank", "--node_rank", default=0, type=int, help="node rank (static backend)")
    o.opt(
        "--local-addr",
        "--local_addr",
        default=None,
        help="this node's address for the others (its workers' MASTER_ADDR if it hosts the store)",
    )


def _workers(o: _Options) -> None:
    """What runs, how it starts, and how it is stopped."""
    o.opt("--nproc-per-node", "--nproc_per_node", default="1", help="workers: int, cpu, gpu, auto")
    o.opt(
        "--start-method",
        "--start_method",
        default="fork",
        choices=["fork", "spawn", "forkserver"],
        help="fork from the warm process (default) or spawn fresh interpreters",
    )
    o.opt("--role", default="default", help="worker role (ROLE_NAME)")
    o.flag("-m", "--module", help="run the script as a module, like python -m")
    o.flag("--no-python", "--no_python", help="execute the script directly, not with python")
    o.flag("--run-path", "--run_path", help="run the script with runpy (what fork does anyway)")
    o.opt(
        "--signals-to-handle",
        "--signals_to_handle",
        default="SIGTERM,SIGINT,SIGHUP,SIGQUIT",
        help="signals forwarded to the workers",
    )
    o.opt(
        "--shutdown-timeout",
        "--shutdown_timeout",
        default=None,
        type=duration_type(),
        help="seconds",
    )
    o.opt(
        "--restart-grace",
        "--restart_grace",
        default=10.0,
        type=duration_type(),
        help="seconds a worker of a @rallypoint.restartable function has to leave it when the "
        "job restarts in process; one that does not is replaced (default 10)",
    )
    o.flag(
        "--virtual-local-rank",
        "--virtual_local_rank",
        help="LOCAL_RANK=0 for every worker, each seeing only its own GPU (CUDA_VISIBLE_DEVICES)",
    )
    o.opt(
        "--numa-binding",
        "--numa_binding",
        default=None,
        choices=NUMA_MODES,
        help="bind each worker to the CPUs near GPU LOCAL_RANK (torch's modes; needs a GPU)",
    )


def _output(o: _Options) -> None:
    """Where the workers' output goes."""
    o.opt("--event-log-handler", "--event_log_handler", default="null", help="accepted, unused")
    o.opt("--log-dir", "--log_dir", default=None, help="per-rank log files go here")
    o.opt("-r", "--redirects", default="0", help="streams to files only: 0-3 or RANK:MASK,...")
    o.opt("-t", "--tee", default="0", help="streams to files and console: 0-3 or RANK:MASK,...")
    o.opt(
        "--local-ranks-filter",
        "--local_ranks_filter",
        default="",
        help="show only these local ranks on the console, e.g. 0,1",
    )
    for name in ("stdout", "stderr"):
        o.opt(
            f"--duplicate-{name}-filters",
            f"--duplicate_{name}_filters",
            help=f"copy the tee'd {name} lines that contain one of these comma-separated "
            f"strings (',,' for a comma) to LOG_DIR/RUN_ID/attempt_N/filtered_{name}.log",
        )
    o.opt("--logs-specs", "--logs_specs", default=None, help="not supported")


def _store(o: _Options) -> None:
    """The workers' store on a single node."""
    o.opt("--master-addr", "--master_addr", default="127.0.0.1", help="store address")
    o.opt(
        "--master-port", "--master_port", default=None, type=int, help="store port (free if unset)"
    )


def _rallypoint(o: _Options) -> None:
    """rallypoint's own options."""
    o.opt("--preload", default="", help="modules the warm process imports: a,b")
    o.opt(
        "--prefix",
        default=os.environ.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", DEFAULT_PREFIX),
        help="line prefix template (${rank}, ${local_rank}, ${role_name})",
    )
    o.flag("--no-prefix", "--no_prefix", help="do not prefix worker lines")
    o.opt("--timeout", default=None, type=duration_type(), help="stop the job after SECONDS")
    o.opt(
        "--hang-timeout",
        "--hang_timeout",
        default=None,
        type=duration_type(),
        help="no rallypoint.progress() from any worker for SECONDS is a hang (off by default)",
    )
    o.opt(
        "--on-hang",
        "--on_hang",
        default="restart",
        choices=["restart", "fail"],
        help="after printing the stacks of a hang: restart (counts as one) or fail",
    )
    o.opt("--events", default=None, help="append the job's events (JSON lines) to FILE")
    o.opt(
        "--straggler-threshold",
        "--straggler_threshold",
        default="1.5",
        help="report a rank or node whose step time (between rallypoint.progress() calls) "
        "exceeds this many times the median of the others: a number > 1, or off "
        "(default 1.5)",
    )
    o.opt(
        "--straggler-window",
        "--straggler_window",
        default=30.0,
        type=duration_type(),
        help="seconds of recent steps a step time is averaged over (default 30)",
    )
    o.parser.add_argument(
        "--health-check",
        "--health_check",
        dest="health_check",
        action="append",
        default=None,
        help="run CMD (a shell command, exit 0: healthy) or builtin:disk, builtin:gpu, "
        "builtin:store before this node joins a round; a failure keeps the node out "
        "(exit code 3); repeatable; PET_HEALTH_CHECK: one check per line",
    )
    o.opt(
        "--health-check-timeout",
        "--health_check_timeout",
        default=60.0,
        type=duration_type(),
        help="seconds one health check may take before it is killed and fails (default 60)",
    )
    o.opt(
        "--flight-recorder",
        "--flight_recorder",
        default="2000",
        help="collectives each worker's torch Flight Recorder keeps, used to name the rank and "
        "collective of a hang: a number, or off (default 2000; TORCH_FR_BUFFER_SIZE wins)",
    )
    _snapshot(o)


def _snapshot(o: _Options) -> None:
    """``rallypoint.snapshot``'s options."""
    o.opt(
        "--snapshot-dir",
        "--snapshot_dir",
        default=None,
        help="persist every Kth rallypoint.snapshot with torch.distributed.checkpoint in DIR",
    )
    o.opt(
        "--snapshot-every",
        "--snapshot_every",
        default=None,
        type=int,
        help="K for --snapshot-dir (default 10)",
    )
    o.opt(
        "--snapshot-resume-from",
        "--snapshot_resume_from",
        default=None,
        metavar="RUN_ID|PATH|none",
        help="which checkpoints in --snapshot-dir a restore may read besides this job's own: "
        "another job's (by its run id), a checkpoint or namespace (by its path), or none; "
        "default: those of jobs that ended, never a running job's",
    )
