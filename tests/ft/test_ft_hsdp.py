"""HSDP with ``rallypoint.ft``: FSDP2 inside each replica group, ``ManagedProcessGroup``
across them, in a program shaped like torchtitan's torchft integration (``_hsdp_train.py``).

Real processes as a user starts them: ``rallypoint lighthouse`` and one ``rallypoint run
--nproc-per-node 2`` per group, but for a group across two nodes (gloo on CPU). One rank of
that group is SIGKILLed mid-run:
the other groups keep stepping, the failed group is restarted by its launcher, heals its
shards from a live group's same ranks, and every group ends with the same full parameters.
The unit cases check ``ManagedProcessGroup`` as a torch process group on a fake manager.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _groups import (
    STARTED,
    finish,
    lighthouse,
    longest_pause,
    never_back,
    same_parameters,
    start_command,
    steps,
    steps_by_process,
)

from rallypoint.ft.process_group import ManagedProcessGroup, ProcessGroupDummy
from rallypoint.ft.work import _DummyWork

TRAIN = Path(__file__).with_name("_hsdp_train.py")
STEPS = 40
FAULT = 10
HOLD = 25
"""The healthy groups wait after this step until group 1 is restarted (``FT_HOLD``): a
group across two nodes restarts through a new rendezvous, and beside the suite it once
came back after the others had finished."""


def _start(
    out: Path, group: int, address: str, groups: int, endpoint: str = "", **env: str
) -> list[subprocess.Popen[str]]:
    """Group ``group``'s launchers: one ``--nproc-per-node 2``, or with ``endpoint`` (a
    c10d rendezvous store) two nodes of one rank each (a group across nodes)."""
    extra = {"REPLICA_GROUP_ID": str(group), "TORCHFT_LIGHTHOUSE": address,
             "FT_STEP_SLEEP": "0.1", "FT_TOGETHER": str(groups), **env}  # fmt: skip
    flags, nodes = ["--nproc-per-node", "2"], 1
    if endpoint:
        flags, nodes = ["--nproc-per-node", "1", "--nnodes", "2", "--rdzv-backend", "c10d",
                        "--rdzv-endpoint", endpoint, "--rdzv-conf", "is_host=false",
                        "--rdzv-id", f"hsdp-{group}"], 2  # fmt: skip
    procs = [
        start_command(
            "run", *flags, "--max-restarts", "2", str(TRAIN), str(out), str(STEPS), **extra
        )
        for _ in range(nodes)
    ]
    STARTED.extend(procs)
    return procs


@pytest.mark.timeout(300)
def test_hsdp_a_rank_killed_the_other_groups_keep_stepping_and_it_heals(
    tmp_path: Path, endpoint: str
) -> None:
    """Group 1 spans two nodes (two launchers of one rank each); its rank 1, on the second
    node, is SIGKILLed: both of its launchers restart their ranks, and the group heals as
    one."""
    house = lighthouse("--min_replicas", "1", "--join_timeout_ms", "3000")
    try:
        launchers = [
            _start(
                tmp_path,
                g,
                house.address,
                3,
                endpoint if g == 1 else "",
                FT_KILL=f"1:1:{FAULT}",
                FT_HOLD=f"{HOLD}:1",
            )
            for g in range(3)
        ]
        done = iter(finish([p for group in launchers for p in group], timeout=240))
    finally:
        screen = house.stop()
    texts = ["\n".join(next(done) for _ in group) for group in launchers]  # one per group
    context = screen + "\n".join(t[-3000:] for t in texts)
    assert all(p.returncode == 0 for group in launchers for p in group), context
    # each agent of group 1 names the kill, and so does the lighthouse, first: rank 0 may
    # ask for its next quorum before its FSDP collective with the dead rank fails (its
    # agent learns of the kill later), and then leave of that (docs/ft.md, "Groups across
    # nodes")
    assert "group 1 left: rank 1 killed by SIGKILL" in screen, context
    killed = re.findall(
        r"rank 1 on \S+ killed by SIGKILL; restarting the workers on every node", texts[1]
    )
    assert len(killed) == 2, context
    back = [line for line in texts[1].splitlines() if "group 1 healed from group" in line]
    assert back and int(back[-1].split(" at step ")[1].split()[0]) >= FAULT, context
    for g in range(3):
        never_back(steps(tmp_path, g))
        assert steps(tmp_path, g)[-1][1] == STEPS, (g, steps(tmp_path, g)[-3:])
    first, *_, restarted = steps_by_process(tmp_path, 1)
    assert restarted[0] > max(FAULT, first[-1]), (first, restarted)  # at the others' step
    for g in (0, 2):  # they stepped on while group 1 was away: no pause past 3 steps + 1.5 s
        before_hold = [row for row in steps(tmp_path, g) if row[1] <= HOLD]
        worst, median = longest_pause(before_hold, after=2)
        assert worst <= 3 * median + 1.5, (g, worst, median, context)
        during = [s for _, s, n in steps(tmp_path, g) if n == 2 and s > FAULT]
        assert during, (g, steps(tmp_path, g))  # steps of the two groups left
    same_parameters(tmp_path, [0, 1, 2])  # the full state dicts, gathered at the end


class _FakeManager:
    """What ManagedProcessGroup asks of a Manager: its process group, its participants, and
    an allreduce that averages (here: over two participants, the other sending ones)."""

    def __init__(self) -> None:
        self._pg = ProcessGroupDummy(0, 1)
        self.calls: list[Any] = []

    def num_participants(self) -> int:
        return 2

    def allreduce(self, tensor: torch.Tensor, reduce_op: Any = None) -> Any:
        self.calls.append(reduce_op)
        tensor.add_(1).div_(2)
        return _DummyWork(tensor)


@pytest.mark.timeout(60)
def test_managed_process_group_is_a_torch_process_group_whose_allreduce_is_the_managers() -> None:
    manager = _FakeManager()
    pg = ManagedProcessGroup(manager)  # type: ignore[arg-type]
    assert isinstance(pg, dist.ProcessGroup)
    assert dist.get_world_size(pg) == 2 and pg.getBackendName() == "torchft-dummy"
    t = torch.full((3,), 3.0)
    dist.all_reduce(t, group=pg, op=dist.ReduceOp.AVG)
    assert t.tolist() == [2.0, 2.0, 2.0]
    assert manager.calls[-1] == dist.ReduceOp.AVG
    work = dist.all_reduce(t, group=pg, op=dist.ReduceOp.SUM, async_op=True)
    assert isinstance(work, dist.Work) and work.wait()
    assert manager.calls[-1] == dist.ReduceOp.SUM
    with pytest.raises(ValueError, match="one tensor at a time"):
        pg.allreduce([t, t], dist.AllreduceOptions())
    with pytest.raises(RuntimeError, match="configured by its Manager"):
        pg.configure("addr", "0", 0, 1)
