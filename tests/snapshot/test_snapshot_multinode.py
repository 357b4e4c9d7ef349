"""Snapshots across nodes: a whole node SIGKILLed (loopback) and a cut link (network
namespaces), each replaced by a new node running the same command; and a job that grows."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import psutil
import pytest
from _jobs import TRAIN, same_params, starts
from _ports import snapshot_listeners
from _train import train

from _support import cli_zygote
from _support.strangers import Holder
from rallypoint.launcher import launch
from rallypoint.testing import _workers
from rallypoint.testing._netns import Network, netns_available

CONF = "read_timeout=20,keep_alive_interval=0.5,keep_alive_max_attempt=3"
RDZV_CONF = {**dict(kv.split("=") for kv in CONF.split(",")), "last_call_timeout": "1"}


def agent_cmd(endpoint: str, run_id: str, out: Path, mode: str, nnodes: str = "2") -> list[str]:
    return [
        sys.executable, "-m", "rallypoint", "run", "--nnodes", nnodes, "--nproc-per-node",
        "1" if mode == "grow" else "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
        "--rdzv-id", run_id, "--rdzv-conf", CONF + ",last_call_timeout=1",
        "--max-restarts", "0", "--shutdown-timeout", "2",
        str(TRAIN), str(out), mode, "60",
    ]  # fmt: skip


def _node(fds: list[int], endpoint: str, run_id: str, out: Path, mode: str, nnodes: str) -> None:
    launch(
        train, str(out), mode, 60,
        nnodes=nnodes, nproc=1 if mode == "grow" else 2, rdzv_backend="c10d",
        rdzv_endpoint=endpoint, run_id=run_id,
        rdzv_conf=RDZV_CONF,
        max_restarts=0, shutdown_timeout=timedelta(seconds=2),
        timeout=timedelta(seconds=120), log_dir=out / f"logs-{run_id}", redirects="3",
    )  # fmt: skip


def launch_node(endpoint: str, run_id: str, out: Path, mode: str, nnodes: str = "2") -> str:
    """What :func:`agent_cmd` runs, as :func:`launch` in a process forked by the session's
    zygote (torch imported already: seconds sooner than a new interpreter; forked from this
    process, it could inherit a lock one of its threads held); returns its workers' output."""
    zygote = _workers._ZYGOTE
    assert zygote is not None, "tests/conftest.py holds a zygote for the session"
    node = zygote.fork(_node, (endpoint, run_id, out, mode, nnodes), [1, 2])
    try:
        node.join(150)
    finally:
        node.kill()
    logs = out / f"logs-{run_id}"
    text = "".join(p.read_text() for p in sorted(logs.rglob("*.log")))
    assert node.exitcode == 0, text
    return text


def _wait_for(path: Path, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.05)


def _finish(procs: list[subprocess.Popen[str]], timeout: float = 120) -> list[str]:
    texts = []
    for p in procs:
        text, _ = p.communicate(timeout=timeout)
        assert p.returncode == 0, text
        texts.append(text)
    return texts


def _node_of(pid: int, agents: list[subprocess.Popen[str]]) -> int:
    for i, agent in enumerate(agents):
        if pid in {c.pid for c in psutil.Process(agent.pid).children(recursive=True)}:
            return i
    raise AssertionError(f"worker {pid} belongs to no agent")


def _kill_tree(pid: int) -> None:
    """SIGKILL a whole node at once: its agent and every process under it."""
    procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.send_signal(signal.SIGKILL)


def _check_resumed_at_37(out: Path, texts: list[str], reference: Path) -> None:
    joined = "".join(texts)
    assert "restored step 37 from memory on every rank (4 ranks" in joined, joined
    resumed = [s for s in starts(out) if s[0]]
    assert resumed == [(37, 37, 4)] * 4, starts(out)
    same_params(out / "final.pt", reference)


