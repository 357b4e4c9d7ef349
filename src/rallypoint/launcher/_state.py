"""The agent's records: who this node is in the job (:class:`GroupInfo`), one worker, and
how an attempt ended."""

from __future__ import annotations

import signal
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from rallypoint.launcher._config import LaunchConfig
from rallypoint.launcher._errors import WorkerState
from rallypoint.launcher._summary import describe_status

__all__ = ["GroupInfo", "Outcome", "Worker", "resolve_group"]


@dataclass(frozen=True, slots=True)
class GroupInfo:
    """This node's place in the job: the result of the rendezvous step."""

    group_rank: int
    group_world_size: int
    world_size: int
    rank_offset: int
    master_addr: str
    master_port: int
    """0: let the store pick a free port."""
    hosts_store: bool
    run_id: str


def resolve_group(config: LaunchConfig) -> GroupInfo:
    """Single-node (static) rendezvous; the multi-node agent replaces this step."""
    return GroupInfo(
        group_rank=0,
        group_world_size=1,
        world_size=config.total_world_size,
        rank_offset=config.rank_offset,
        master_addr=config.master_addr,
        master_port=config.master_port or 0,
        hosts_store=config.rank_offset == 0,
        run_id=config.run_id or uuid.uuid4().hex[:12],
    )


@dataclass(slots=True)
class Worker:
    local_rank: int
    rank: int
    pid: int
    error_file: Path
    res_fd: int
    status: int | None = None
    exited_at: float = 0.0
    signalled: int | None = None
    result: bytearray = field(default_factory=bytearray)

    @property
    def returncode(self) -> int | None:
        return None if self.status is None else describe_status(self.status)[0]

    def state(self) -> WorkerState:
        if self.status is None:
            return WorkerState(self.rank, self.local_rank, self.pid, "running", None, "running")
        code, text = describe_status(self.status)
        kind = "succeeded" if code == 0 else "failed"
        if code != 0 and self.signalled is not None:
            kind = "terminated"
            text = f"{text} (stopped by rallypoint with {signal.Signals(self.signalled).name})"
        return WorkerState(self.rank, self.local_rank, self.pid, kind, code, text)


@dataclass(slots=True)
class Outcome:
    kind: str  # "ok" | "failed" | "signal" | "timeout" | "bad_target" | "hang" | "restart"
    workers: list[Worker]
    root: Worker | None = None
    signum: int = 0
    reason: str = ""
