"""From parsed ``rallypoint run`` arguments to a :class:`LaunchConfig` and a target."""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
from datetime import timedelta
from typing import Any, Literal

from rallypoint._cli._parser import PROG, UsageError, duration_type
from rallypoint._core import envvars
from rallypoint._core.disk import check_writable
from rallypoint._elastic._options import BUILTIN_CHECKS, parse_nnodes
from rallypoint._launch._config import LaunchConfig
from rallypoint._supervise._worker import Target
from rallypoint._watch._flight._recorder import parse_buffer
from rallypoint._watch._stragglers._pace import parse_threshold

__all__ = ["config_from_args", "parse_nproc"]


def config_from_args(args: argparse.Namespace) -> tuple[LaunchConfig, Target]:
    """Turn parsed arguments into a config and a target; ``UsageError`` for bad input."""
    _check_flags(args)
    multi = _multi_node(args)
    if args.node_rank != 0 and not multi:
        raise UsageError(
            f"--node-rank {args.node_rank} needs a multi-node job (--nnodes N with N > 1)"
        )
    _reject_unsupported(args)
    options: dict[str, Any] = {"nproc": parse_nproc(args.nproc_per_node)}
    options.update(_nodes(args, multi))
    options.update(_output(args))
    target = _target(args)
    options.update(_timing(args))
    options.update(
        max_restarts=args.max_restarts,
        max_same_failure=_count_or_off(args.max_same_failure, "--max-same-failure"),
        max_node_failures=_count_or_off(args.max_node_failures, "--max-node-failures"),
        burn_in=bool(args.burn_in),
        hot_spare=bool(args.hot_spare),
        spare_workers=args.spare_workers,
        run_id=_run_id(args.rdzv_id),
        role=args.role,
        start_method="fork" if args.start_method == "fork" else "spawn",
        preload=tuple(m.strip() for m in str(args.preload).split(",") if m.strip()),
        signals_to_handle=args.signals_to_handle,
        virtual_local_rank=bool(args.virtual_local_rank),
        numa_binding=args.numa_binding or None,
        on_hang=args.on_hang,
        events=args.events,
        straggler_threshold=_straggler_threshold(args.straggler_threshold),
        straggler_window=_seconds(args.straggler_window),
        flight_recorder=_flight_recorder(args.flight_recorder),
    )
    options.update(_health(args))
    snapshots = _snapshot_env(args)
    if snapshots:
        options["env"] = snapshots
    return LaunchConfig(**options), target


def _run_id(value: str) -> str | None:
    """``--rdzv-id`` (``PET_RDZV_ID``): the job's run id; ``None`` for ``none``."""
    if value in ("", "none"):
        return None
    if "/" in value or "\0" in value:
        raise UsageError(
            f"--rdzv-id {value!r} must not contain '/': the run id names the job's log and "
            f"snapshot directories; use letters, digits, '-', '_' and '.' (say "
            f"--rdzv-id {value.replace('/', '-').replace(chr(0), '')})"
        )
    return value


def _health(args: argparse.Namespace) -> dict[str, Any]:
    """``--health-check`` (else ``PET_HEALTH_CHECK``, one check per line) and its timeout."""
    checks = args.health_check
    if checks is None:
        pet = os.environ.get("PET_HEALTH_CHECK", "")
        checks = [line for line in pet.splitlines() if line.strip()]
    for check in checks:
        name = check.strip()
        if not name:
            raise UsageError(
                f"--health-check needs a shell command or one of {', '.join(BUILTIN_CHECKS)}, "
                f"got {check!r}"
            )
        if name.startswith("builtin:") and name not in BUILTIN_CHECKS:
            raise UsageError(
                f"--health-check {name!r} is not a built-in check; use one of "
                f"{', '.join(BUILTIN_CHECKS)}"
            )
    timeout = float(args.health_check_timeout)
    if not timeout > 0:
        raise UsageError(f"--health-check-timeout must be > 0 seconds, got {timeout:g}")
    return {"health_check": tuple(checks), "health_check_timeout": timedelta(seconds=timeout)}


