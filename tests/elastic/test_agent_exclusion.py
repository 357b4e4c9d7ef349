"""Exclusion of an agent that keeps failing, with real agents on one
host and the default ``--local-addr``, as on a laptop: exclusion names the agent (its
identity in the rendezvous, shown with its host), so the healthy agents on the same host
stay; the agent that hosts the rendezvous store keeps serving it when it is excluded; a
new agent on that host joins as a new node; a malformed exclusion list is one line."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _support import cli_zygote
from rallypoint._core.net import free_port
from rallypoint.observe._events import read_events
from rallypoint.observe._timeline import build_timeline

pytestmark = pytest.mark.slow

WORKER = """
import os, sys, time
import torch, torch.distributed as dist
out, mode = sys.argv[1], sys.argv[2]
if mode == "bad":
    raise RuntimeError("CUDA error: uncorrectable ECC error encountered")
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
open(os.path.join(out, f"trained-{os.environ['RANK']}-{t.item():.0f}"), "w").close()
while not os.path.exists(os.path.join(out, "finish")):
    time.sleep(0.05)
dist.destroy_process_group()
"""

HOST = socket.gethostname()


def _agent(
    endpoint: str, nnodes: str, name: str, out: Path, mode: str, *extra: str
) -> subprocess.Popen[str]:
    """An agent with the default ``--local-addr``; it hosts the rendezvous store if it is
    the first on this host to take the endpoint's port (unless ``extra`` says otherwise)."""
    cmd = [
        sys.executable, "-m", "rallypoint", "run", "--nnodes", nnodes,
        "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "excl",
        "--max-restarts", "3", "--shutdown-timeout", "3",
        "--events", str(out / f"events-{name}.jsonl"), *extra,
        str(out / "worker.py"), str(out), mode,
    ]  # fmt: skip
    return cli_zygote.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


# the first round waits for every agent (they start one after another); later rounds
# finish as soon as the nodes the last round expects are back
HOSTED = ("--rdzv-conf", "read_timeout=20,last_call_timeout=30")


def _end(p: subprocess.Popen[str], timeout: float = 60) -> tuple[int, str]:
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        raise AssertionError(f"agent did not end:\n{out}{err}") from None
    return p.returncode, out + err


def _wait_listening(port: int, agent: subprocess.Popen[str]) -> None:
    """Until the first agent hosts the rendezvous store (its port accepts connections)."""
    deadline = time.monotonic() + 60
    while True:
        assert agent.poll() is None, "the store-hosting agent ended"
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            assert time.monotonic() < deadline, "the first agent never hosted the store"
            time.sleep(0.05)


def _wait_trained(out: Path, world: int, agents: dict[str, subprocess.Popen[str]]) -> None:
    deadline = time.monotonic() + 60
    while len(list(out.glob(f"trained-*-{world}"))) < world:
        if time.monotonic() > deadline:
            for p in agents.values():
                p.kill()
            screens = {name: p.communicate() for name, p in agents.items()}
            raise AssertionError(f"no training at a world of {world}: {screens}")
        time.sleep(0.05)


def _identity(pid: int) -> str:
    """How the screen names the agent of process ``pid``: its rendezvous id and host."""
    return rf"excluded node \S+_{pid}_\d+_[0-9a-f]+ \(host {re.escape(HOST)}\)"


@pytest.mark.timeout(120)
def test_the_bad_agent_is_excluded_and_the_healthy_ones_on_its_host_finish(
    tmp_path: Path,
) -> None:
    (tmp_path / "worker.py").write_text(WORKER)
    port = free_port()
    endpoint = f"127.0.0.1:{port}"
    procs = ["--nproc-per-node", "2", *HOSTED]
    agents = {"A": _agent(endpoint, "2:3", "A", tmp_path, "good", *procs)}
    try:
        _wait_listening(port, agents["A"])  # A hosts the store, as in the issue
        for name, mode in (("B", "good"), ("C", "bad")):
            agents[name] = _agent(endpoint, "2:3", name, tmp_path, mode, *procs)
        code, text = _end(agents["C"])
        assert code == 4, text
        last = text.strip().splitlines()[-1]
        assert re.match(rf"rallypoint run: {_identity(agents['C'].pid)}: the root cause", last)
        assert "failures in a row" in last and "this node leaves the job" in last, text
        _wait_trained(tmp_path, 4, agents)  # A and B: 2 workers each
        (tmp_path / "finish").write_text("")
        for name in ("A", "B"):
            code, text = _end(agents[name])
            assert code == 0, (name, text)
            assert re.search(_identity(agents["C"].pid), text), text
            assert "(restarts used: 1 of 3)" in text, "the exclusion spends no restart"
        timeline = build_timeline(read_events(sorted(tmp_path.glob("events-*.jsonl"))))
        [mark] = [m for m in timeline.marks if m.kind == "exclusion"]
        assert re.match(_identity(agents["C"].pid), mark.label), mark.label
    finally:
        (tmp_path / "finish").write_text("")
        for p in agents.values():
            p.kill()


