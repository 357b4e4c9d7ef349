"""Defaults for ``rallypoint run`` from the cluster's environment: ``PET_*`` and SLURM.

Kubernetes operators (Kubeflow's PyTorchJob) configure torchrun through ``PET_<OPTION>``
variables; under ``srun`` SLURM describes the step in ``SLURM_*`` variables.
:func:`detect_cluster_env` turns both into run options, so that ``srun rallypoint run
train.py`` needs no flags. Precedence, highest first: the command line, ``PET_<OPTION>``,
SLURM (off with ``RALLYPOINT_IGNORE_SLURM=1``); the mapping is in docs/multinode.md.

Everything here is a pure function of an environment mapping. Malformed variables raise
``ValueError`` naming the variable and the value.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rallypoint._core import envvars
from rallypoint._elastic._options import parse_nnodes

__all__ = [
    "DEFAULT_RDZV_PORT",
    "ClusterDefaults",
    "SlurmStep",
    "compress_hostlist",
    "detect_cluster_env",
    "expand_hostlist",
    "parse_slurm",
    "parse_tasks_per_node",
    "pet_options",
]

DEFAULT_RDZV_PORT = 29400
"""torchrun's default port for a c10d rendezvous endpoint given without a port."""

_TYPED_PET = ("nnodes", "node_rank", "nproc_per_node", "max_restarts")
_RDZV = ("rdzv_backend", "rdzv_endpoint", "rdzv_id", "rdzv_conf")


# ---------------------------------------------------------------------------- hostlists


def _split_top_level(text: str, what: str) -> list[str]:
    """Split on commas outside brackets; reject unbalanced or nested brackets."""
    parts: list[str] = []
    depth = 0
    start = 0
    for i, ch in enumerate(text):
        if ch == "[":
            if depth:
                raise ValueError(f"nested '[' at position {i} in {what} {text!r}")
            depth = 1
        elif ch == "]":
            if not depth:
                raise ValueError(f"unmatched ']' at position {i} in {what} {text!r}")
            depth = 0
        elif ch == "," and not depth:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"unclosed '[' in {what} {text!r}")
    parts.append(text[start:])
    return parts


_RANGE = re.compile(r"(\d+)(?:-(\d+))?")


def _expand_ranges(body: str, hostlist: str) -> list[str]:
    out: list[str] = []
    for piece in body.split(","):
        m = _RANGE.fullmatch(piece.strip())
        if m is None:
            raise ValueError(
                f"bad range {piece!r} in hostlist {hostlist!r}: expected N or N-M with digits"
            )
        lo_s, hi_s = m.group(1), m.group(2)
        lo = int(lo_s)
        hi = lo if hi_s is None else int(hi_s)
        if hi < lo:
            raise ValueError(f"bad range {piece!r} in hostlist {hostlist!r}: {hi} < {lo}")
        if hi - lo > 100_000:
            raise ValueError(f"range {piece!r} in hostlist {hostlist!r} is too large")
        width = len(lo_s)
        out.extend(str(n).zfill(width) for n in range(lo, hi + 1))
    return out


def expand_hostlist(hostlist: str) -> list[str]:
    """Expand a SLURM hostlist: ``"node[01-03,07],gpu5"`` → ``node01 node02 node03 node07 gpu5``.

    Zero padding follows the range's first number; several bracket groups in one name
    expand as a product (``"r[1-2]n[1-2]"`` → ``r1n1 r1n2 r2n1 r2n2``). Order is kept.
    """
    if not isinstance(hostlist, str):
        raise TypeError(f"hostlist must be a str, got {type(hostlist).__name__}")
    text = hostlist.strip()
    if not text:
        raise ValueError("empty hostlist: expected names like 'node[01-03],gpu5'")
    hosts: list[str] = []
    for item in _split_top_level(text, "hostlist"):
        item = item.strip()
        if not item:
            raise ValueError(f"empty name in hostlist {hostlist!r} (two commas in a row?)")
        # alternate literal text and bracket bodies: "a[1-2]b[3]" -> ["a", "1-2", "b", "3", ""]
        pieces = re.split(r"\[([^\]]*)\]", item)
        choices: list[list[str]] = []
        for i, piece in enumerate(pieces):
            if i % 2:
                if not piece.strip():
                    raise ValueError(f"empty brackets in hostlist {hostlist!r}")
                choices.append(_expand_ranges(piece, hostlist))
            else:
                if any(c.isspace() for c in piece):
                    raise ValueError(f"whitespace inside host name {item!r} in {hostlist!r}")
                choices.append([piece])
        hosts.extend("".join(combo) for combo in itertools.product(*choices))
    return hosts


_SUFFIX = re.compile(r"^(.*?)(\d+)$")