@pytest.mark.timeout(240)
def test_whole_node_killed_at_37_replacement_resumes_at_37_bit_identical(
    tmp_path: Path, reference4: Path
) -> None:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    endpoint = f"127.0.0.1:{store.port}"

    def start() -> subprocess.Popen[str]:
        cmd = agent_cmd(endpoint, "nodeloss", tmp_path, "node")
        return cli_zygote.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    agents = [start(), start()]
    try:
        _wait_for(tmp_path / "at37")  # rank 3 saved step 37 (on every copy) and sleeps
        lost = _node_of(int((tmp_path / "at37").read_text()), agents)
        _kill_tree(agents[lost].pid)
        agents[lost].communicate(timeout=30)
        replacement = launch_node(endpoint, "nodeloss", tmp_path, "node")  # a new node
        texts = [*_finish([agents[1 - lost]]), replacement]
    finally:
        for p in agents:
            p.kill()
    _check_resumed_at_37(tmp_path, texts, reference4)


@pytest.mark.timeout(240)
def test_strangers_holding_the_peer_port_do_not_stop_a_replacement_node_restoring(
    tmp_path: Path, reference4: Path
) -> None:
    """64 idle connections to the surviving node's snapshot peer port, reopened whenever
    the server drops them, while a replacement node fetches its replica from there: it must not
    wait behind them for a handshake slot."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    endpoint = f"127.0.0.1:{store.port}"

    def start() -> subprocess.Popen[str]:
        cmd = agent_cmd(endpoint, "hold", tmp_path, "node")
        return cli_zygote.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    agents = [start(), start()]
    try:
        _wait_for(tmp_path / "at37")
        lost = _node_of(int((tmp_path / "at37").read_text()), agents)
        listeners = snapshot_listeners(agents[1 - lost].pid)
        with Holder(listeners, 64) as holder:
            _kill_tree(agents[lost].pid)
            agents[lost].communicate(timeout=30)
            replacement = launch_node(endpoint, "hold", tmp_path, "node")
            texts = [*_finish([agents[1 - lost]]), replacement]
        assert holder.opened >= 64 * len(listeners), holder.opened
    finally:
        for p in agents:
            p.kill()
    _check_resumed_at_37(tmp_path, texts, reference4)


_ok, _why = netns_available()


@pytest.mark.netns
@pytest.mark.skipif(not _ok, reason=_why)
@pytest.mark.timeout(240)
def test_cut_link_at_37_replacement_host_resumes_at_37_bit_identical(
    tmp_path: Path, reference4: Path
) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    with Network(3) as net:

        def start(host: int) -> subprocess.Popen[Any]:
            cmd = agent_cmd("h0:29400", "netcut", tmp_path, "node")
            return net.hosts[host].popen(
                cmd,
                env={**env, "SNAPSHOT_TEST_HOST": f"h{host}"},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )

        first = start(0)
        time.sleep(0.5)  # h0 hosts the rendezvous store
        second = start(1)
        _wait_for(tmp_path / "at37")
        lost = _node_of(int((tmp_path / "at37").read_text()), [first, second])
        assert lost == 1, "h0 hosts the rendezvous store; h1 marks the step (see _train)"
        net.hosts[1].cut()  # its link goes down: no reset, packets vanish
        replacement = start(2)
        texts = _finish([first, replacement])
        second.kill()
    _check_resumed_at_37(tmp_path, texts, reference4)


@pytest.mark.timeout(240)
def test_a_grown_world_cannot_be_mapped_from_memory_and_says_why(tmp_path: Path) -> None:
    """(With --snapshot-dir, DCP reshards instead: test_snapshot_dir_restores_a_fresh_job...)"""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    endpoint = f"127.0.0.1:{store.port}"

    def start() -> subprocess.Popen[str]:
        cmd = agent_cmd(endpoint, "grow", tmp_path, "grow", nnodes="1:2")
        return cli_zygote.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    first = start()
    try:
        _wait_until(lambda: bool(list(tmp_path.glob("start-*"))))
        time.sleep(0.5)  # a few snapshots of the one-rank world
        joined = launch_node(endpoint, "grow", tmp_path, "grow", nnodes="1:2")
        texts = [*_finish([first]), joined]
    finally:
        first.kill()
    joined = "".join(texts)
    assert "saved by a world of 1 ranks and this world has 2" in joined, joined
    assert [s for s in starts(tmp_path) if s[2] == 2] == [(0, 0, 2)] * 2


def _wait_until(ready: Callable[[], bool], timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert time.monotonic() < deadline
        time.sleep(0.05)