def _count_or_off(value: str, flag: str) -> int | None:
    text = str(value).strip().lower()
    if text == "off":
        return None
    if not text.isdigit() or int(text) < 1:
        raise UsageError(f"{flag} must be a number >= 1 or off, got {value!r}")
    return int(text)


def _straggler_threshold(value: str) -> float | None:
    try:
        return parse_threshold(value, "--straggler-threshold")
    except (TypeError, ValueError) as exc:
        raise UsageError(str(exc)) from None


def _flight_recorder(value: str) -> int | None:
    try:
        return parse_buffer(value, "--flight-recorder")
    except (TypeError, ValueError) as exc:
        raise UsageError(str(exc)) from None


def _snapshot_env(args: argparse.Namespace) -> dict[str, str]:
    """``--snapshot-dir``/``--snapshot-every``/``--snapshot-resume-from`` reach
    ``rallypoint.snapshot`` in the workers."""
    env = {}
    if args.snapshot_every is not None:
        if args.snapshot_every < 1:
            raise UsageError(f"--snapshot-every must be >= 1, got {args.snapshot_every}")
        if not args.snapshot_dir:
            raise UsageError("--snapshot-every needs --snapshot-dir")
        env[envvars.SNAPSHOT_EVERY] = str(args.snapshot_every)
    if args.snapshot_dir:
        path = os.path.abspath(args.snapshot_dir)
        if os.path.exists(path) and not os.path.isdir(path):
            raise UsageError(f"--snapshot-dir {args.snapshot_dir!r} is not a directory")
        try:
            check_writable(path, "--snapshot-dir")
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        env[envvars.SNAPSHOT_DIR] = path
    if args.snapshot_resume_from is not None:
        env[envvars.SNAPSHOT_RESUME_FROM] = _resume_from(args)
    return env


def _resume_from(args: argparse.Namespace) -> str:
    """``--snapshot-resume-from``: ``none``, a run id, or a path (made absolute; it must
    exist)."""
    value: str = args.snapshot_resume_from
    if not args.snapshot_dir:
        raise UsageError("--snapshot-resume-from needs --snapshot-dir")
    if not value:
        raise UsageError("--snapshot-resume-from needs a run id, a path or none")
    if "/" in value or value.startswith("."):
        path = os.path.abspath(value)
        if not os.path.isdir(path):
            raise UsageError(f"--snapshot-resume-from {value!r}: no such directory")
        return path
    return value


def _check_flags(args: argparse.Namespace) -> None:
    if args.module and args.no_python:
        raise UsageError(
            "Don't use both the '--no-python' flag and the '--module' flag at the same time."
        )


def _multi_node(args: argparse.Namespace) -> bool:
    """torchrun's rule: several nodes unless ``--standalone`` or at most one node."""
    nnodes = str(args.nnodes).strip()
    try:
        _, max_nodes = parse_nnodes(nnodes)
    except ValueError:
        raise UsageError(
            f"--nnodes must be N or MIN:MAX with 0 < MIN <= MAX, got {nnodes!r}"
        ) from None
    return max_nodes > 1 and not args.standalone


def _reject_unsupported(args: argparse.Namespace) -> None:
    if args.logs_specs:
        raise UsageError("--logs-specs is not supported by rallypoint run")
    ignored = {
        "--event-log-handler": args.event_log_handler not in ("", "null"),
    }
    for name, value in ignored.items():
        if value:
            sys.stderr.write(f"{PROG}: warning: {name} has no effect; ignored\n")