def compress_hostlist(hosts: list[str]) -> str:
    """The inverse of :func:`expand_hostlist` for a list of names (order kept).

    Consecutive names that differ only in a trailing number are folded into ranges:
    ``["n01", "n02", "n03", "n07", "gpu5"]`` → ``"n[01-03,07],gpu5"``.
    """
    # groups: (prefix, [(lo_str, hi)]) for numbered names, (name, None) for the rest
    items: list[tuple[str, list[tuple[str, int]] | None]] = []
    for host in hosts:
        if not host or any(c in host for c in "[],") or any(c.isspace() for c in host):
            raise ValueError(f"cannot put host name {host!r} in a hostlist")
        m = _SUFFIX.match(host)
        if m is None:
            items.append((host, None))
            continue
        prefix, digits = m.group(1), m.group(2)
        num = int(digits)
        last = items[-1][1] if items and items[-1][0] == prefix else None
        if last is not None:
            lo_s, hi = last[-1]
            if num == hi + 1 and str(num).zfill(len(lo_s)) == digits:
                last[-1] = (lo_s, num)
            else:
                last.append((digits, num))
        else:
            items.append((prefix, [(digits, num)]))
    out: list[str] = []
    for prefix, ranges in items:
        if ranges is None:
            out.append(prefix)
            continue
        if len(ranges) == 1 and int(ranges[0][0]) == ranges[0][1]:
            out.append(prefix + ranges[0][0])
            continue
        body = ",".join(
            lo_s if int(lo_s) == hi else f"{lo_s}-{str(hi).zfill(len(lo_s))}" for lo_s, hi in ranges
        )
        out.append(f"{prefix}[{body}]")
    return ",".join(out)


def parse_tasks_per_node(text: str) -> list[int]:
    """Expand SLURM's tasks-per-node format: ``"4(x2),3"`` → ``[4, 4, 3]``."""
    out: list[int] = []
    for piece in text.strip().split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:\(x(\d+)\))?\s*", piece)
        if m is None:
            raise ValueError(f"bad tasks-per-node value {text!r}: expected counts like '4(x2),3'")
        count, repeat = int(m.group(1)), int(m.group(2) or 1)
        if count < 1 or repeat < 1:
            raise ValueError(f"bad tasks-per-node value {text!r}: counts must be >= 1")
        out.extend([count] * repeat)
    return out


# ---------------------------------------------------------------------------- SLURM


@dataclass(kw_only=True, slots=True, frozen=True)
class SlurmStep:
    """The SLURM job step this process runs in, as read from ``SLURM_*`` variables."""

    job_id: str
    step_id: str | None
    proc_id: int
    ntasks: int
    nnodes: int
    node_id: int
    hosts: tuple[str, ...]
    tasks_per_node: tuple[int, ...]

    @property
    def one_task_per_node(self) -> bool:
        return all(n == 1 for n in self.tasks_per_node)


def _first(env: Mapping[str, str], *names: str) -> tuple[str, str] | None:
    for name in names:
        value = env.get(name)
        if value is not None and value.strip():
            return name, value.strip()
    return None


def _int_var(env: Mapping[str, str], *names: str, minimum: int = 0) -> int:
    found = _first(env, *names)
    if found is None:
        raise ValueError(f"SLURM job found but {names[0]} is not set")
    name, value = found
    try:
        number = int(value)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None
    if number < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {number}")
    return number


