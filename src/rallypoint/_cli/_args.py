"""From parsed ``rallypoint run`` arguments to a :class:`LaunchConfig` and a target."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from datetime import timedelta
from typing import Any, Literal

from rallypoint._cli._parser import PROG, UsageError, duration_type
from rallypoint._core import envvars
from rallypoint._core.disk import check_writable
from rallypoint._elastic._options import parse_nnodes
from rallypoint._launch._config import LaunchConfig
from rallypoint._launch._option import declared
from rallypoint._launch._values import parse_nproc
from rallypoint._supervise._worker import Target

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
    options = _launch_options(args)
    options.update(_nodes(args, options, multi))
    if args.no_prefix:
        options["prefix"] = None
    target = _target(args)
    shutdown_timeout = _shutdown_timeout(options.pop("shutdown_timeout"))
    if shutdown_timeout is not None:  # else launch()'s default
        options["shutdown_timeout"] = shutdown_timeout
    snapshots = _snapshot_env(args)
    if snapshots:
        options["env"] = snapshots
    return LaunchConfig(**options), target


def _launch_options(args: argparse.Namespace) -> dict[str, Any]:
    """Every launch option's flag as the option's value (``LaunchConfig``'s declarations)."""
    options: dict[str, Any] = {}
    for name, option in declared(LaunchConfig):
        if option.flag is not None:
            try:
                options[name] = option.flag.keyword_value(getattr(args, option.flag.dest))
            except (TypeError, ValueError) as exc:
                raise UsageError(str(exc)) from None
    return options


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


def _nodes(args: argparse.Namespace, options: dict[str, Any], multi: bool) -> dict[str, Any]:
    """``nnodes`` and the rendezvous of a multi-node job, or the store of a single node."""
    master_addr, master_port = options["master_addr"], options["master_port"]
    endpoint = str(options["rdzv_endpoint"] or "")
    conf = dict(options["rdzv_conf"])
    static = multi and options["rdzv_backend"] == "static"
    if static and not endpoint:
        if master_port is None:
            raise UsageError("a static multi-node job needs --master-port (or --rdzv-endpoint)")
        endpoint = f"{master_addr}:{master_port}"
    if static:
        conf.setdefault("rank", str(options["node_rank"]))
    if endpoint and not args.standalone and master_port is None and not multi:
        master_addr, master_port = _single_node_endpoint(endpoint, master_addr)
    if args.standalone:
        master_port = None
    return {
        "nnodes": str(options["nnodes"]).strip() if multi else "1",
        "rdzv_backend": str(options["rdzv_backend"]) if multi else "c10d",
        "rdzv_endpoint": endpoint if multi else "",
        "rdzv_conf": conf,
        "node_rank": int(options["node_rank"]) if static else None,
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


def _shutdown_timeout(value: timedelta | None) -> timedelta | None:
    """``--shutdown-timeout``, else torch's ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, else
    ``None`` (``launch()``'s default)."""
    env = os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT")
    if value is not None or env is None:
        return value
    try:
        return timedelta(seconds=duration_type(zero=True)(env))
    except argparse.ArgumentTypeError as exc:
        raise UsageError(f"TORCH_ELASTIC_SHUTDOWN_TIMEOUT: {exc}") from None
