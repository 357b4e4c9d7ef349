"""No single point of failure: jobs on a 3-member etcd cluster lose an etcd member (the
leader killed, or its link cut) during rendezvous and during training, and a training node,
and go on: every rank keeps training, the job ends with exit 0 and the right result.

Workers train in a loop of gloo all_reduces and log each step's time
(``rallypoint.testing.training_log``); the test stops the job by creating ``out/stop``
(the ranks agree on it through an all_reduce). Nothing here
spends restart budget (``--max-restarts 0``): a member loss must not restart anyone, and a
node loss is a membership change.
"""

from __future__ import annotations

import base64
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from rallypoint.rendezvous._rounds import Keys
from rallypoint.testing._etcd import etcd_binary
from rallypoint.testing._etcd_cluster import EtcdCluster
from rallypoint.testing._netns import Network, netns_available
from rallypoint.testing.training_log import (
    STEP_WORKER,
    read_results,
    step_times,
    stop_training,
    wait_training,
)

pytestmark = [
    pytest.mark.etcd,
    pytest.mark.skipif(etcd_binary() is None, reason="etcd is not on PATH (apt: etcd-server)"),
]

RUN_ID = "ha"
# the liveness window (0.5 s x 8 = 4 s) must exceed what an etcd member loss stalls a
# heartbeat: one bounded try at the lost member (request_timeout, 2 s) plus an election
INTERVAL, ATTEMPTS = 0.5, 8
CONF = (
    f"keep_alive_interval={INTERVAL},keep_alive_max_attempt={ATTEMPTS},read_timeout=30,"
    "last_call_timeout=30"
)


def _agent(
    name: str,
    endpoint: str,
    nnodes: str,
    script: Path,
    out: Path,
    popen: Callable[..., subprocess.Popen[Any]] = subprocess.Popen,
) -> subprocess.Popen[Any]:
    cmd = [
        sys.executable, "-m", "rallypoint", "run",
        "--nnodes", nnodes, "--nproc-per-node", "1",
        "--rdzv-backend", "etcd", "--rdzv-endpoint", endpoint, "--rdzv-id", RUN_ID,
        "--rdzv-conf", CONF, "--max-restarts", "0", "--shutdown-timeout", "2",
        "--events", str(out / f"events-{name}"),
        str(script), str(out),
    ]  # fmt: skip
    log = open(out / f"agent-{name}.log", "w")  # noqa: SIM115 - handed to the child
    try:
        env = dict(os.environ, NODE_NAME=name, OMP_NUM_THREADS="1")
        return popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    finally:
        log.close()


def _logs(out: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(out.glob("agent-*")))


def _training_since(out: Path, world: int, since: float) -> float:
    return wait_training(out, world, since, timeout=60, diagnose=lambda: _logs(out))


def _leader_first(cluster: EtcdCluster) -> tuple[str, list[int]]:
    """The endpoint list starting with the current leader (so the agents talk to it: the
    member they use and the leader lost at once is the hard case), and its member order."""
    first = cluster.leader()
    order = [(first + i) % len(cluster.members) for i in range(len(cluster.members))]
    return ",".join(cluster.members[i].endpoint for i in order), order


def _enrolled(cluster: EtcdCluster, k: int) -> int:
    """How many nodes took a slot in round ``k`` (asked of any reachable member)."""
    start = ("/rallypoint/" + Keys(RUN_ID).r(k, "joined") + "/").encode()
    end = start[:-1] + bytes([start[-1] + 1])
    body = {
        "key": base64.b64encode(start).decode(),
        "range_end": base64.b64encode(end).decode(),
        "count_only": True,
    }
    for member in cluster.members:
        if member.running and not member.is_cut:
            answer = member.post("/v3/kv/range", body)
            if "header" in answer:
                return int(answer.get("count", 0))
    return 0


def _wait_enrolled(cluster: EtcdCluster, k: int, n: int, out: Path) -> None:
    deadline = time.monotonic() + 60
    while _enrolled(cluster, k) < n:
        assert time.monotonic() < deadline, _logs(out)
        time.sleep(0.1)


def _stop_job(out: Path, procs: Sequence[subprocess.Popen[Any]], world: int) -> None:
    stop_training(out)
    for p in procs:
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail("the job did not end after the stop file:\n" + _logs(out))
        assert p.returncode == 0, _logs(out)
    results = read_results(out, world)
    assert len(results) == world, (results, _logs(out))
    assert all(total == sum(range(world)) and steps > 0 for total, steps in results), results