def parse_slurm(env: Mapping[str, str]) -> SlurmStep | None:
    """Read the SLURM step from ``env``; ``None`` outside SLURM (no job id or no task id)."""
    job = _first(env, "SLURM_JOB_ID", "SLURM_JOBID")
    if job is None or _first(env, "SLURM_PROCID") is None:
        return None
    proc_id = _int_var(env, "SLURM_PROCID")
    ntasks = _int_var(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS", minimum=1)
    nnodes = _int_var(env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES", minimum=1)
    node_id = _int_var(env, "SLURM_NODEID")
    nodelist = _first(env, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
    if nodelist is None:
        raise ValueError("SLURM job found but SLURM_NODELIST is not set")
    try:
        hosts = expand_hostlist(nodelist[1])
    except ValueError as exc:
        raise ValueError(f"{nodelist[0]}: {exc}") from None
    if len(hosts) != nnodes:
        raise ValueError(
            f"{nodelist[0]}={nodelist[1]!r} names {len(hosts)} hosts but the step has "
            f"{nnodes} nodes"
        )
    tpn_var = _first(env, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
    if tpn_var is None:
        per = _first(env, "SLURM_NTASKS_PER_NODE")
        tpn_var = (per[0], f"{per[1]}(x{nnodes})") if per else None
    if tpn_var is None:
        tasks = [ntasks // nnodes] * nnodes if ntasks % nnodes == 0 else None
        if tasks is None:
            raise ValueError(
                f"SLURM_NTASKS={ntasks} over {nnodes} nodes needs SLURM_TASKS_PER_NODE"
            )
    else:
        try:
            tasks = parse_tasks_per_node(tpn_var[1])
        except ValueError as exc:
            raise ValueError(f"{tpn_var[0]}: {exc}") from None
        if len(tasks) == 1 and nnodes > 1 and tpn_var[0] == "SLURM_NTASKS_PER_NODE":
            tasks = tasks * nnodes
        if len(tasks) != nnodes or sum(tasks) != ntasks:
            raise ValueError(
                f"{tpn_var[0]}={tpn_var[1]!r} does not describe {ntasks} tasks on {nnodes} nodes"
            )
    if proc_id >= ntasks:
        raise ValueError(f"SLURM_PROCID={proc_id} is not below the task count {ntasks}")
    if node_id >= nnodes:
        raise ValueError(f"SLURM_NODEID={node_id} is not below the node count {nnodes}")
    step = _first(env, "SLURM_STEP_ID", "SLURM_STEPID")
    return SlurmStep(
        job_id=job[1],
        step_id=step[1] if step else None,
        proc_id=proc_id,
        ntasks=ntasks,
        nnodes=nnodes,
        node_id=node_id,
        hosts=tuple(hosts),
        tasks_per_node=tuple(tasks),
    )


# ---------------------------------------------------------------------------- PET_* and merge


def pet_options(env: Mapping[str, str]) -> dict[str, str]:
    """Every ``PET_<OPTION>`` variable as ``{option_dest: value}`` (``PET_NODE_RANK`` →
    ``node_rank``), the way torchrun's ``env`` argparse action reads them."""
    return {
        name[4:].lower(): value
        for name, value in env.items()
        if name.startswith("PET_") and len(name) > 4
    }


@dataclass(kw_only=True, slots=True, frozen=True)
class ClusterDefaults:
    """Defaults for the run options found in the environment (``None`` = not found).

    ``source`` says where they came from: ``"slurm"``, ``"pet"``, ``"slurm+pet"`` or ``""``.
    ``other`` holds the remaining ``PET_*`` options, raw, keyed by option name.
    """

    source: str = ""
    nnodes: str | None = None
    node_rank: int | None = None
    nproc_per_node: str | None = None
    max_restarts: int | None = None
    rdzv_backend: str | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None
    rdzv_conf: str | None = None
    slurm: SlurmStep | None = None
    other: Mapping[str, str] = field(default_factory=dict)

    def options(self) -> dict[str, Any]:
        """The found options as ``{option_dest: value}``, including ``other``."""
        out: dict[str, Any] = dict(self.other)
        for name in (*_TYPED_PET, *_RDZV):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        return out

    def merge(self, explicit: Mapping[str, Any]) -> dict[str, Any]:
        """Apply these defaults under ``explicit`` options (CLI flags): a flag that is present
        and not ``None`` wins; the environment fills the rest."""
        merged = self.options()
        merged.update({k: v for k, v in explicit.items() if v is not None})
        return merged


def _nonneg_int(name: str, value: str) -> int:
    try:
        number = int(value.strip())
    except ValueError:
        raise ValueError(f"{name} must be an integer >= 0, got {value!r}") from None
    if number < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    return number


def _check_nnodes(value: str) -> None:
    try:
        parse_nnodes(value)
    except ValueError:
        raise ValueError(
            f"PET_NNODES must be N or MIN:MAX with 0 < MIN <= MAX, got {value!r}"
        ) from None


def detect_cluster_env(env: Mapping[str, str]) -> ClusterDefaults:
    """Run-option defaults from ``PET_*`` and SLURM variables in ``env`` (pass ``os.environ``).

    SLURM: the step's variables win over the job's (``SLURM_STEP_NODELIST`` over
    ``SLURM_JOB_NODELIST`` over ``SLURM_NODELIST``). One task per node gives one agent per
    node (``nnodes = SLURM_NNODES``, ``node_rank = SLURM_NODEID``); several tasks on a node
    give one agent per task with one worker each (``nnodes = SLURM_NTASKS``,
    ``node_rank = SLURM_PROCID``, ``nproc_per_node = 1``). The rendezvous is c10d on the
    first host of the node list, port 29400, with ``rdzv_id = slurm-<job>[.<step>]``.
    """
    found: dict[str, Any] = {}
    sources: list[str] = []
    slurm = None
    if env.get(envvars.IGNORE_SLURM, "").strip().lower() not in {"1", "true", "yes"}:
        slurm = parse_slurm(env)
    if slurm is not None:
        sources.append("slurm")
        if slurm.one_task_per_node:
            found.update(nnodes=str(slurm.nnodes), node_rank=slurm.node_id)
        else:
            found.update(nnodes=str(slurm.ntasks), node_rank=slurm.proc_id, nproc_per_node="1")
        run_id = f"slurm-{slurm.job_id}" + (f".{slurm.step_id}" if slurm.step_id else "")
        found.update(
            rdzv_backend="c10d",
            rdzv_endpoint=f"{slurm.hosts[0]}:{DEFAULT_RDZV_PORT}",
            rdzv_id=run_id,
        )
    pet = pet_options(env)
    if pet:
        sources.append("pet")
    for name in ("node_rank", "max_restarts"):
        if name in pet:
            found[name] = _nonneg_int(f"PET_{name.upper()}", pet.pop(name))
    for name in ("nnodes", "nproc_per_node", *_RDZV):
        if name in pet:
            value = pet.pop(name).strip()
            if not value:
                raise ValueError(f"PET_{name.upper()} is set but empty; unset it or give a value")
            if name == "nnodes":
                _check_nnodes(value)
            found[name] = value
    return ClusterDefaults(source="+".join(sources), slurm=slurm, other=pet, **found)