@pytest.mark.timeout(120)
def test_an_excluded_store_host_serves_the_store_until_the_job_ends(tmp_path: Path) -> None:
    (tmp_path / "worker.py").write_text(WORKER)
    port = free_port()
    endpoint = f"127.0.0.1:{port}"
    rules = [*HOSTED, "--max-node-failures", "2"]
    agents = {"A": _agent(endpoint, "1:2", "A", tmp_path, "bad", *rules)}
    try:
        _wait_listening(port, agents["A"])
        agents["B"] = _agent(endpoint, "1:2", "B", tmp_path, "good", *rules)
        _wait_trained(tmp_path, 1, agents)  # B alone, the store still up
        if agents["A"].poll() is not None:
            code, text = _end(agents["A"])
            raise AssertionError(f"the excluded store host left with the store ({code}):\n{text}")
        # a new agent on the excluded agent's host is a new node: it says so and joins
        agents["A2"] = _agent(endpoint, "1:2", "A2", tmp_path, "good", *rules)
        _wait_trained(tmp_path, 2, agents)
        (tmp_path / "finish").write_text("")
        texts = {name: _end(agents[name]) for name in ("B", "A2")}
        assert [code for code, _ in texts.values()] == [0, 0], texts
        note = rf"rallypoint: note: agent \S+_{agents['A'].pid}_\S+ on this host \({HOST}\)"
        note += r" was excluded from job 'excl' at .*; exclusion applies to that agent"
        assert re.search(note, texts["A2"][1]), texts["A2"][1]
        code, text = _end(agents["A"])
        assert code == 4, text
        serving = "this node leaves the job, but it hosts the rendezvous store: it keeps serving"
        assert serving in text, text
        last = text.strip().splitlines()[-1]
        assert re.match(rf"rallypoint run: {_identity(agents['A'].pid)}: ", last), last
        assert last.endswith("served the rendezvous store until the job ended"), last
    finally:
        (tmp_path / "finish").write_text("")
        for p in agents.values():
            p.kill()


@pytest.mark.timeout(120)
def test_excluding_below_min_nodes_ends_the_job_saying_so(tmp_path: Path, endpoint: str) -> None:
    (tmp_path / "worker.py").write_text(WORKER)
    (tmp_path / "finish").write_text("")
    rdzv = ("--rdzv-conf", "is_host=false,read_timeout=20,last_call_timeout=30")
    agents = {n: _agent(endpoint, "2:2", n, tmp_path, n, *rdzv) for n in ("good", "bad")}
    try:
        node = rf"node \S+_{agents['bad'].pid}_\S+ \(host {re.escape(HOST)}\)"
        for n, p in agents.items():
            code, text = _end(p)
            assert code == 1, (n, text)
            assert re.search(rf"{node} was the root cause of 2 failures in a row", text), text
            assert "fewer than the minimum of 2 (--nnodes): ending the job" in text
    finally:
        for p in agents.values():
            p.kill()


@pytest.mark.timeout(60)
def test_a_malformed_exclusion_list_is_one_rendezvous_error(tmp_path: Path, endpoint: str) -> None:
    from torch.distributed import TCPStore  # type: ignore[attr-defined]  # re-exported

    host, port = endpoint.rsplit(":", 1)
    client = TCPStore(host, int(port), is_master=False, wait_for_workers=False)
    client.set("rallypoint/excl/job/excluded", "not json{")
    (tmp_path / "worker.py").write_text(WORKER)
    rdzv = ("--rdzv-conf", "is_host=false,read_timeout=20")
    code, text = _end(_agent(endpoint, "1:2", "A", tmp_path, "good", *rdzv))
    assert code == 1, text
    assert text.strip().splitlines() == [
        f"rallypoint run: rendezvous {endpoint!r}: the key 'rallypoint/excl/job/excluded' holds "
        "a malformed exclusion list (Expecting value: line 1 column 1 (char 0)); this node stopped"
    ], text