def _kill_all(procs: Sequence[subprocess.Popen[Any]]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)


def _restarts(out: Path) -> list[str]:
    """The reasons of every restart any node logged."""
    from rallypoint.observe import read_events

    events = read_events(sorted(out.glob("events-*")))
    assert any(e.kind == "round" for e in events)  # the logs are there and readable
    return [str(e.get("reason")) for e in events if e.kind == "restart"]


def _nobody_stops(out: Path, world: int, lost: float, what: str) -> None:
    """Every rank keeps stepping after the loss at ``lost`` and after the liveness window
    (nobody was presumed dead), and no node restarted its workers."""
    pause = _training_since(out, world, lost)
    time.sleep(INTERVAL * ATTEMPTS + 2)
    _training_since(out, world, time.time())
    assert not _restarts(out), _logs(out)
    print(f"{what}: every rank stepped within {pause:.2f} s")


@pytest.mark.timeout(180)
def test_leader_killed_in_rendezvous_and_in_training_then_a_node_lost(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(STEP_WORKER)
    out = tmp_path / "out"
    out.mkdir()
    procs: list[subprocess.Popen[Any]] = []
    with EtcdCluster(3) as cluster:
        endpoint, order = _leader_first(cluster)
        try:
            # during rendezvous: two nodes wait for the third (last call 30 s) when the
            # leader, the member they talk to, dies; the third joins through the others
            procs += [_agent(f"n{i}", endpoint, "2:3", script, out) for i in (0, 1)]
            _wait_enrolled(cluster, 0, 2, out)
            cluster.kill(order[0])
            procs.append(_agent("n2", endpoint, "2:3", script, out))
            _training_since(out, 3, 0.0)
            cluster.start_member(order[0])
            cluster.wait_ready(require_all=True)

            # during training: the member they moved to becomes the leader and dies;
            # nobody stops (no restart at all)
            cluster.move_leader(order[1])
            cluster.kill(order[1])
            _nobody_stops(out, 3, time.time(), "leader killed in training")

            # a training node: the one whose group rank 0 hosts the workers' store
            host = next(tag for tag in step_times(out, 3) if tag.startswith("0-"))
            victim = int(host.rsplit("-", 1)[1].removeprefix("n"))
            os.killpg(procs[victim].pid, signal.SIGKILL)
            procs[victim].wait(10)
            lost = time.time()
            took = _training_since(out, 2, lost)
            print(f"node {victim} (group rank 0) killed: training again at 2 nodes in {took:.2f} s")
            survivors = [p for i, p in enumerate(procs) if i != victim]
            _stop_job(out, survivors, world=2)
            assert _restarts(out) and all("membership changed" in r for r in _restarts(out))
        finally:
            _kill_all(procs)


_ok, _why = netns_available()


@pytest.mark.netns
@pytest.mark.skipif(not _ok, reason=_why)
@pytest.mark.timeout(180)
def test_leader_link_cut_in_rendezvous_and_in_training(tmp_path: Path) -> None:
    """Five fake hosts: etcd members on h0-h2, training nodes on h3 and h4. The leader's
    host loses its link (silence, no reset) while h3 waits for h4, and again in training."""
    script = tmp_path / "train.py"
    script.write_text(STEP_WORKER)
    out = tmp_path / "out"
    out.mkdir()
    procs: list[subprocess.Popen[Any]] = []
    with Network(5) as net, EtcdCluster(3, hosts=net.hosts[:3]) as cluster:
        endpoint, order = _leader_first(cluster)
        try:
            h3, h4 = net.hosts[3], net.hosts[4]
            procs.append(_agent("n3", endpoint, "2", script, out, popen=h3.popen))
            _wait_enrolled(cluster, 0, 1, out)
            cluster.cut(order[0])  # the leader, and the member h3 watches the round on
            procs.append(_agent("n4", endpoint, "2", script, out, popen=h4.popen))
            _training_since(out, 2, 0.0)
            cluster.restore(order[0])
            cluster.wait_ready(require_all=True)

            second = order[1]  # where the agents moved: make it the leader, then cut it
            cluster.move_leader(second)
            cluster.cut(second)
            _nobody_stops(out, 2, time.time(), "leader's link cut in training")
            cluster.restore(second)
            _stop_job(out, procs, world=2)
        finally:
            _kill_all(procs)