def _nodes(args: argparse.Namespace, multi: bool) -> dict[str, Any]:
    """``nnodes`` and the rendezvous of a multi-node job, or the store of a single node."""
    master_addr, master_port = args.master_addr, args.master_port
    endpoint = str(args.rdzv_endpoint or "")
    conf = _parse_rdzv_conf(str(args.rdzv_conf or ""))
    static = multi and args.rdzv_backend == "static"
    if static and not endpoint:
        if master_port is None:
            raise UsageError("a static multi-node job needs --master-port (or --rdzv-endpoint)")
        endpoint = f"{master_addr}:{master_port}"
    if static:
        conf.setdefault("rank", str(args.node_rank))
    if args.rdzv_endpoint and not args.standalone and master_port is None and not multi:
        master_addr, master_port = _single_node_endpoint(args.rdzv_endpoint, master_addr)
    if args.standalone:
        master_port = None
    return {
        "nnodes": str(args.nnodes).strip() if multi else "1",
        "rdzv_backend": str(args.rdzv_backend) if multi else "c10d",
        "rdzv_endpoint": endpoint if multi else "",
        "rdzv_conf": conf,
        "node_rank": int(args.node_rank) if static else None,
        "local_addr": args.local_addr,
        "master_addr": master_addr,
        "master_port": None if master_port is None else int(master_port),
    }


def _single_node_endpoint(endpoint: str, master_addr: str) -> tuple[str, int]:
    """On one node, ``--rdzv-endpoint HOST:PORT`` names the workers' store."""
    host, _, port = endpoint.rpartition(":")
    if not port.isdigit():
        raise UsageError(f"--rdzv-endpoint must be HOST:PORT, got {endpoint!r}")
    addr = host.strip("[]") or master_addr
    return ("127.0.0.1" if addr in ("localhost", "") else addr), int(port)


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


def _output(args: argparse.Namespace) -> dict[str, Any]:
    ranks = None
    if args.local_ranks_filter:
        try:
            ranks = frozenset(int(r) for r in str(args.local_ranks_filter).split(","))
        except ValueError:
            raise UsageError(
                "--local-ranks-filter must be a comma-separated list of integers e.g. "
                "--local-ranks-filter=0,1,2"
            ) from None
    return {
        "log_dir": args.log_dir,
        "redirects": str(args.redirects),
        "tee": str(args.tee),
        "local_ranks_filter": ranks,
        "prefix": None if args.no_prefix else args.prefix,
        "duplicate_stdout_filters": _filters(args.duplicate_stdout_filters),
        "duplicate_stderr_filters": _filters(args.duplicate_stderr_filters),
    }


def _filters(value: str | None) -> tuple[str, ...]:
    """torchrun's comma-separated filter list: ``,,`` stands for a comma."""
    if value is None:
        return ()
    placeholder = "\0"
    return tuple(
        item.replace(placeholder, ",") for item in value.replace(",,", placeholder).split(",")
    )


def _target(args: argparse.Namespace) -> Target:
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
        if os.path.isdir(script) and not os.path.isfile(os.path.join(script, "__main__.py")):
            raise UsageError(f"can't find '__main__' module in {script!r}")  # python's words
        if not os.path.isfile(script) and not os.path.isdir(script):
            raise UsageError(f"script {script!r} does not exist")
    return Target(kind, script, tuple(args.training_script_args))


def _timing(args: argparse.Namespace) -> dict[str, Any]:
    shutdown = args.shutdown_timeout
    if shutdown is None:
        env = os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "30")
        try:
            shutdown = duration_type()(env)
        except argparse.ArgumentTypeError as exc:
            raise UsageError(f"TORCH_ELASTIC_SHUTDOWN_TIMEOUT: {exc}") from None
    return {
        "monitor_interval": timedelta(seconds=float(args.monitor_interval)),
        "shutdown_timeout": timedelta(seconds=float(shutdown)),
        "restart_grace": timedelta(seconds=float(args.restart_grace)),
        "timeout": _seconds(args.timeout),
        "hang_timeout": _seconds(args.hang_timeout),
    }


def _seconds(value: float | None) -> timedelta | None:
    return None if value is None else timedelta(seconds=float(value))


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
