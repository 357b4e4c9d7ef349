"""``rallypoint run``: torchrun's command line on the fast launcher.

Every torchrun option is accepted with both spellings (``--nproc-per-node`` and
``--nproc_per_node``) and ``PET_<OPTION>`` environment defaults, as torchrun reads them.
Bad input gives one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import sys
from datetime import timedelta
from typing import Any, Literal, NoReturn

from rallypoint.launcher._config import DEFAULT_PREFIX, LaunchConfig
from rallypoint.launcher._errors import (
    HangError,
    LaunchInterruptedError,
    LaunchTimeoutError,
    RendezvousFailedError,
    WarmProcessError,
    WorkerFailedError,
)
from rallypoint.launcher._warm import WarmProcess
from rallypoint.launcher._worker import Target

__all__ = ["build_parser", "config_from_args", "main", "run_main"]

PROG = "rallypoint run"


class UsageError(ValueError):
    """Bad command line."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def _env_default(dest: str, default: Any) -> Any:
    return os.environ.get(f"PET_{dest.upper()}", default)


def _env_flag(dest: str) -> bool:
    value = os.environ.get(f"PET_{dest.upper()}", "")
    return value.strip().lower() not in ("", "0", "false", "no")


def _cluster_defaults() -> dict[str, Any]:
    """``PET_*`` and SLURM defaults (a flag beats ``PET_*``, which beats SLURM)."""
    from rallypoint.launcher._cluster_env import detect_cluster_env

    try:
        return detect_cluster_env(os.environ).options()
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    """The ``rallypoint run`` parser (torchrun's options plus rallypoint's own)."""
    cluster = _cluster_defaults()
    p = _Parser(
        prog=PROG,
        description="Start NPROC workers of a torchrun-style script on this node, forked "
        "from a warm process that has already imported torch.",
    )

    def opt(*names: str, default: Any = None, **kw: Any) -> None:
        dest = names[-1].lstrip("-").replace("-", "_")
        longest = max(names, key=len).lstrip("-").replace("-", "_")
        value = cluster.get(longest, _env_default(longest, default))
        p.add_argument(*names, dest=dest, default=value, **kw)

    def flag(*names: str, help: str) -> None:
        dest = names[-1].lstrip("-").replace("-", "_")
        longest = max(names, key=len).lstrip("-").replace("-", "_")
        p.add_argument(
            *names, dest=dest, action="store_true", default=_env_flag(longest), help=help
        )

    opt("--nnodes", default="1:1", help="nodes: N or MIN:MAX (elastic between MIN and MAX)")
    opt("--nproc-per-node", "--nproc_per_node", default="1", help="workers: int, cpu, gpu, auto")
    opt(
        "--rdzv-backend",
        "--rdzv_backend",
        default="static",
        choices=["c10d", "etcd", "etcd-v3", "file", "static"],
        help="rendezvous backend of a multi-node job",
    )
    opt("--rdzv-endpoint", "--rdzv_endpoint", default="", help="HOST:PORT of the store")
    opt("--rdzv-id", "--rdzv_id", default="none", help="job id (TORCHELASTIC_RUN_ID)")
    opt("--rdzv-conf", "--rdzv_conf", default="", help="rendezvous options: k=v,k=v")
    flag("--standalone", help="single node with a store on a free port (the default here)")
    opt("--max-restarts", "--max_restarts", default=0, type=int, help="group restarts")
    opt("--monitor-interval", "--monitor_interval", default=0.1, type=float, help="seconds")
    opt(
        "--start-method",
        "--start_method",
        default="fork",
        choices=["fork", "spawn", "forkserver"],
        help="fork from the warm process (default) or spawn fresh interpreters",
    )
    opt("--event-log-handler", "--event_log_handler", default="null", help="accepted, unused")
    opt("--role", default="default", help="worker role (ROLE_NAME)")
    flag("-m", "--module", help="run the script as a module, like python -m")
    flag("--no-python", "--no_python", help="execute the script directly, not with python")
    flag("--run-path", "--run_path", help="run the script with runpy (what fork does anyway)")
    opt("--log-dir", "--log_dir", default=None, help="per-rank log files go here")
    opt("-r", "--redirects", default="0", help="streams to files only: 0-3 or RANK:MASK,...")
    opt("-t", "--tee", default="0", help="streams to files and console: 0-3 or RANK:MASK,...")
    opt(
        "--local-ranks-filter",
        "--local_ranks_filter",
        default="",
        help="show only these local ranks on the console, e.g. 0,1",
    )
    opt("--duplicate-stdout-filters", "--duplicate_stdout_filters", default="", help="accepted")
    opt("--duplicate-stderr-filters", "--duplicate_stderr_filters", default="", help="accepted")
    opt("--node-rank", "--node_rank", default=0, type=int, help="node rank (static backend)")
    opt("--master-addr", "--master_addr", default="127.0.0.1", help="store address")
    opt("--master-port", "--master_port", default=None, type=int, help="store port (free if unset)")
    opt("--local-addr", "--local_addr", default=None, help="accepted (single node)")
    opt("--logs-specs", "--logs_specs", default=None, help="not supported")
    opt("--numa-binding", "--numa_binding", default=None, help="not supported")
    opt(
        "--signals-to-handle",
        "--signals_to_handle",
        default="SIGTERM,SIGINT,SIGHUP,SIGQUIT",
        help="signals forwarded to the workers",
    )
    opt("--shutdown-timeout", "--shutdown_timeout", default=None, type=float, help="seconds")
    flag("--virtual-local-rank", "--virtual_local_rank", help="not supported without GPUs")
    # rallypoint's own
    opt("--preload", default="", help="modules the warm process imports: a,b")
    opt(
        "--prefix",
        default=os.environ.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", DEFAULT_PREFIX),
        help="line prefix template (${rank}, ${local_rank}, ${role_name})",
    )
    flag("--no-prefix", "--no_prefix", help="do not prefix worker lines")
    opt("--timeout", default=None, type=float, help="stop the job after SECONDS")
    opt(
        "--hang-timeout",
        "--hang_timeout",
        default=None,
        type=float,
        help="no rallypoint.progress() from any worker for SECONDS is a hang (off by default)",
    )
    opt(
        "--on-hang",
        "--on_hang",
        default="restart",
        choices=["restart", "fail"],
        help="after printing the stacks of a hang: restart (counts as one) or fail",
    )
    opt("--events", default=None, help="append the job's events (JSON lines) to FILE")
    p.add_argument("training_script", help="script (or module with -m, command with --no-python)")
    p.add_argument("training_script_args", nargs=argparse.REMAINDER)
    return p


