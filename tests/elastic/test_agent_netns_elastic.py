"""The elastic agent across fake hosts (network namespaces): node loss and a cut link."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from rallypoint.testing._netns import Network, netns_available

_ok, _why = netns_available()
pytestmark = [pytest.mark.netns, pytest.mark.skipif(not _ok, reason=_why)]

WORKER = """
import os, sys, time
import torch, torch.distributed as dist

dist.init_process_group("gloo")
nodes = int(os.environ["GROUP_WORLD_SIZE"])
name = f"{os.environ['RANK']}-{nodes}-{os.uname().nodename}"
open(os.path.join(sys.argv[1], name), "w").close()
t = torch.ones(1)
while nodes != int(sys.argv[2]):   # keep going until the world has the wanted node count
    dist.all_reduce(t)
    time.sleep(0.05)
dist.all_reduce(t)
dist.destroy_process_group()
"""

KEEP_ALIVE, ATTEMPTS = 0.5, 3
WINDOW = KEEP_ALIVE * ATTEMPTS


def _start(
    net: Network,
    script: Path,
    out: Path,
    want: int,
    *,
    nnodes: str = "",
    hosts: str = "all",
    events: Path | None = None,
    last_call: float = 1,
) -> list[subprocess.Popen[Any]]:
    # last_call: how long a rendezvous that reached its minimum waits for more nodes; the
    # three-node tests need all three in the first round, and under load (a stalled
    # TCPStore connect) one agent can be several seconds late
    conf = (
        f"read_timeout=10,last_call_timeout={last_call},keep_alive_interval={KEEP_ALIVE},"
        f"keep_alive_max_attempt={ATTEMPTS}"
    )
    procs = []
    chosen = net.hosts if hosts == "all" else [net.hosts[int(i)] for i in hosts.split(",")]
    for host in chosen:
        cmd = [
            sys.executable, "-m", "rallypoint", "run",
            "--nnodes", nnodes or f"2:{len(net.hosts)}",
            "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h0:29400",
            "--rdzv-id", "netjob", "--rdzv-conf", conf, "--shutdown-timeout", "2",
            *(["--events", str(events)] if events else []),
            str(script), str(out), str(want),
        ]  # fmt: skip
        procs.append(host.popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        if host.index == 0 and len(chosen) > 1:
            time.sleep(0.5)  # h0 hosts the rendezvous store; the others connect to it
    return procs


def _wait_files(out: Path, pattern: str, count: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while len(list(out.glob(pattern))) < count:
        assert time.monotonic() < deadline, sorted(p.name for p in out.iterdir())
        time.sleep(0.05)


def _survivors_finish(procs: list[subprocess.Popen[Any]], timeout: float) -> list[str]:
    texts = []
    for p in procs:
        stdout, _ = p.communicate(timeout=timeout)
        assert p.returncode == 0, stdout
        texts.append(stdout)
    return texts


@pytest.mark.timeout(120)
def test_killed_agent_survivors_continue_at_min(tmp_path: Path) -> None:
    script = tmp_path / "w.py"
    script.write_text(WORKER)
    out = tmp_path / "out"
    out.mkdir()
    with Network(3) as net:
        procs = _start(net, script, out, want=2, last_call=10)
        _wait_files(out, "*-3-*", 3)  # a 3-node world runs
        procs[2].kill()
        texts = _survivors_finish(procs[:2], timeout=60)
    assert all("membership changed" in t for t in texts), texts
    _survivors_kept_their_ranks(out)


def _survivors_kept_their_ranks(out: Path) -> None:
    """h0 and h1 form the 2-node world. Ranks come by arrival (h0 starts first, but a
    loaded machine may bring h1 first), and a survivor keeps its rank when it is inside the
    smaller world."""
    before = {host: int(rank) for rank, _, host in _names(out, "*-3-*")}
    after = {host: int(rank) for rank, _, host in _names(out, "*-2-*")}
    assert sorted(after) == ["h0", "h1"] and sorted(after.values()) == [0, 1], after
    assert all(after[h] == before[h] for h in after if before[h] < 2), (before, after)


def _names(out: Path, pattern: str) -> list[list[str]]:
    """The ``rank-nodes-host`` files the workers wrote, split."""
    return [p.name.split("-") for p in out.glob(pattern)]


@pytest.mark.timeout(120)
def test_cut_link_is_noticed_within_the_window(tmp_path: Path) -> None:
    script = tmp_path / "w.py"
    script.write_text(WORKER)
    out = tmp_path / "out"
    out.mkdir()
    events = tmp_path / "events.jsonl"
    with Network(3) as net:
        procs = _start(net, script, out, want=2, events=events, last_call=10)
        _wait_files(out, "*-3-*", 3)
        net.hosts[2].cut()
        cut = time.time()
        _survivors_finish(procs[:2], timeout=60)
        procs[2].kill()
    _survivors_kept_their_ranks(out)
    from rallypoint.launcher import read_events

    restarts = [e for e in read_events(events) if e.kind == "restart" and e.node in ("h0", "h1")]
    assert {e.node for e in restarts} == {"h0", "h1"}
    # the agents decided to restart within the missed-heartbeat window plus a check interval
    # (generous margin for a loaded machine; measured here: about 2 s)
    noticed = min(e.ts for e in restarts) - cut
    print(f"cut link noticed after {noticed:.2f} s (window {WINDOW} s)")
    assert noticed < WINDOW + 5, noticed


@pytest.mark.timeout(120)
def test_added_host_is_admitted_by_scale_up(tmp_path: Path) -> None:
    script = tmp_path / "w.py"
    script.write_text(WORKER)
    out = tmp_path / "out"
    out.mkdir()
    with Network(2) as net:
        first = _start(net, script, out, want=2, nnodes="1:2", hosts="0")
        _wait_files(out, "*-1-*", 1)  # h0 runs alone
        second = _start(net, script, out, want=2, nnodes="1:2", hosts="1")
        texts = _survivors_finish(first + second, timeout=60)
    assert "membership changed" in texts[0]
    assert sorted(p.name for p in out.glob("*-2-*")) == ["0-2-h0", "1-2-h1"]