def _cpu_count() -> int:
    with contextlib.suppress(AttributeError):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _gpu_count() -> int:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    with contextlib.suppress(OSError):
        return len([d for d in os.listdir("/dev") if d.startswith("nvidia") and d[6:].isdigit()])
    return 0


def parse_nproc(value: str) -> int:
    """torchrun's ``--nproc-per-node`` values: an int, ``cpu``, ``gpu`` or ``auto``."""
    text = str(value).strip()
    if text.lstrip("-").isdigit():
        n = int(text)
        if n < 1:
            raise UsageError(f"--nproc-per-node must be >= 1, got {n}")
        return n
    if text == "cpu":
        return _cpu_count()
    if text == "gpu":
        n = _gpu_count()
        if not n:
            raise UsageError("--nproc-per-node gpu: Cuda is not available.")
        return n
    if text == "auto":
        return _gpu_count() or _cpu_count()
    raise UsageError(
        f"Unsupported nproc_per_node value: {text!r} (use an integer >= 1, cpu, gpu or auto)"
    )


def config_from_args(args: argparse.Namespace) -> tuple[LaunchConfig, Target]:
    """Turn parsed arguments into a config and a target; ``UsageError`` for bad input."""
    if args.module and args.no_python:
        raise UsageError(
            "Don't use both the '--no-python' flag and the '--module' flag at the same time."
        )
    nnodes = str(args.nnodes).strip()
    multi = ":" in nnodes or (nnodes.isdigit() and int(nnodes) > 1)
    if multi and nnodes.split(":")[-1].strip() == "1":
        multi = False
    if args.standalone:
        multi = False
    if args.node_rank != 0 and not multi:
        raise UsageError(
            f"--node-rank {args.node_rank} needs a multi-node job (--nnodes N with N > 1)"
        )
    for name in ("logs_specs", "numa_binding"):
        if getattr(args, name):
            raise UsageError(f"--{name.replace('_', '-')} is not supported by rallypoint run")
    ignored = {
        "--duplicate-stdout-filters": args.duplicate_stdout_filters,
        "--duplicate-stderr-filters": args.duplicate_stderr_filters,
        "--local-addr": args.local_addr,
        "--virtual-local-rank": args.virtual_local_rank,
        "--event-log-handler": args.event_log_handler not in ("", "null"),
    }
    for name, value in ignored.items():
        if value:
            sys.stderr.write(f"{PROG}: warning: {name} has no effect; ignored\n")
    nproc = parse_nproc(args.nproc_per_node)
    master_addr, master_port = args.master_addr, args.master_port
    rdzv_endpoint = str(args.rdzv_endpoint or "")
    rdzv_conf = _parse_rdzv_conf(str(args.rdzv_conf or ""))
    if multi and args.rdzv_backend == "static" and not rdzv_endpoint:
        if master_port is None:
            raise UsageError("a static multi-node job needs --master-port (or --rdzv-endpoint)")
        rdzv_endpoint = f"{master_addr}:{master_port}"
    if multi and args.rdzv_backend == "static":
        rdzv_conf.setdefault("rank", str(args.node_rank))
    if args.rdzv_endpoint and not args.standalone and master_port is None and not multi:
        host, _, port = args.rdzv_endpoint.rpartition(":")
        if not port.isdigit():
            raise UsageError(f"--rdzv-endpoint must be HOST:PORT, got {args.rdzv_endpoint!r}")
        master_addr, master_port = host.strip("[]") or master_addr, int(port)
        if master_addr in ("localhost", ""):
            master_addr = "127.0.0.1"
    if args.standalone:
        master_port = None
    ranks = None
    if args.local_ranks_filter:
        try:
            ranks = frozenset(int(r) for r in str(args.local_ranks_filter).split(","))
        except ValueError:
            raise UsageError(
                "--local-ranks-filter must be a comma-separated list of integers e.g. "
                "--local-ranks-filter=0,1,2"
            ) from None
    script = args.training_script
    kind: Literal["script", "module", "exec"]
    if args.module:
        kind = "module"
    elif args.no_python and not args.run_path:
        kind = "exec"
        if shutil.which(script) is None:
            raise UsageError(f"--no-python: command {script!r} not found or not executable")
    else:
        kind = "script"
        runnable = os.path.isfile(script) or os.path.isfile(os.path.join(script, "__main__.py"))
        if not runnable:
            raise UsageError(f"script {script!r} does not exist")
    shutdown = args.shutdown_timeout
    if shutdown is None:
        shutdown = float(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "30"))
    hang = args.hang_timeout
    config = LaunchConfig(
        nproc=nproc,
        nnodes=nnodes if multi else "1",
        rdzv_backend=str(args.rdzv_backend) if multi else "c10d",
        rdzv_endpoint=rdzv_endpoint if multi else "",
        rdzv_conf=rdzv_conf,
        node_rank=int(args.node_rank) if multi and args.rdzv_backend == "static" else None,
        hang_timeout=None if hang is None else timedelta(seconds=float(hang)),
        on_hang=args.on_hang,
        events=args.events,
        max_restarts=args.max_restarts,
        monitor_interval=timedelta(seconds=float(args.monitor_interval)),
        master_addr=master_addr,
        master_port=None if master_port is None else int(master_port),
        run_id=None if args.rdzv_id in ("", "none") else args.rdzv_id,
        role=args.role,
        start_method="fork" if args.start_method == "fork" else "spawn",
        preload=tuple(m.strip() for m in str(args.preload).split(",") if m.strip()),
        log_dir=args.log_dir,
        redirects=str(args.redirects),
        tee=str(args.tee),
        local_ranks_filter=ranks,
        prefix=None if args.no_prefix else args.prefix,
        shutdown_timeout=timedelta(seconds=float(shutdown)),
        timeout=None if args.timeout is None else timedelta(seconds=float(args.timeout)),
        signals_to_handle=args.signals_to_handle,
    )
    return config, Target(kind, script, tuple(args.training_script_args))


def _parse_rdzv_conf(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in text.split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"--rdzv-conf must be key=value,key=value; got {item.strip()!r}")
        out[key.strip()] = value.strip()
    return out


def _fail(message: str) -> int:
    sys.stderr.write(f"{PROG}: error: {message}\n")
    sys.stderr.flush()
    return 2


def run_main(argv: list[str], warm: WarmProcess | None = None) -> int:
    """Parse ``argv`` (after ``run``) and run the job; returns the exit status."""
    if warm is None:
        warm = WarmProcess.fork()
    try:
        try:
            parser = build_parser()
            args = parser.parse_args(argv)
            config, target = config_from_args(args)
        except SystemExit as exc:  # --help
            warm.kill()
            return exc.code if isinstance(exc.code, int) else 0
        except (ValueError, TypeError) as exc:
            warm.kill()
            return _fail(str(exc))
        from rallypoint.launcher._agent import Agent

        title = f"{PROG} {'-m ' if target.kind == 'module' else ''}{target.name}"
        try:
            if config.multi_node:
                from rallypoint.launcher._elastic import ElasticAgent

                ElasticAgent(config, target, warm, title=title, warn_omp=True).run()
            else:
                Agent(config, target, warm, title=title, warn_omp=True).run()
        except WorkerFailedError as exc:
            sys.stderr.write(exc.summary + "\n")
            return 1
        except (HangError, RendezvousFailedError) as exc:
            sys.stderr.write(f"{PROG}: {exc}\n")
            return 1
        except LaunchInterruptedError as exc:
            sys.stderr.write(f"{PROG}: {exc}\n")
            return 128 + exc.signum
        except LaunchTimeoutError as exc:
            sys.stderr.write(f"{PROG}: {exc}\n")
            return 1
        except (ValueError, TypeError) as exc:
            return _fail(str(exc))
        except WarmProcessError as exc:
            sys.stderr.write(f"{PROG}: {exc}\n")
            return 1
        return 0
    finally:
        warm.close()


def main(argv: list[str] | None = None) -> int:
    """``rallypoint run`` as a function (used by tests); starts its own warm process."""
    with contextlib.suppress(ValueError):
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    return run_main(list(sys.argv[1:] if argv is None else argv))
